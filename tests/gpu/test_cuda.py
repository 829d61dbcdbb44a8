"""On a CUDA GPU: the compiled Triton kernels against the torch oracle, exact tokens against transformers' generate,
and the KV pool sized from --gpu-memory-utilization. `make gpu-check` runs these; without a GPU they skip (the
Triton kernels' logic is still tested on CPU under the interpreter, tests/triton/)."""

from __future__ import annotations

import random

import pytest
import torch
from models import reference_generate, tiny_model

from kvscope.engine import EngineConfig, LLMEngine, SamplingParams
from kvscope.kernels import dispatch as kernels
from kvscope.kernels import reference
from kvscope.kernels.testing import make_query, random_layout

if not torch.cuda.is_available():
    # Skip before triton is imported: triton.jit picks compile or interpret once, at import, and on CPU
    # tests/triton/ needs the interpreter (its conftest sets TRITON_INTERPRET=1 before importing it).
    pytest.skip("no CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_compiled_decode_and_prefill_match_the_torch_oracle(dtype, block_size):
    gen = torch.Generator().manual_seed(block_size)
    lens = [1, 17, 64, 300]
    layout = random_layout(lens, block_size, 2, 64, dtype, gen, poison_unused=False)
    kv, tables, context = layout.kv_layer.cuda(), layout.block_tables.cuda(), layout.context_lens.cuda()
    query = make_query(len(lens), 8, 64, dtype, gen).cuda()
    out = kernels.paged_decode_attention(query, kv, tables, context, 0.125)
    expected = reference.paged_decode_attention(query, kv, tables, context, 0.125)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-4,
                               rtol=0)
    cu_seqlens = torch.tensor([0, 1, 9, 9 + 40, 9 + 40 + 100], dtype=torch.int32, device="cuda")
    prefill_query = make_query(149, 8, 64, dtype, gen).cuda()
    out = kernels.paged_prefill_attention(prefill_query, kv, tables, cu_seqlens, context, 0.125, 100)
    expected = reference.paged_prefill_attention(prefill_query, kv, tables, cu_seqlens, context, 0.125, 100)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-4,
                               rtol=0)


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


def test_the_pool_grows_with_gpu_memory_utilization():
    sizes = []
    for utilisation in (0.3, 0.6):
        model, tok = tiny_model("llama")
        engine = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", gpu_memory_utilization=utilisation,
                                        max_model_len=256), model=model, tokenizer=tok)
        sizes.append(engine.num_blocks)
        del engine
        torch.cuda.empty_cache()
    assert 0 < sizes[0] < sizes[1]
