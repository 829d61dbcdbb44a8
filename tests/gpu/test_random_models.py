"""The GPU check's random-weight models: the real models' shapes, and a folder kvscope and transformers load alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import random_models
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from kvscope.engine import EngineConfig, LLMEngine, SamplingParams
from kvscope.engine.model.loader import load_model, resolve_model_path


def _meta_shapes(config) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()
            if not (config.tie_word_embeddings and name == "lm_head.weight")}


def test_the_smollm2_shape_is_the_default_models_tensor_for_tensor():
    """Every weight of the real SmolLM2 (kvscope's default model, converted from its GGUF) has its name and shape
    in the random model, and nothing else is there."""
    folder = resolve_model_path("default")
    with safe_open(f"{folder}/model.safetensors", "pt") as real:
        shapes = {name: tuple(real.get_slice(name).get_shape()) for name in real.keys()}
    assert _meta_shapes(random_models.SMOLLM2_135M.llama_config()) == shapes
    real_config = json.loads((Path(folder) / "config.json").read_text())
    shape = random_models.SMOLLM2_135M.config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert shape[key] == real_config[key], key
    assert shape["rms_norm_eps"] == pytest.approx(real_config["rms_norm_eps"])
    assert shape["rope_parameters"]["rope_theta"] == real_config["rope_parameters"]["rope_theta"]


@pytest.mark.parametrize(("shape", "published"), [(random_models.SMOLLM2_135M, (134e6, 135e6)),
                                                  (random_models.LLAMA_3_2_1B, (1.23e9, 1.24e9))])
def test_each_shape_has_its_models_published_size(shape, published):
    """135M for SmolLM2-135M; 1.23B for Llama-3.2-1B, as its model card gives it."""
    low, high = published
    assert low <= random_models.parameter_count(shape.llama_config()) < high


def test_a_built_folder_loads_in_kvscope_and_its_greedy_tokens_are_transformers(tmp_path):
    """The check's exactness path at a tiny width: the folder through kvscope's loader, the engine's greedy tokens
    against transformers' generate on the same weights, context-dependent (not one token repeated)."""
    shape = random_models.SMOLLM2_135M
    overrides = random_models.tiny(shape)
    folder = random_models.build(shape, tmp_path / "smollm2", **overrides)
    model, tokenizer = load_model(str(folder), torch.float32, "cpu")
    assert model.config.vocab_size == len(tokenizer) == shape.config["vocab_size"]
    assert tokenizer.eos_token_id == shape.config["eos_token_id"]
    prompts = [[1000 + 37 * i + j for j in range(5 + 9 * i)] for i in range(3)]
    with torch.inference_mode():
        expected = [model.generate(torch.tensor([p]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                   pad_token_id=tokenizer.pad_token_id)[0, len(p):].tolist() for p in prompts]
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_blocks=32), model=model,
                       tokenizer=tokenizer)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [list(o.token_ids) for o in outputs] == expected
    assert len({token for tokens in expected for token in tokens}) > 3
    # Built once: the same recipe again keeps the folder.
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert random_models.build(shape, folder, **overrides) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
