"""Which attention each decoder layer computes: full, or a sliding window of W tokens. The one rule for it.

The kernels take each layer's window from here, and the KV cache groups its layers by it: the two must agree,
or a block freed as out of the window would still be read. transformers' model classes mask a sliding layer
with ``kv_idx > q_idx - W`` (masking_utils.sliding_window_overlay), in every family that has one (Mistral,
Qwen2, Phi-3, Gemma 2 and 3, gpt-oss, ...): a query at position p sees keys at positions max(0, p-W+1) .. p,
W keys with itself. How a config says which layers slide differs by family and by age:

- ``layer_types`` (transformers normalises Gemma 2/3, gpt-oss, Qwen2, Cohere 2 ... to it): a
  ``"sliding_attention"`` layer has ``config.sliding_window``, a ``"full_attention"`` one none;
- ``sliding_window_pattern`` without ``layer_types`` (older Gemma 3 files): every pattern-th layer is full;
- otherwise ``sliding_window`` alone (Mistral, Phi-3, Mixtral, Starcoder2): every layer slides, unless
  ``use_sliding_window`` is false (Qwen2's switch).

A window is reported as the config gives it, even when it is longer than any context the engine will run;
the caller may treat such a layer as full.
"""

from __future__ import annotations

from kvscope.engine.model.loader import ModelError, refusal

SLIDING = "sliding_attention"
FULL = "full_attention"


def layer_attention_kinds(config) -> list[int | None]:
    """Per decoder layer, in order: the sliding window W in tokens, or None for full causal attention.

    Raises ModelError (one line naming the family) for a layer kind kvscope's kernels do not compute, such as
    chunked or linear attention.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_layers = text.num_hidden_layers
    window = getattr(text, "sliding_window", None) or None
    if getattr(text, "use_sliding_window", True) is False:
        window = None
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        unknown = sorted({kind for kind in layer_types if kind not in (SLIDING, FULL)})
        if unknown:
            raise ModelError(refusal(getattr(text, "model_type", None),
                                     f"it has {', '.join(unknown)} layers, which kvscope's attention kernels "
                                     "do not compute"))
        return [window if kind == SLIDING else None for kind in layer_types[:num_layers]]
    pattern = getattr(text, "sliding_window_pattern", None)
    if window and pattern:
        return [None if (layer + 1) % pattern == 0 else window for layer in range(num_layers)]
    return [window] * num_layers
