"""layer_attention_kinds, the one rule for each layer's window, against what transformers' own attention modules
pass to the attention function (the ``sliding_window`` keyword), family by family."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from models import tokenizer
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvscope.engine.model.layer_kinds import layer_attention_kinds
from kvscope.engine.model.loader import ModelError

FAMILIES = {
    "mistral": dict(sliding_window=24),
    "mistral-full": dict(model_type="mistral", sliding_window=None),
    "qwen2": dict(use_sliding_window=True, sliding_window=24, max_window_layers=1),
    "qwen2-full": dict(model_type="qwen2", use_sliding_window=False, sliding_window=24),
    "gemma2": dict(sliding_window=24),
    "gemma3_text": dict(sliding_window=24, num_hidden_layers=7),
    "gpt_oss": dict(sliding_window=24, num_local_experts=4, num_experts_per_tok=2),
    "phi3": dict(sliding_window=24),
    "llama": dict(),
}


def _windows_the_modules_pass(model) -> list[int | None]:
    seen: dict[int, int | None] = {}

    def probe(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = kwargs.get("sliding_window")
        for unused in ("s_aux", "softcap"):
            kwargs.pop(unused, None)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kvscope_window_probe", probe)
    model.set_attn_implementation("kvscope_window_probe")
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]))
    return [seen[layer] for layer in range(len(seen))]


@pytest.mark.parametrize("family", FAMILIES)
def test_kinds_are_the_windows_transformers_attention_modules_use(family):
    spec = dict(FAMILIES[family])
    model_type = spec.pop("model_type", family)
    spec.setdefault("num_hidden_layers", 3)
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer()), hidden_size=64, intermediate_size=128,
                                  head_dim=16, num_attention_heads=4, num_key_value_heads=2, **spec)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    kinds = layer_attention_kinds(config)
    assert kinds == _windows_the_modules_pass(model)
    assert len(kinds) == config.num_hidden_layers
    if family in ("gemma2", "gpt_oss", "gemma3_text", "qwen2"):
        assert None in kinds and 24 in kinds   # hybrid: full and sliding layers


def test_an_older_gemma3_config_with_only_a_pattern_slides_all_but_every_sixth_layer():
    config = SimpleNamespace(num_hidden_layers=12, sliding_window=512, sliding_window_pattern=6, model_type="gemma3")
    assert layer_attention_kinds(config) == [512] * 5 + [None] + [512] * 5 + [None]


def test_a_layer_kind_the_kernels_do_not_compute_is_refused_naming_the_family():
    config = SimpleNamespace(num_hidden_layers=2, layer_types=["chunked_attention", "full_attention"],
                             sliding_window=None, model_type="llama4_text")
    with pytest.raises(ModelError, match="cannot serve 'llama4_text' models: it has chunked_attention layers"):
        layer_attention_kinds(config)
