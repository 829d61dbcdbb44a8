"""Models for the tests: SmolLM2 from the local cache, and tiny random-weight decoders.

The tiny ones reuse SmolLM2's tokenizer so chat templates and detokenisation are
real. Their weights are drawn with a large init range so greedy decoding has
clear winners: tiny numeric differences between attention paths must not flip
an argmax.
"""

from __future__ import annotations

import functools

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from kvscope.engine.model.loader import resolve_model_path

TINY_ARCHS = {
    # llama with GQA 2:1
    "llama": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2),
    # qwen2 carries q/k/v biases; GQA 3:1
    "qwen2": dict(model_type="qwen2", num_attention_heads=6, num_key_value_heads=2),
    # mistral-style with multi-query attention, 8:1
    "mistral": dict(model_type="mistral", num_attention_heads=8, num_key_value_heads=1),
}


@functools.cache
def smollm2_path() -> str:
    return resolve_model_path("default")


@functools.cache
def tokenizer():
    return AutoTokenizer.from_pretrained(smollm2_path())


def load_smollm2(dtype=torch.float32):
    model = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=dtype, attn_implementation="sdpa")
    return model.eval(), tokenizer()


def tiny_model(arch: str = "llama", seed: int = 0, dtype=torch.float32, initializer_range: float = 0.2):
    """A fresh random-weight model; each call builds a new one, so an engine can't alter another's. A small
    ``initializer_range`` gives near ties between the best logits, as a trained model's are, for accuracy tests."""
    tok = tokenizer()
    spec = dict(TINY_ARCHS[arch])
    config = AutoConfig.for_model(
        spec.pop("model_type"), vocab_size=len(tok), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, head_dim=16, max_position_embeddings=1024, initializer_range=initializer_range,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True, attn_implementation="sdpa", **spec,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval(), tok


def reference_generate(model, tok, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate, EOS ignored, one prompt at a time (no padding effects)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                             dtype=torch.long), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tok.pad_token_id)
    return out[0, len(prompt_ids):].tolist()
