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

from kvscope.engine.model.loader import attention_to_load_with, resolve_model_path

TINY_ARCHS = {
    # llama with GQA 2:1
    "llama": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2),
    # qwen2 carries q/k/v biases; GQA 3:1
    "qwen2": dict(model_type="qwen2", num_attention_heads=6, num_key_value_heads=2),
    # mistral-style with multi-query attention, 8:1
    "mistral": dict(model_type="mistral", num_attention_heads=8, num_key_value_heads=1),
}

# Sliding-window families, each with a window of 24 tokens (shorter than most test prompts) and, where the family
# mixes them, both layer kinds in its two layers.
WINDOW = 24
TINY_WINDOW_ARCHS = {
    # every layer slides
    "mistral-window": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW),
    # layers from max_window_layers on slide: [full, sliding]
    "qwen2-window": dict(model_type="qwen2", num_attention_heads=6, num_key_value_heads=2, use_sliding_window=True,
                         sliding_window=WINDOW, max_window_layers=1),
    # [sliding, full], logit soft-capping, query_pre_attn_scalar scaling, final logit soft-capping
    "gemma2": dict(model_type="gemma2", num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW,
                   query_pre_attn_scalar=24, attn_logit_softcapping=20.0, final_logit_softcapping=30.0),
    # five local layers per global one in the real models; [sliding, full] here, with q/k norms
    "gemma3": dict(model_type="gemma3_text", num_attention_heads=4, num_key_value_heads=1, sliding_window=WINDOW,
                   query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"]),
    # [sliding, full], attention sinks, a mixture of experts
    "gpt_oss": dict(model_type="gpt_oss", num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW,
                    num_local_experts=4, num_experts_per_tok=2),
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
    spec = dict(TINY_ARCHS.get(arch) or TINY_WINDOW_ARCHS[arch])
    config = AutoConfig.for_model(
        spec.pop("model_type"), vocab_size=len(tok), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, head_dim=16, max_position_embeddings=1024, initializer_range=initializer_range,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True, **spec,
    )
    torch.manual_seed(seed)
    # sdpa where the family has it (Gemma 2 and gpt-oss have only eager), as kvscope loads a model.
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention_to_load_with(config))
    return model.eval(), tok


def reference_generate(model, tok, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate, EOS ignored, one prompt at a time (no padding effects)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                             dtype=torch.long), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tok.pad_token_id)
    return out[0, len(prompt_ids):].tolist()
