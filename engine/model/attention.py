"""Attention routed to kvscope's paged pool, through transformers' own attention interface.

The model's classes do all the other math. Attention is registered with transformers' AttentionInterface under
the name "kvscope" and reads the step's context (slot mapping, block tables, lengths) from a keyword argument
the model threads through to every attention call. No mask function is registered for that name, so
transformers builds no dense mask at all.

Each layer's variant reaches the kernels here: its sliding window (from engine/model/layer_kinds.py, the rule the
KV cache groups layers by; transformers' module passes the same window, and a disagreement is an error rather
than wrong tokens), the logit soft-cap (Gemma 2's ``softcap``), the attention sinks (gpt-oss's ``s_aux``) and
the module's own ``scaling`` (Gemma's query_pre_attn_scalar).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscope.engine.model.loader import ModelError
from kvscope.kernels import dispatch as kernels

ATTENTION_NAME = "kvscope"
_STOCK = "_kvscope_stock_attention"     # the implementation the model had before route(), for unroute()


@dataclass
class AttentionContext:
    """Everything paged attention needs for one step; the same object for every layer."""

    kv_cache: torch.Tensor           # [layers, 2, blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor       # [tokens] int64, prefill tokens first
    num_prefill_tokens: int
    prefill_block_tables: torch.Tensor | None
    prefill_cu_seqlens: torch.Tensor | None
    prefill_context_lens: torch.Tensor | None
    prefill_max_query_len: int
    decode_block_tables: torch.Tensor | None
    decode_context_lens: torch.Tensor | None
    layer_windows: tuple[int | None, ...]   # per layer: its sliding window, None for full attention


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            kvscope_ctx: AttentionContext | None = None, sliding_window: int | None = None,
                            softcap: float | None = None, s_aux: torch.Tensor | None = None, **kwargs):
    """transformers calls this per layer with query [1, Hq, T, D] and key/value [1, Hkv, T, D]."""
    if kvscope_ctx is None:
        raise RuntimeError("kvscope attention was called without a step context")
    ctx = kvscope_ctx
    window = ctx.layer_windows[module.layer_idx]
    if sliding_window is not None and sliding_window != window:
        raise RuntimeError(f"layer {module.layer_idx} attends with a sliding window of {sliding_window} tokens "
                           f"but kvscope's layer kinds say {window}")
    variant = dict(sliding_window=window, softcap=softcap or None, sinks=s_aux)
    kv_layer = ctx.kv_cache[module.layer_idx]
    # Rotary ran in fp32 in a bf16 model (engine/model/precision.py): q, k and v come down to the pool's dtype here.
    q = query[0].transpose(0, 1).to(kv_layer.dtype)
    kernels.store_kv(key[0].transpose(0, 1).to(kv_layer.dtype), value[0].transpose(0, 1).to(kv_layer.dtype),
                     kv_layer, ctx.slot_mapping)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    split = ctx.num_prefill_tokens
    parts = []
    if split:
        parts.append(kernels.paged_prefill_attention(q[:split], kv_layer, ctx.prefill_block_tables,
                                                     ctx.prefill_cu_seqlens, ctx.prefill_context_lens, scale,
                                                     ctx.prefill_max_query_len, **variant))
    if split < q.shape[0]:
        parts.append(kernels.paged_decode_attention(q[split:], kv_layer, ctx.decode_block_tables,
                                                    ctx.decode_context_lens, scale, **variant))
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.unsqueeze(0), None


def route(model) -> None:
    """Send every attention layer of ``model`` to the paged pool (one clear error for a model that cannot)."""
    if not getattr(model, "_supports_attention_backend", False):
        raise ModelError(f"{type(model).__name__} does not route attention through transformers' "
                         "AttentionInterface, so kvscope cannot page its KV cache; pick another model")
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    stock = model.config._attn_implementation
    if stock != ATTENTION_NAME:
        setattr(model, _STOCK, stock)
    model.set_attn_implementation(ATTENTION_NAME)


def unroute(model) -> None:
    """Give ``model`` back the attention it had before route() (a no-op on a model never routed)."""
    stock = model.__dict__.pop(_STOCK, None)
    if stock is not None:
        model.set_attn_implementation(stock)
