"""On a CUDA GPU, under pytest: the GPU check's correctness parts (tests/gpu/cuda_checks.py) and exact tokens on the
tiny architectures. `make gpu-check` runs the same parts as a script (docs/testing.md); without a GPU these skip
(the Triton kernels' logic is still tested on CPU under the interpreter, tests/kernels/triton/)."""

from __future__ import annotations

import random

import pytest
import torch

if not torch.cuda.is_available():
    # Skip before triton is imported: triton.jit picks compile or interpret once, at import, and on CPU
    # tests/kernels/triton/ needs the interpreter (its conftest sets TRITON_INTERPRET=1 before importing it).
    pytest.skip("no CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

import cuda_checks  # noqa: E402  (after the skip: it imports the kernels)
import random_models  # noqa: E402
from models import reference_generate, tiny_model  # noqa: E402

from kvscope.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from kvscope.engine.model.loader import load_model  # noqa: E402


def test_compiled_decode_and_prefill_match_the_torch_oracle():
    outcome = cuda_checks.kernels_against_oracle()
    assert outcome.passed, outcome.text


def test_the_sampler_on_cuda_keeps_first_maxima_and_seeded_rows():
    outcome = cuda_checks.sampler_on_device("cuda")
    assert outcome.passed, outcome.text


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_generation_on_cuda_is_token_identical_to_transformers(arch):
    model, tok = tiny_model(arch)
    model = model.cuda()
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(3, 60))] for _ in range(8)]
    expected = [reference_generate(model, tok, p, 12) for p in prompts]
    engine = LLMEngine(EngineConfig(device="cuda", dtype="float32", num_blocks=128, max_model_len=256,
                                    max_num_batched_tokens=64), model=model, tokenizer=tok)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [list(o.token_ids) for o in outputs] == expected


@pytest.fixture(scope="module")
def smollm2_shape(tmp_path_factory):
    shape = random_models.SMOLLM2_135M
    return str(random_models.build(shape, tmp_path_factory.mktemp("smollm2"), device="cuda"))


def test_the_smollm2_shape_on_cuda_is_token_identical_to_transformers(smollm2_shape):
    model, tokenizer = load_model(smollm2_shape, torch.float32, "cuda")
    outcome = cuda_checks.exact_tokens(model, tokenizer)
    assert outcome.passed, outcome.text


def test_decode_replayed_from_cuda_graphs_is_token_identical_to_transformers(smollm2_shape):
    model, tokenizer = load_model(smollm2_shape, torch.float32, "cuda")
    outcome = cuda_checks.graphs_exact_tokens(model, tokenizer)
    assert outcome.passed, outcome.text


def test_the_pool_grows_with_gpu_memory_utilization(smollm2_shape):
    model, tokenizer = load_model(smollm2_shape, torch.bfloat16, "cuda")
    outcome = cuda_checks.pool_sizing(model, tokenizer)
    assert outcome.passed, outcome.text
