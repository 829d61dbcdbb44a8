"""Linear layers on prepacked weights: the model's own matmuls, without a weight reorder or a heavy call on every step.

On CPU, ``nn.Linear`` hands its row-major weight to oneDNN (bf16) or MKL (fp32) on every call, and the library
first copies it into its own blocked layout, every call, for every layer. Packing each weight once removes that
copy. Two packings, the first that this machine has:

- kvscope's own C++ linear (``kernels/linear_cpu.cpp``, ``kernels.cpu.linear``): weights in panels of 16 columns,
  a few microseconds a call. torch's packed oneDNN linear costs about 35 us a call before any arithmetic, and a
  30-layer model makes over 200 calls a step: measured here, that was 7 ms of every decode step. Its arithmetic
  matches oneDNN's (fp32 FMAs; bf16 dot products, with the input rounded to bf16 as a stock bf16 linear does,
  on AMX tiles from a few rows up where the CPU has them), summed in fp32 and returned unrounded by ``fp32_output``.
- oneDNN's (``mkldnn._reorder_linear_weight`` + ``mkldnn._linear_pointwise``, what torch.compile's freezing pass
  does), where the C++ kernels cannot be built. Against stock ``nn.Linear`` on the mixed workload (8 requests,
  one thread, CPU time): 1.35x less in bf16 and 1.25x less in fp32 for the whole engine, tokens unchanged.

The packed copy takes the dense weight's place: the Parameter keeps its identity but holds an empty tensor, so
memory does not double. A weight another module also uses (the LM head tied to the embeddings) is packed and
kept. ``unpack_linears`` restores every dense weight exactly (the packed layout is a permutation), so the same
model can go back to stock transformers code, as the bench's transformers systems do.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from kvscope.kernels import cpu as cpu_kernels

_PACKED = "_kvscope_packed_weight"
_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or dtype not in _DTYPES:
        return False
    return cpu_kernels.linear_available() or _onednn_can_pack(dtype)


def _onednn_can_pack(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_for(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Pack ``model``'s linear layers (already in ``dtype`` on ``device``) where that helps."""
    if can_pack(dtype, device):
        pack_linears(model)


def is_packed(module: nn.Module) -> bool:
    return hasattr(module, _PACKED)


def pack_linears(model: nn.Module) -> int:
    """Pack every ``nn.Linear`` of ``model`` not packed yet; returns how many were."""
    shared = _weights_used_elsewhere(model)
    own = cpu_kernels.linear_available()
    count = 0
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, nn.Linear) or is_packed(module):
                continue
            weight = module.weight
            if own:
                setattr(module, _PACKED, cpu_kernels.pack_linear_weight(weight.detach()))
                module.forward = types.MethodType(_kvscope_forward, module)
            else:
                setattr(module, _PACKED, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))
                module.forward = types.MethodType(_onednn_forward, module)
            if weight.data_ptr() not in shared:
                weight.data = weight.data.new_empty(0)
            count += 1
    return count


def unpack_linears(model: nn.Module) -> None:
    """Give every packed ``nn.Linear`` of ``model`` its dense weight and its class's forward back."""
    with torch.no_grad():
        for module in model.modules():
            if not is_packed(module):
                continue
            packed = getattr(module, _PACKED)
            if module.weight.numel() == 0:
                module.weight.data = _unpack(module, packed)
            delattr(module, _PACKED)
            del module.forward  # the instance attribute; nn.Linear.forward shows through again


def rounds_its_input(module: nn.Module) -> bool:
    """Whether ``module`` runs on kvscope's packed linear, which takes an fp32 input and rounds it to the weight's
    dtype itself (as ``x.to(dtype)`` does: to nearest, ties to even), so a cast before it is one op for nothing."""
    return is_packed(module) and cpu_kernels.is_packed_linear_weight(getattr(module, _PACKED))


def fp32_output(module: nn.Linear):
    """A forward for a module on kvscope's C++ linear (``rounds_its_input``) that returns its fp32 sums as they
    are, not rounded to bf16: the input is still rounded as a bf16 linear's is, the output costs 2 more bytes a
    value (engine/model/precision.py)."""
    packed = getattr(module, _PACKED)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.linear(x, packed, self.out_features, self.bias, out_dtype=torch.float32)

    return forward


def exact_head(head: nn.Linear):
    """A forward for a bf16 LM head whose logits are the fp32 product of its bf16 weights and the fp32 hidden
    states, reading the 2-byte weights (half an fp32 copy's bytes per decode step); None where kvscope's C++
    linear is not available. Returns (forward, the packed weight it reads)."""
    if head.weight.device.type != "cpu" or head.weight.dtype != torch.bfloat16 or not cpu_kernels.linear_available():
        return None
    packed = getattr(head, _PACKED) if rounds_its_input(head) else cpu_kernels.pack_linear_weight(head.weight.detach())
    bias = None if head.bias is None else head.bias.detach().float()
    out_features = head.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.linear(x.float(), packed, out_features, bias, out_dtype=torch.float32, exact=True)

    return forward, packed


def _kvscope_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    packed = getattr(self, _PACKED)
    return cpu_kernels.linear(x, packed, self.out_features, self.bias, out_dtype=packed.dtype)


def _onednn_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, getattr(self, _PACKED), self.bias, "none", [], "")


def _unpack(module: nn.Linear, packed: torch.Tensor) -> torch.Tensor:
    if cpu_kernels.is_packed_linear_weight(packed):
        return cpu_kernels.unpack_linear_weight(packed, module.out_features, module.in_features)
    return packed.to_dense()


def _weights_used_elsewhere(model: nn.Module) -> set[int]:
    """Weights to keep dense: those of non-linear modules (embeddings, tied to the LM head) and the LM head's,
    whose shape callers read as the vocabulary size."""
    kept = {p.data_ptr() for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Linear):
        kept.add(head.weight.data_ptr())
    return kept
