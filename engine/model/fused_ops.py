"""Small ops in one C++ call each: a model's RMSNorm modules on ``kernels.cpu.rms_norm``, without per-model code.

A transformers decoder step is dozens of small ops per layer (norms, casts, rotary, the MLP's activation), each a
few microseconds of Python and dispatch before its arithmetic; on a 2-core CPU that was a quarter of a decode
step. Plugged in the way the packed linears are (``engine/model/packed_linear.py``): each module whose class is an
RMSNorm gets an instance ``forward`` that calls the C++ op in place of the class's seven ops.

Nothing is replaced on trust: each candidate is run both ways on a probe input, in the model's dtype and in
fp32 (the residual stream of a bf16 model, engine/model/precision.py), and keeps its own forward unless the two agree
to within a rounding step. A norm with another formula (Gemma's ``1 + weight``, for one) keeps its own forward.
``restore`` takes every replacement back, so the model can return to stock transformers code.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from kvscope.kernels import cpu as cpu_kernels

_FUSED = "_kvscope_fused_forward"
_EPS_NAMES = ("variance_epsilon", "eps", "epsilon")


def available(device: torch.device) -> bool:
    return device.type == "cpu" and cpu_kernels.available()


def fuse_norms(model: nn.Module) -> int:
    """Put every RMSNorm of ``model`` that computes the stock formula on the C++ op; returns how many."""
    count = 0
    for module in model.modules():
        eps = _rms_norm_eps(module)
        if eps is None or _FUSED in module.__dict__ or not _agrees(module, eps):
            continue
        module.forward = types.MethodType(_make_forward(eps), module)
        setattr(module, _FUSED, True)
        count += 1
    return count


def is_fused(module: nn.Module) -> bool:
    return _FUSED in module.__dict__


def restore(model: nn.Module) -> None:
    """Give every fused module its class's forward back (a no-op on a model never fused)."""
    for module in model.modules():
        if module.__dict__.pop(_FUSED, None):
            del module.forward


def _rms_norm_eps(module: nn.Module) -> float | None:
    """The epsilon of an RMSNorm-like leaf module with a 1-D weight, else None."""
    if "RMSNorm" not in type(module).__name__ or list(module.children()):
        return None
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    for name in _EPS_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _make_forward(eps: float):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.rms_norm(hidden_states, self.weight, eps)

    return forward


def _agrees(module: nn.Module, eps: float) -> bool:
    """The C++ op gives the module's own output, to within a rounding step, in fp32 and in the weight's dtype."""
    generator = torch.Generator().manual_seed(0)
    size = module.weight.shape[0]
    with torch.inference_mode():
        for dtype in {torch.float32, module.weight.dtype}:
            probe = (torch.randn(3, size, generator=generator) * 4).to(dtype)
            expected = module(probe)
            try:
                actual = cpu_kernels.rms_norm(probe, module.weight, eps)
            except RuntimeError:
                return False
            tolerance = 1e-5 if expected.dtype == torch.float32 else 1e-2
            if actual.dtype != expected.dtype or not torch.allclose(actual.float(), expected.float(),
                                                                    rtol=tolerance, atol=tolerance):
                return False
    return True
