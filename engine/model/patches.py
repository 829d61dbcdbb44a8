"""Every change kvscope makes to a transformers model, listed once, in the order it is applied, with one restore.

A model passed to an engine is patched in place; a model reused from an earlier engine, or handed back to stock
transformers (the bench's transformers systems), is restored first, so applying twice is safe. Each patch is
undone in the reverse order of its application, so a later patch never sees an earlier one half removed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kvscope.engine.model import attention, fused_ops, packed_linear, precision


@dataclass(frozen=True)
class Patch:
    name: str
    apply: Callable[[nn.Module, torch.device, torch.dtype], None]
    restore: Callable[[nn.Module], None]


def _fuse_norms(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    if fused_ops.available(device):
        fused_ops.fuse_norms(model)


def _fuse_rotary(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    if fused_ops.available(device):
        fused_ops.fuse_rotary(model)


PATCHES: tuple[Patch, ...] = (
    # Weights in the engine's dtype on its device, linears packed for the CPU's C++ matmul where that helps.
    Patch("linears", lambda model, device, dtype: packed_linear.pack_for(model, device, dtype),
          packed_linear.unpack_linears),
    # RMSNorm on one C++ op each, where the op agrees with the module's own formula.
    Patch("norms", _fuse_norms, fused_ops.restore),
    # Rotary on one C++ op, where it gives the modeling file's own function's bits.
    Patch("rotary", _fuse_rotary, fused_ops.restore_rotary),
    # In bf16/fp16: an fp32 residual stream and fp32 logits (engine/model/precision.py).
    Patch("precision", lambda model, device, dtype: precision.keep_fp32(model, dtype), precision.restore),
    # Attention reads and writes the paged KV pool (engine/model/attention.py).
    Patch("attention", lambda model, device, dtype: attention.route(model), attention.unroute),
)


def apply(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """``model`` in ``dtype`` on ``device``, in eval mode, with every patch applied in order."""
    restore(model)
    model = model.to(device=device, dtype=dtype).eval()
    for patch in PATCHES:
        patch.apply(model, device, dtype)
    return model


def restore(model: nn.Module) -> None:
    """Take every patch off ``model``, last applied first (a no-op on a stock model)."""
    for patch in reversed(PATCHES):
        patch.restore(model)
