"""Prepacked linear layers: same outputs as nn.Linear, dense weights restored exactly, tied weights kept."""

from __future__ import annotations

import pytest
import torch
from models import tiny_model

from kvscope.engine.model import attention, packed_linear, patches
from kvscope.engine.model.packed_linear import is_packed, pack_linears, unpack_linears

pytestmark = pytest.mark.skipif(not packed_linear.can_pack(torch.float32, torch.device("cpu")),
                                reason="this torch has no oneDNN")


def _linears(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_packed_forward_matches_the_dense_one_and_unpacking_restores_it(arch):
    model, _ = tiny_model(arch)
    dense = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.tensor([[5, 900, 31, 7, 2048]])
    with torch.inference_mode():
        expected = model(ids).logits
    assert pack_linears(model) == len(_linears(model))
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)
    unpack_linears(model)
    assert not any(is_packed(m) for m in model.modules())
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, dense[name]), name
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, expected)


def test_packing_frees_dense_weights_but_keeps_the_tied_head_and_embeddings():
    model, _ = tiny_model("llama")
    pack_linears(model)
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    assert head.weight is embed.weight and head.weight.numel() == embed.num_embeddings * embed.embedding_dim
    q_proj = model.model.layers[0].self_attn.q_proj
    assert is_packed(q_proj) and q_proj.weight.numel() == 0
    assert pack_linears(model) == 0  # already packed: nothing to do


def test_applying_the_patches_again_repacks_a_reused_model_in_a_new_dtype():
    model, _ = tiny_model("llama")
    patches.apply(model, torch.device("cpu"), torch.float32)
    model = patches.apply(model, torch.device("cpu"), torch.bfloat16)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert getattr(q_proj, packed_linear._PACKED).dtype == torch.bfloat16 or not is_packed(q_proj)
    attention.unroute(model)    # a plain forward, on the packed linears, needs no paged pool
    with torch.inference_mode():
        # the bf16 model runs on its repacked weights; its logits are fp32, as the precision patch keeps them
        assert model(torch.tensor([[5, 6, 7]])).logits.dtype == torch.float32
