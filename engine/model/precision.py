"""Where a bf16 or fp16 model keeps fp32: the residual stream, rotary, and the logits every decision is taken on.

Greedy decoding picks the largest logit, so it is only as right as the gap between the two best is wide against
the rounding error. SmolLM2 asked "What is the capital of France?" scores "The" 25.325 and "L" 25.243 in fp32:
a gap of 0.08, under bf16's step of 0.125 at that size. With logits rounded to bf16 the two tie at 25.5 and
argmax takes the lower id, "L", and 256 tokens of "L'Étoile, la Marseillaise, la femme, …" follow. transformers'
own bf16 also rounds its logits to bf16, and happened to round these two apart.

So in a reduced-precision model kvscope keeps, without any per-architecture code:

- the residual stream in fp32: the input embeddings' output is upcast, so every ``residual + sublayer`` add
  promotes to fp32 and every norm returns fp32 (its weight times an fp32 tensor);
- the weights and the matmuls in the model's dtype: each linear layer's input is rounded to it (kvscope's C++
  linear does that itself; on oneDNN's the layer casts it first), so memory and the linears' speed stay those
  of bf16. On AMX (from a few rows up: prefill, batched decode) the C++ linear takes the input as two bf16
  parts instead, its rounding and the rounding of the rest: twice the tile work, still several times faster
  than the bf16 dot products of fewer rows, and near the fp32 input's product (kernels/linear_amx_cpu.cpp);
- the linears' outputs in fp32 where kvscope's C++ linear serves (``packed_linear.fp32_output``): its fp32 sums
  as they are, where a bf16 linear (transformers', or oneDNN's) rounds them. So the MLP's ``act(gate) * up`` is
  fp32 too, rounded once where the down projection takes it, and every sublayer reaches the residual stream
  unrounded. On SmolLM2 this took the logits' error against fp32 from 0.079 to 0.059 (docs/precision.md) for
  two more bytes per output value; torch has no CPU matmul that gives fp32 from bf16, so oneDNN's stay bf16;
- LayerNorms (GPT-2's, Phi's) in fp32 on fp32 copies of their weights, and the input of transformers' Conv1D
  (GPT-2's linears) rounded to the model's dtype like any linear's;
- rotary in fp32 (its cos/sin take the hidden states' dtype), with q/k/v cast to the KV pool's dtype by the
  attention (``attention.paged_attention_forward``), whose kernels compute in fp32 over the 16-bit pool and
  round once, at their output (``kernels/reference.py``, ``kernels/paged_attention_cpu.cpp``);
- the LM head in fp32 (the fp32 product of its bf16 weights): the logits are never rounded, and the sampler
  works on them in fp32, as vLLM's does.

``tests/test_truth.py`` holds the default path to agreeing with transformers' fp32 ``generate`` at least as
well as transformers' own bf16 does, on real chat prompts; ``kvscope bench`` prints that agreement beside
every speed figure.

``restore`` undoes all of it, so the same model can go back to stock transformers code (the bench's
transformers systems) or be prepared again for another engine.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from kvscope.engine.model import packed_linear

_HEAD_WEIGHT = "_kvscope_fp32_head_weight"
_EMBEDDING_HOOK = "_kvscope_fp32_embedding_hook"
_WRAPPED = "_kvscope_forward_before_fp32"   # the instance's own forward before ours (a packed one), or None


def keeps_fp32(dtype: torch.dtype) -> bool:
    return dtype in (torch.bfloat16, torch.float16)


def keep_fp32(model: nn.Module, dtype: torch.dtype) -> None:
    """Give ``model`` (already in ``dtype``, its linears packed or not) an fp32 residual stream and LM head."""
    if not keeps_fp32(dtype):
        return
    embeddings = model.get_input_embeddings()
    setattr(model, _EMBEDDING_HOOK, embeddings.register_forward_hook(_upcast_output))
    head = model.get_output_embeddings()
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            _fp32_layer_norm(module)
            continue
        if isinstance(module, Conv1D):
            _cast_input(module, dtype)
            continue
        if not isinstance(module, nn.Linear) or module is head:
            continue
        if packed_linear.rounds_its_input(module):
            _replace_forward(module, packed_linear.fp32_output(module))
        else:
            _cast_input(module, dtype)
    if isinstance(head, nn.Linear):
        _fp32_head(head)


def is_patched(model: nn.Module) -> bool:
    return hasattr(model, _EMBEDDING_HOOK) or any(_WRAPPED in module.__dict__ for module in model.modules())


def restore(model: nn.Module) -> None:
    """Take away what keep_fp32 added (a no-op on a model it never touched)."""
    hook = getattr(model, _EMBEDDING_HOOK, None)
    if hook is not None:
        hook.remove()
        delattr(model, _EMBEDDING_HOOK)
    for module in model.modules():
        if _WRAPPED not in module.__dict__:
            continue
        before = module.__dict__.pop(_WRAPPED)
        module.__dict__.pop(_HEAD_WEIGHT, None)
        if before is None:
            del module.forward
        else:
            module.forward = before


def has_fp32_head(module: nn.Module) -> bool:
    return hasattr(module, _HEAD_WEIGHT)


def _upcast_output(module, args, output: torch.Tensor) -> torch.Tensor:
    return output.float()


def _cast_input(module: nn.Linear, dtype: torch.dtype) -> None:
    """Wrap whatever forward the module has now (its class's, or a packed one) with a cast of its input."""
    inner = module.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return inner(x.to(dtype))

    _replace_forward(module, forward)


def _fp32_layer_norm(norm: nn.LayerNorm) -> None:
    """A LayerNorm (GPT-2's, Phi's) on the fp32 residual stream: torch's CPU kernel refuses an fp32 input with
    bf16 parameters ("mixed dtype"), so it normalises in fp32 with fp32 copies of its (small) weight and bias,
    and returns fp32 as RMSNorm does here."""
    weight = None if norm.weight is None else norm.weight.detach().float()
    bias = None if norm.bias is None else norm.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps)

    _replace_forward(norm, forward)


def _fp32_head(head: nn.Linear) -> None:
    """The LM head on an fp32 copy of its weight (exact: every bf16 value is an fp32 value), packed for oneDNN
    on CPU. The copy costs 4 bytes per vocabulary entry and hidden unit (113 MiB for SmolLM2); measured on 2
    cores, an fp32 head takes 2.5x a bf16 head's time for one row and no more than it from 64 rows up.
    Where kvscope's C++ linear serves, the same fp32 product is computed from the bf16 weights themselves, widened
    in registers (``packed_linear.exact_head``): half the bytes read per step, and no fp32 copy."""
    exact = packed_linear.exact_head(head)
    if exact is not None:
        forward, packed = exact
        _replace_forward(head, forward)
        setattr(head, _HEAD_WEIGHT, packed)
        return
    weight = head.weight.detach().float().contiguous()
    bias = None if head.bias is None else head.bias.detach().float()
    if weight.device.type == "cpu" and torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x.float(), packed, bias, "none", [], "")
    else:
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(x.float(), weight, bias)

    _replace_forward(head, forward)
    setattr(head, _HEAD_WEIGHT, weight)


def _replace_forward(module: nn.Module, forward) -> None:
    setattr(module, _WRAPPED, module.__dict__.get("forward"))
    module.forward = types.MethodType(forward, module)
