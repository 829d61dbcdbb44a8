"""GPT-2- and Phi-style models (LayerNorm, and GPT-2's Conv1D linears) run in the default bf16.

kvscope keeps a bf16 model's residual stream in fp32 (engine/model/precision.py); torch's CPU LayerNorm refused
that fp32 input beside its bf16 weight ("mixed dtype"), so these families crashed on their first step. They must
generate, and stay as close to fp32 transformers as transformers' own bf16 does.
"""

from __future__ import annotations

import pytest
import torch
from models import tokenizer
from transformers import AutoConfig, AutoModelForCausalLM

from kvscope.engine import EngineConfig, LLMEngine, SamplingParams

FAMILIES = {
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=512),
    "phi": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=512),
}
NUM_TOKENS = 6


def tiny(family: str, dtype: torch.dtype):
    tok = tokenizer()
    config = AutoConfig.for_model(family, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, initializer_range=0.2,
                                  attn_implementation="sdpa", **FAMILIES[family])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval(), tok


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_layernorm_family_generates_in_bf16_as_close_to_fp32_as_transformers_bf16(family):
    fp32, tok = tiny(family, torch.float32)
    engine = LLMEngine(EngineConfig(dtype="bfloat16", num_blocks=32, max_model_len=128),
                       model=tiny(family, torch.float32)[0], tokenizer=tok)
    captured = []
    sample = engine.runner.sampler.sample_rows

    def spy(logits, rows, contexts):
        captured.append(logits.float().clone())
        return sample(logits, rows, contexts)

    engine.runner.sampler.sample_rows = spy
    prompt = tok.encode("The capital of France is")
    [output] = engine.generate([prompt], SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True))
    tokens = list(output.token_ids)
    assert len(tokens) == NUM_TOKENS
    ids = torch.tensor([prompt + tokens[:-1]])
    bf16 = tiny(family, torch.bfloat16)[0]
    with torch.inference_mode():
        truth = fp32(ids).logits[0, len(prompt) - 1:].float()
        theirs = bf16(ids).logits[0, len(prompt) - 1:].float()
    ours = torch.cat(captured)
    assert (ours - truth).pow(2).mean() <= (theirs - truth).pow(2).mean()
