"""kvscope's C++ linear and RMSNorm against float64 oracles, and the norm swap's refusal of other formulas.

The linear packs weights into panels of 16 columns and runs rows in tiles of 8 (16 and 32 on AMX, and k in steps
of 32 there), so sizes that are not multiples of those (and K odd, for the bf16 pairs) are where a layout bug
would show. Each bf16 case runs on every path this machine has: AMX tiles, vdpbf16ps, and the exact FMAs.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from kvscope.engine.model import fused_ops
from kvscope.kernels import cpu

needs_cpp = pytest.mark.skipif(not cpu.available(), reason=f"C++ kernels unavailable: {cpu.status()}")
FAST = settings(max_examples=40, deadline=None, derandomize=True, database=None)
NEVER = 2**62
AMX_ROWS = {"amx": 1, "default": cpu.AMX_MIN_ROWS, "vdpbf16ps": NEVER}  # the amx_min_rows that picks each path


def _oracle(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


@needs_cpp
@FAST
@given(m=st.integers(1, 40), k=st.integers(1, 70), n=st.integers(1, 70), weight_dtype=st.sampled_from(
    [torch.float32, torch.bfloat16]), input_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    with_bias=st.booleans(), exact=st.booleans(), path=st.sampled_from(sorted(AMX_ROWS)), seed=st.integers(0, 2**16))
def test_linear_matches_float64(m, k, n, weight_dtype, input_dtype, with_bias, exact, path, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(input_dtype)
    weight = torch.randn(n, k, generator=gen).to(weight_dtype)
    bias = torch.randn(n, generator=gen).to(weight_dtype) if with_bias else None
    packed = cpu.pack_linear_weight(weight)
    _check_linear(x, weight, bias, packed, exact, AMX_ROWS[path])
    assert torch.equal(cpu.unpack_linear_weight(packed, n, k), weight)


def _check_linear(x, weight, bias, packed, exact, amx_min_rows):
    (m, k), n = x.shape, weight.shape[0]
    out = cpu.linear(x, packed, n, bias, out_dtype=torch.float32, exact=exact, amx_min_rows=amx_min_rows)
    assert out.shape == (m, n) and out.dtype == torch.float32
    # vdpbf16ps rounds the input to bf16 first (as a stock bf16 linear does); AMX takes an fp32 input as two bf16
    # parts, its rounding and the rounding of what that left out. The oracle rounds as the path does.
    rounded = x if exact or weight.dtype == torch.float32 else _as_bf16_parts(x, amx=m >= amx_min_rows)
    torch.testing.assert_close(out.double(), _oracle(rounded, weight, bias), rtol=1e-5, atol=1e-4 * k ** 0.5)
    # A bf16 output is those fp32 sums rounded once, at the end.
    as_bf16 = cpu.linear(x, packed, n, bias, out_dtype=torch.bfloat16, exact=exact, amx_min_rows=amx_min_rows)
    assert torch.equal(as_bf16, out.to(torch.bfloat16))


def _as_bf16_parts(x: torch.Tensor, amx: bool) -> torch.Tensor:
    hi = x.to(torch.bfloat16)
    if not (amx and cpu.has_amx() and x.dtype == torch.float32):
        return hi
    return hi.double() + (x - hi.float()).to(torch.bfloat16).double()


@needs_cpp
@pytest.mark.parametrize(("m", "k", "n"), [(130, 577, 200), (257, 1536, 576), (47, 576, 1536), (16, 31, 33)])
@pytest.mark.parametrize("path", sorted(AMX_ROWS))
def test_bf16_linear_matches_float64_over_many_tiles(m, k, n, path):
    """Several row chunks of 128, k steps of 32 with a tail, panel pairs with padded columns: on every path."""
    gen = torch.Generator().manual_seed(m * k + n)
    x, weight = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen)
    _check_linear(x, weight, bias, cpu.pack_linear_weight(weight), exact=False, amx_min_rows=AMX_ROWS[path])


@needs_cpp
def test_the_default_linear_takes_amx_from_its_threshold_and_vdpbf16ps_below():
    weight = torch.randn(1536, 576).to(torch.bfloat16)
    packed = cpu.pack_linear_weight(weight)
    for m, path in ((cpu.AMX_MIN_ROWS - 1, "vdpbf16ps"), (cpu.AMX_MIN_ROWS, "amx")):
        x = torch.randn(m, 576)
        chosen = cpu.linear(x, packed, 1536, out_dtype=torch.float32, amx_min_rows=AMX_ROWS[path])
        assert torch.equal(cpu.linear(x, packed, 1536, out_dtype=torch.float32), chosen), m


@needs_cpp
@pytest.mark.skipif(not {"amx_tile", "amx_bf16"} <= set(cpu.cpu_flags().split()), reason="this CPU has no AMX")
def test_a_cpu_with_amx_runs_the_bf16_linear_on_it():
    """The build and Linux's permission both worked: a silent fallback would cost prefill 7x."""
    assert cpu.has_amx()


