"""The patches kvscope puts on a transformers model come off again, all of them, in one call."""

from __future__ import annotations

import pytest
import torch
from models import tiny_model

from kvscope.engine.model import attention, fused_ops, packed_linear, patches, precision


def _stock_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _touched(model) -> dict[str, bool]:
    return {
        "linears": any(packed_linear.is_packed(m) for m in model.modules()),
        "norms": any(fused_ops.is_fused(m) for m in model.modules()),
        "rotary": fused_ops.rotary_is_fused(model),
        "attention": model.config._attn_implementation == attention.ATTENTION_NAME,
        "precision": precision.is_patched(model),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_restore_gives_back_the_stock_model_after_one_or_two_applies(dtype):
    model, _ = tiny_model("llama", dtype=dtype)
    model = model.to(dtype=dtype)   # as apply() leaves it: from_config keeps some buffers (rotary) in fp32
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    before = _stock_logits(model, ids)
    for _ in range(2):      # a model reused by a second engine is patched again
        model = patches.apply(model, torch.device("cpu"), dtype)
    assert _touched(model)["attention"]
    patches.restore(model)
    assert not any(_touched(model).values()), _touched(model)
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(_stock_logits(model, ids), before)


def test_the_patches_are_listed_in_their_apply_order():
    assert [patch.name for patch in patches.PATCHES] == ["linears", "norms", "rotary", "precision", "attention"]
