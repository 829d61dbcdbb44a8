"""Small ops in one C++ call each, without per-model code: a model's RMSNorm modules on ``kernels.cpu.rms_norm``, and
its rotary embedding on ``kernels.cpu.rotary``.

A transformers decoder step is dozens of small ops per layer (norms, casts, rotary, the MLP's activation), each a
few microseconds of Python and dispatch before its arithmetic; on a 2-core CPU that was a quarter of a decode
step. Plugged in the way the packed linears are (``engine/model/packed_linear.py``): each module whose class is an
RMSNorm gets an instance ``forward`` that calls the C++ op in place of the class's seven ops.

Nothing is replaced on trust: each candidate is run both ways on a probe input, in the model's dtype and in
fp32 (the residual stream of a bf16 model, engine/model/precision.py), and keeps its own forward unless the two agree
to within a rounding step. A norm with another formula (Gemma's ``1 + weight``, for one) keeps its own forward.
``restore`` takes every replacement back, so the model can return to stock transformers code.

Rotary is a function, not a module: each architecture's modeling file defines its own ``apply_rotary_pos_emb``
and the attention's forward looks it up there at every call. So the function is replaced in that file, for as
long as any patched model of the architecture lives (counted; the last ``restore``, or the collection of the
last patched model nobody restored, puts the stock one back), and only where it computes the rotate-half
formula bit for bit like the C++ op on a probe. The replacement hands anything but fp32 CPU tensors of the usual
shapes (which the op refuses) to the stock function, so another model of the same architecture in the process
computes exactly what it would have.
"""

from __future__ import annotations

import functools
import sys
import types
import weakref

import torch
from torch import nn

from kvscope.kernels import cpu as cpu_kernels

_FUSED = "_kvscope_fused_forward"
_EPS_NAMES = ("variance_epsilon", "eps", "epsilon")
_ROTARY = "apply_rotary_pos_emb"
_ROTARY_FILES = "_kvscope_rotary_files"    # on a model: a release per modeling file whose rotary it swapped
# modeling file -> [its stock apply_rotary_pos_emb, how many patched models use the C++ one there]
_rotary_users: dict[types.ModuleType, list] = {}


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


def fuse_rotary(model: nn.Module) -> int:
    """Put the rotary of every modeling file ``model``'s modules come from on the C++ op, where it computes the
    same bits; returns how many files. The file keeps it until ``model`` is restored or collected."""
    releases = []
    for name in sorted({type(module).__module__ for module in model.modules()}):
        file = sys.modules.get(name)
        if file in _rotary_users:
            _rotary_users[file][1] += 1
        elif callable(stock := getattr(file, _ROTARY, None)) and _rotary_agrees(stock):
            setattr(file, _ROTARY, _fast_rotary(stock))
            _rotary_users[file] = [stock, 1]
        else:
            continue
        # Runs once: at restore_rotary, or when a model nobody restored is collected (an engine just dropped).
        releases.append(weakref.finalize(model, _release_rotary, file))
    model.__dict__[_ROTARY_FILES] = releases
    return len(releases)


def restore(model: nn.Module) -> None:
    """Give every fused module its class's forward back (a no-op on a model never fused)."""
    for module in model.modules():
        if module.__dict__.pop(_FUSED, None):
            del module.forward


def rotary_is_fused(model: nn.Module) -> bool:
    return bool(model.__dict__.get(_ROTARY_FILES))


def restore_rotary(model: nn.Module) -> None:
    """Give the modeling files of ``model`` their stock rotary once no patched model uses the C++ one (a no-op on a
    model never fused)."""
    for release in model.__dict__.pop(_ROTARY_FILES, ()):
        release()


def _release_rotary(file: types.ModuleType) -> None:
    users = _rotary_users[file]
    users[1] -= 1
    if users[1] == 0:
        setattr(file, _ROTARY, users[0])
        del _rotary_users[file]


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


def _fast_rotary(stock):
    @functools.wraps(stock)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        # The op checks what it takes (fp32 CPU tensors of the usual shapes) and refuses anything else in one
        # error: that, another broadcast axis, or a call that wants gradients is the stock function's.
        usual_call = not args and kwargs in ({}, {"unsqueeze_dim": 1})
        if usual_call and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)):
            try:
                return cpu_kernels.rotary(q, k, cos, sin)
            except (RuntimeError, TypeError):
                pass
        return stock(q, k, cos, sin, *args, **kwargs)

    return apply_rotary_pos_emb


def _rotary_agrees(stock) -> bool:
    """``stock`` gives the C++ op's bits on a probe (grouped heads, a transposed layout, zeros of both signs)."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 5, 4, 64, generator=generator).transpose(1, 2)
    k = torch.randn(1, 5, 2, 64, generator=generator).transpose(1, 2)
    q[0, 0, 0, :2], q[0, 0, 0, 32:34] = 0.0, -0.0
    angles = torch.randn(1, 5, 64, generator=generator) * 3
    with torch.inference_mode():
        try:
            expected = stock(q, k, angles.cos(), angles.sin())
            actual = cpu_kernels.rotary(q, k, angles.cos(), angles.sin())
        except (TypeError, RuntimeError, ValueError):
            return False
    return (isinstance(expected, tuple) and len(expected) == 2 and
            all(torch.equal(e, a) and torch.equal(e.signbit(), a.signbit()) for e, a in zip(expected, actual)))
