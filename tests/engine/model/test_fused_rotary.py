"""Rotary on the C++ op: swapped into a modeling file only where it gives that file's own bits, counted across the
models that use it, and handed back when the last one is restored; anything the op does not take goes to the
stock function."""

from __future__ import annotations

import gc
import sys
import types

import pytest
import torch
from models import tiny_model
from transformers.models.llama import modeling_llama

from kvscope.engine.model import fused_ops, patches
from kvscope.kernels import cpu

needs_cpp = pytest.mark.skipif(not cpu.available(), reason=f"C++ kernels unavailable: {cpu.status()}")
CPU = torch.device("cpu")


@pytest.fixture
def modeling_file():
    """A modeling file of its own (no other test's model shares it), whose rotary is transformers' Llama one, and
    a class of module that comes from it."""
    file = types.ModuleType("kvscope_test_modeling_file")
    stock = modeling_llama.apply_rotary_pos_emb
    file.apply_rotary_pos_emb = getattr(stock, "__wrapped__", stock)     # stock, even while a Llama is patched
    file.Layer = type("Layer", (torch.nn.Linear,), {"__module__": file.__name__})
    sys.modules[file.__name__] = file
    yield file
    del sys.modules[file.__name__]


@needs_cpp
def test_the_file_gets_its_stock_rotary_back_when_the_last_model_is_restored(modeling_file):
    stock = modeling_file.apply_rotary_pos_emb
    first, second = modeling_file.Layer(2, 2), modeling_file.Layer(2, 2)
    assert fused_ops.fuse_rotary(first) == 1 and fused_ops.fuse_rotary(second) == 1
    assert fused_ops.rotary_is_fused(first) and modeling_file.apply_rotary_pos_emb is not stock
    fused_ops.restore_rotary(first)
    fused_ops.restore_rotary(first)     # twice is once
    assert modeling_file.apply_rotary_pos_emb is not stock     # the second model still uses it
    fused_ops.restore_rotary(second)
    assert modeling_file.apply_rotary_pos_emb is stock and not fused_ops.rotary_is_fused(second)


@needs_cpp
def test_a_model_dropped_without_restore_gives_the_stock_rotary_back_when_collected(modeling_file):
    stock = modeling_file.apply_rotary_pos_emb
    model = modeling_file.Layer(2, 2)
    fused_ops.fuse_rotary(model)
    assert modeling_file.apply_rotary_pos_emb is not stock
    del model
    gc.collect()
    assert modeling_file.apply_rotary_pos_emb is stock


@needs_cpp
def test_a_patched_model_computes_the_same_logits_with_and_without_the_op():
    model, _ = tiny_model("llama")
    ids = torch.tensor([[1, 5, 9, 14, 3, 8, 2]])
    patches.apply(model, CPU, torch.float32)
    try:
        assert fused_ops.rotary_is_fused(model)
        patched = modeling_llama.apply_rotary_pos_emb
        calls = []

        def counted(*args, **kwargs):
            calls.append(1)
            return patched(*args, **kwargs)

        modeling_llama.apply_rotary_pos_emb = counted
        with torch.inference_mode():
            fused = _sdpa_logits(model, ids)
        modeling_llama.apply_rotary_pos_emb = patched.__wrapped__
        with torch.inference_mode():
            stock = _sdpa_logits(model, ids)
        modeling_llama.apply_rotary_pos_emb = patched
    finally:
        patches.restore(model)
    assert calls and torch.equal(fused, stock)


def _sdpa_logits(model, ids):
    """The model's logits through transformers' own attention, so that only rotary differs between two runs."""
    stock = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        return model(ids).logits
    finally:
        model.set_attn_implementation(stock)


@needs_cpp
def test_a_file_whose_rotary_is_another_formula_keeps_it():
    def interleaved(q, k, cos, sin, unsqueeze_dim=1):     # GPT-J's pairs (0, 1), (2, 3), ...: not rotate-half
        def rotate(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin

    file = types.ModuleType("kvscope_test_interleaved_rotary")
    file.apply_rotary_pos_emb = interleaved
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model[0].__class__ = type("Linear", (torch.nn.Linear,), {"__module__": file.__name__})
    sys.modules[file.__name__] = file
    try:
        assert fused_ops.fuse_rotary(model) == 0
        assert file.apply_rotary_pos_emb is interleaved
    finally:
        del sys.modules[file.__name__]


@needs_cpp
def test_what_the_op_does_not_take_goes_to_the_stock_function():
    seen = []

    def stock(q, k, cos, sin, unsqueeze_dim=1):
        seen.append(q.dtype)
        return q, k

    fast = fused_ops._fast_rotary(stock)
    q, cos = torch.randn(1, 2, 3, 8), torch.randn(1, 3, 8)
    fast(q, q, cos, cos)
    assert seen == []
    fast(q.bfloat16(), q.bfloat16(), cos.bfloat16(), cos.bfloat16())     # bf16
    fast(q.transpose(1, 2), q.transpose(1, 2), cos, cos, unsqueeze_dim=2)   # heads on another axis
    fast(q[..., :6], q[..., :6], cos[..., :6], cos[..., :6])          # a head dim the op could take: it does
    fast(q, q, cos[..., :4], cos[..., :4])                            # partial rotary (cos shorter than the head)
    wants_grad = q.clone().requires_grad_()
    with torch.enable_grad():
        fast(wants_grad, q, cos, cos)                                 # the op has no backward
    assert seen == [torch.bfloat16, torch.float32, torch.float32, torch.float32]
