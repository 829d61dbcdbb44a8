"""The attention variants every kernel computes, defined once in torch: sliding windows, soft-capped logits, sinks.

These are the definitions the reference kernels use where SDPA cannot express a variant, and that the kernel
tests' oracle (``kernels/testing.py``) checks every backend against. Per layer, on top of causal attention:

- ``sliding_window`` W (None: full): a query at position p sees keys at positions max(0, p-W+1) .. p, W keys
  with itself, as transformers masks a sliding layer (``kv_idx > q_idx - W``). A kernel never reads a
  block-table entry of a block that lies wholly before the earliest position any of its queries sees
  (``first_visible``): the engine may free such blocks and leave any id there.
- ``softcap`` c (None: off; Gemma 2): each scaled score s becomes c * tanh(s / c) before masking and softmax.
- ``sinks`` (None: off; gpt-oss): one logit per query head that joins the softmax's denominator and carries
  no value: weights are e^(s_j - m) / (sum_j e^(s_j - m) + e^(sink - m)), m the maximum over the s_j and the sink.
"""

from __future__ import annotations

import torch


def first_visible(first_query_position: torch.Tensor | int, sliding_window: int | None):
    """The earliest key position a query at ``first_query_position`` (or later) can see."""
    if sliding_window is None:
        return first_query_position * 0
    if isinstance(first_query_position, torch.Tensor):
        return (first_query_position - sliding_window + 1).clamp(min=0)
    return max(0, first_query_position - sliding_window + 1)


def soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """c * tanh(s / c), leaving masked (-inf) scores masked."""
    if not softcap:
        return scores
    return torch.where(torch.isneginf(scores), scores, torch.tanh(scores / softcap) * softcap)


def softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dimension, with ``sinks`` (broadcastable to ``scores[..., :1]``) in the denominator."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sinks = sinks.to(scores.dtype)
    top = torch.maximum(scores.amax(-1, keepdim=True), sinks)
    weights = (scores - top).exp()
    return weights / (weights.sum(-1, keepdim=True) + (sinks - top).exp())


def explicit_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor | None,
                       scale: float, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention written out, for the variants SDPA has no argument for.

    ``query`` [..., n, D] over ``key``/``value`` [..., ctx, D] (heads already matched), ``visible`` a boolean
    mask broadcastable to [..., n, ctx] (or None), ``sinks`` broadcastable to [..., n, 1].
    """
    scores = soft_cap(query @ key.transpose(-1, -2) * scale, softcap)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    return softmax(scores, sinks) @ value


def window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor,
                sliding_window: int | None) -> torch.Tensor:
    """visible[i, j]: whether the query at ``query_positions[i]`` sees the key at ``key_positions[j]``."""
    distance = query_positions[:, None] - key_positions[None, :]
    visible = distance >= 0
    if sliding_window is not None:
        visible &= distance < sliding_window
    return visible
