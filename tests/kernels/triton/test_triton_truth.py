"""The engine on the Triton kernels tells the truth as it does on the CPU kernels (tests/test_truth.py).

Here every kernel call goes to ``kernels.triton_ops``, run by Triton's interpreter on CPU tensors, so the shapes
stay small: a tiny bf16 model (tests/models.py) whose small weights give near ties between the best logits, as a
trained model's are. On chat prompts, greedy, EOS ignored, the engine's tokens must agree with transformers'
fp32 ``generate`` at least as well as transformers' bf16 ``generate`` does (no fewer first tokens right, a mean
leading agreement no shorter), and its logits, each against fp32's on the same tokens, must be closer than
transformers' bf16 logits are. (Under the interpreter the kernels compute 16-bit caches in fp32; on a GPU they
use bf16 dots with fp32 accumulation, as FlashAttention does.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from closeness import closeness, greedy_with_logits
from models import tiny_model

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kvscope.app.bench.accuracy import agreement, transformers_greedy  # noqa: E402
from kvscope.engine import EngineConfig, LLMEngine  # noqa: E402
from kvscope.kernels import dispatch as kernels  # noqa: E402
from kvscope.kernels import triton_ops  # noqa: E402

if not isinstance(triton_ops._store_kv_kernel, InterpretedFunction):
    pytest.skip("kvscope.kernels.triton_ops was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

QUESTIONS = [line.strip() for line in (Path(__file__).parents[2] / "data" / "chat_questions.txt").read_text()
             .splitlines() if line.strip()][:8]
TOKENS = 8
NEAR_TIES = dict(seed=1, initializer_range=0.05)   # first-token margins of 0.015-0.16 on these prompts


def test_the_triton_path_agrees_with_fp32_at_least_as_well_as_transformers_bf16(monkeypatch):
    monkeypatch.setattr(kernels, "_backend", lambda tensor: triton_ops)
    fp32, tok = tiny_model("llama", **NEAR_TIES)
    bf16, _ = tiny_model("llama", dtype=torch.bfloat16, **NEAR_TIES)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       return_dict=True)["input_ids"] for q in QUESTIONS]
    reference = [transformers_greedy(fp32, p, TOKENS, tok.pad_token_id) for p in prompts]
    theirs = agreement([transformers_greedy(bf16, p, TOKENS, tok.pad_token_id) for p in prompts], reference, TOKENS)
    engine = LLMEngine(EngineConfig(dtype="bfloat16", num_blocks=64, max_model_len=256),
                       model=tiny_model("llama", **NEAR_TIES)[0], tokenizer=tok)
    outputs, logits = greedy_with_logits(engine, prompts, TOKENS)
    ours = agreement([o.token_ids for o in outputs], reference, TOKENS)
    assert ours.at_least_as_good_as(theirs), f"kvscope {ours.text()}, transformers bf16 {theirs.text()}"
    mine, transformers_bf16 = closeness(prompts, outputs, logits, fp32, bf16)
    assert mine.rms < transformers_bf16.rms, f"kvscope {mine.text()}; transformers bf16 {transformers_bf16.text()}"
