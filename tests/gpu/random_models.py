"""Random-weight models of real models' shapes, for the GPU check on a machine that has no weights to load.

Throughput depends on the shapes (widths, layers, heads, vocabulary), not on the weights' values, and exactness
is checked against transformers on the same weights, so a model of SmolLM2-135M's shape and one of a 1B Llama's
(Llama-3.2-1B) answer the check's questions without a download. The shapes are the published config.json values,
written out here with where each comes from; the weights are transformers' own random initialisation.

A synthetic word-level tokenizer of the model's vocabulary size goes beside them: the check's prompts are token
ids, and the engine and transformers need a tokenizer only to know the special ids and to decode. It is built
from nothing, so the folder needs no file from the hub either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WEIGHTS_DTYPE = torch.bfloat16     # what both published checkpoints hold ("torch_dtype": "bfloat16")
# transformers draws each weight from N(0, initializer_range). Both published configs say 0.02, a training start;
# at 0.02 the layers add little to the token's embedding and greedy decoding repeats one token whatever the
# attention computed, so an exactness check would pass on a broken kernel. At 0.1 each next token depends on the
# context (measured on SmolLM2's shape: eight different tokens from eight steps, the best two logits 0.07-0.12
# apart, fp32's rounding being about 1e-5).
INITIALIZER_RANGE = 0.1


@dataclass(frozen=True)
class Shape:
    name: str
    source: str                 # where the numbers come from
    config: dict = field(default_factory=dict)     # LlamaConfig keyword arguments

    def llama_config(self, **overrides) -> LlamaConfig:
        return LlamaConfig(**(self.config | overrides))


# HuggingFaceTB/SmolLM2-135M-Instruct's config.json on the hub; kvscope's default model is its GGUF, and the
# config kvscope converts from that file carries the same values (tests/gpu/test_random_models.py compares them).
SMOLLM2_135M = Shape("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct config.json", {
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "hidden_act": "silu",
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
})

# meta-llama/Llama-3.2-1B's config.json on the hub (gated; the Instruct model's has the same shape), as quoted
# with its commit in public code (kevinstephano/thunder_model_blocks, hf_llama/llama_config.py).
LLAMA_3_2_1B = Shape("llama-3.2-1b", "meta-llama/Llama-3.2-1B config.json", {
    "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "hidden_act": "silu",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "bos_token_id": 128000, "eos_token_id": 128001,
})

SHAPES = {shape.name: shape for shape in (SMOLLM2_135M, LLAMA_3_2_1B)}

MARKER = "kvscope-random-model.json"


def tiny(shape: Shape) -> dict:
    """The overrides of a shape's stand-in for tests: its vocabulary and its query heads to a KV head (one KV
    head), 16 wide a head, two layers."""
    heads = shape.config["num_attention_heads"] // shape.config["num_key_value_heads"]
    return {"hidden_size": 16 * heads, "intermediate_size": 32 * heads, "num_hidden_layers": 2, "head_dim": 16,
            "num_attention_heads": heads, "num_key_value_heads": 1}


def parameter_count(config: LlamaConfig) -> int:
    """The model's parameters, counted on the meta device (no memory, no time)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


def synthetic_tokenizer(config: LlamaConfig) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with one word per id ("t123"), the config's special ids at their places."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = {config.bos_token_id: "<s>", config.eos_token_id: "</s>", 0: "<unk>"}
    vocab = {specials.get(i, f"t{i}"): i for i in range(config.vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    pad = specials[config.pad_token_id] if config.pad_token_id is not None else "</s>"
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token=pad)


def build(shape: Shape, directory: Path, *, device: str = "cpu", seed: int = 0, **overrides) -> Path:
    """Write a random-weight model of ``shape`` (with ``overrides``, as TINY) and its tokenizer to ``directory``,
    a transformers model folder `--model` takes. Kept when already built from the same shape and seed."""
    directory = Path(directory)
    recipe = {"shape": shape.name, "source": shape.source, "seed": seed, "overrides": overrides,
              "initializer_range": INITIALIZER_RANGE}
    marker = directory / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == recipe:
        return directory
    config = shape.llama_config(**({"initializer_range": INITIALIZER_RANGE} | overrides))
    torch.manual_seed(seed)
    with torch.device(device):      # initialised where it will run: a 1B model's init is seconds on a GPU
        model = LlamaForCausalLM(config).to(WEIGHTS_DTYPE)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    synthetic_tokenizer(config).save_pretrained(directory)
    marker.write_text(json.dumps(recipe))
    return directory