@needs_cpp
def test_linear_keeps_leading_dimensions_and_the_input_dtype():
    weight = torch.randn(24, 10, dtype=torch.bfloat16)
    x = torch.randn(1, 5, 10, dtype=torch.bfloat16)
    out = cpu.linear(x, cpu.pack_linear_weight(weight), 24)
    assert out.shape == (1, 5, 24) and out.dtype == torch.bfloat16
    assert cpu.linear(x[:, :0], cpu.pack_linear_weight(weight), 24).shape == (1, 0, 24)


class _LlamaStyleRMSNorm(nn.Module):
    """transformers' LlamaRMSNorm formula, copied: what the C++ op must reproduce."""

    def __init__(self, size: int, dtype: torch.dtype, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(size).to(dtype))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class _GemmaStyleRMSNorm(_LlamaStyleRMSNorm):
    """Another formula under the same name pattern: its weight is an offset from 1."""

    def forward(self, hidden_states):
        normalized = hidden_states.float() * torch.rsqrt(hidden_states.float().pow(2).mean(-1, keepdim=True) + 1e-5)
        return (normalized * (1.0 + self.weight.float())).to(hidden_states.dtype)


@needs_cpp
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_the_stock_formula(weight_dtype, input_dtype):
    norm = _LlamaStyleRMSNorm(576, weight_dtype)
    x = (torch.randn(2, 7, 576, generator=torch.Generator().manual_seed(0)) * 3).to(input_dtype)
    expected = norm(x)
    actual = cpu.rms_norm(x, norm.weight, norm.variance_epsilon)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    # A bf16 input rounds the normalised value to bf16 before the weight: a sum taken in another order may land
    # one bf16 step (1/128 relative) away, whatever the output's dtype.
    tolerance = 1e-5 if input_dtype == weight_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tolerance, atol=tolerance)


@needs_cpp
def test_only_norms_that_agree_with_the_op_are_swapped_and_restore_undoes_it():
    model = nn.Sequential(_LlamaStyleRMSNorm(64, torch.float32), _GemmaStyleRMSNorm(64, torch.float32))
    x = torch.randn(3, 64)
    with torch.inference_mode():
        before = [module(x) for module in model]
    assert fused_ops.fuse_norms(model) == 1
    assert fused_ops.is_fused(model[0]) and not fused_ops.is_fused(model[1])
    with torch.inference_mode():
        torch.testing.assert_close(model[0](x), before[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(model[1](x), before[1])
    fused_ops.restore(model)
    assert not fused_ops.is_fused(model[0]) and "forward" not in model[0].__dict__


@needs_cpp
@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 5), vocab=st.integers(1, 300), levels=st.integers(1, 4),
       seed=st.integers(0, 2**31 - 1), nan_at=st.one_of(st.none(), st.integers(0, 299)))
def test_first_argmax_is_torch_argmax_with_every_tie_and_tail(rows, vocab, levels, seed, nan_at):
    # Few distinct values, so a row's maximum stands in several lanes and chains, and in the tail past 64.
    logits = torch.randint(0, levels, (rows, vocab), generator=torch.Generator().manual_seed(seed)).float()
    logits[0] = float("-inf") if levels == 1 else logits[0]
    if nan_at is not None and nan_at < vocab:
        logits[rows - 1, nan_at] = float("nan")
    expected = logits.argmax(dim=1)
    expected[torch.isnan(logits).any(dim=1)] = -1
    assert cpu.first_argmax(logits).tolist() == expected.tolist()


@needs_cpp
@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(tokens=st.integers(1, 40), kv_heads=st.integers(1, 3), group=st.integers(1, 3),
       half=st.sampled_from([4, 16, 20, 32, 64]), seed=st.integers(0, 2**31 - 1))
def test_rotary_gives_every_bit_of_transformers_formula(tokens, kv_heads, group, half, seed):
    # Halves that are not a multiple of 16 run the masked tail; q and k come as the model makes them (transposed
    # views), with zeros of both signs, whose sign a subtraction instead of a negation would get wrong.
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, tokens, kv_heads * group, 2 * half, generator=generator).transpose(1, 2)
    k = torch.randn(1, tokens, kv_heads, 2 * half, generator=generator).transpose(1, 2)
    q[0, 0, 0, :2], k[0, 0, 0, half:half + 2] = 0.0, -0.0
    angles = torch.randn(1, tokens, 2 * half, generator=generator) * 4
    expected = apply_rotary_pos_emb(q, k, angles.cos(), angles.sin())
    actual = cpu.rotary(q, k, angles.cos(), angles.sin())
    for want, got in zip(expected, actual):
        assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())


@needs_cpp
def test_rotary_refuses_what_it_cannot_compute_in_one_line():
    q, cos = torch.randn(1, 2, 3, 8), torch.randn(1, 3, 8)
    with pytest.raises(RuntimeError, match="rotary's q must be a float32"):
        cpu.rotary(q.bfloat16(), q, cos, cos)
    with pytest.raises(RuntimeError, match="disagree in shape"):
        cpu.rotary(q, q, torch.randn(1, 4, 8), torch.randn(1, 4, 8))
