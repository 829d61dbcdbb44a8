"""Decode's CUDA graphs (engine/model/cuda_graphs.py) where no GPU is: the buckets, what a replay writes into the
graphs' buffers (padded rows included), when a step is replayed, and the tokens of an engine whose decode steps
go through the graphs' buffers. A stand-in graph runs the captured forward again on replay: what the buffers feed
the forward is what a real graph would read (tests/support/graph_stand_in.py). tests/gpu/test_cuda.py replays
real graphs on a GPU."""

from __future__ import annotations

import random

import pytest
import torch
from graph_stand_in import graphs_on_cpu, skip_padded_slots
from models import reference_generate, tiny_model

from kvscope.engine import EngineConfig, LLMEngine, SamplingParams
from kvscope.engine.model.attention import AttentionContext
from kvscope.engine.model.cuda_graphs import PAD_SLOT, DecodeGraphs, bucket_sizes


def test_buckets_are_1_2_4_then_every_8_up_to_the_first_that_holds_max_num_seqs():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(3) == [1, 2, 4]
    assert bucket_sizes(9) == [1, 2, 4, 8, 16]
    sizes = bucket_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35


def _context(kv_cache, slots, lens, tables, num_prefill_tokens=0) -> AttentionContext:
    return AttentionContext(kv_cache=kv_cache, slot_mapping=torch.tensor(slots), num_prefill_tokens=num_prefill_tokens,
                            prefill_block_tables=None, prefill_cu_seqlens=None, prefill_context_lens=None,
                            prefill_max_query_len=0, decode_block_tables=torch.tensor(tables, dtype=torch.int32),
                            decode_context_lens=torch.tensor(lens, dtype=torch.int32), layer_windows=(None,))


class Recorder:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def test_a_replay_fills_the_first_rows_and_pads_the_rest_of_its_bucket():
    kv_cache = torch.zeros((1, 2, 32, 4, 1, 8))
    graphs = DecodeGraphs(model=None, kv_cache=kv_cache, layer_windows=(None,), max_num_seqs=8, max_model_len=64,
                          block_size=4)
    graphs.slot_mapping.fill_(5)    # stale values of an earlier, larger step
    graphs.context_lens.fill_(9)
    recorders = {size: Recorder() for size in graphs.sizes}
    graphs.graphs = recorders
    graphs.logits = torch.arange(8 * 3.0).view(8, 3)
    ctx = _context(kv_cache, [17, 30, 41], [2, 3, 6], [[4, 4], [7, 7], [10, 11]])
    logits = graphs.replay(ctx, torch.tensor([[11, 12, 13]]), torch.tensor([[1, 2, 5]]))
    assert recorders[4].replays == 1 and all(r.replays == 0 for size, r in recorders.items() if size != 4)
    assert logits.tolist() == graphs.logits[:3].tolist()
    assert graphs.input_ids[0, :3].tolist() == [11, 12, 13] and graphs.positions[0, :3].tolist() == [1, 2, 5]
    assert graphs.slot_mapping[:4].tolist() == [17, 30, 41, PAD_SLOT]
    assert graphs.context_lens[:4].tolist() == [2, 3, 6, 0]
    assert graphs.block_tables[:3, :2].tolist() == [[4, 4], [7, 7], [10, 11]]
    assert graphs.slot_mapping[4:].tolist() == [5] * 4     # rows past the bucket are not the replay's business


def test_only_decode_steps_of_one_group_within_the_buckets_are_replayed():
    kv_cache = torch.zeros((1, 2, 32, 4, 1, 8))
    graphs = DecodeGraphs(model=None, kv_cache=kv_cache, layer_windows=(None,), max_num_seqs=2, max_model_len=8,
                          block_size=4)
    ids, rows = torch.tensor([[1, 2]]), torch.arange(2)
    decode = _context(kv_cache, [1, 2], [1, 1], [[0], [1]])
    assert graphs.takes(decode, ids, rows)
    assert not graphs.takes(_context(kv_cache, [1, 2], [1, 1], [[0], [1]], num_prefill_tokens=2), ids, rows[:1])
    assert not graphs.takes(decode, ids, rows[:1])                                     # a row not sampled
    assert not graphs.takes(decode, torch.tensor([[1, 2, 3]]), torch.arange(3))        # past the largest bucket
    assert not graphs.takes(_context(kv_cache.clone(), [1, 2], [1, 1], [[0], [1]]), ids, rows)  # another pool
    assert not graphs.takes(_context(kv_cache, [1, 2], [1, 1], [[0, 1, 2], [1, 2, 3]]), ids, rows)  # too wide
    grouped = _context(kv_cache, [1, 2], [1, 1], [[0], [1]])
    grouped.layer_contexts = [grouped]
    assert not graphs.takes(grouped, ids, rows)


@pytest.mark.parametrize("batch", [4, 8])
def test_decode_through_the_graphs_buffers_is_token_identical_to_transformers(batch, monkeypatch):
    """Every decode step of ``batch`` requests (a bucket's size) replays the graph of its bucket, reading the
    full-width block table; the tokens equal transformers'."""
    model, tok = tiny_model("llama")
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 1000) for _ in range(rng.randint(3, 40))] for _ in range(batch)]
    expected = [reference_generate(model, tok, prompt, 10) for prompt in prompts]
    captured = graphs_on_cpu(monkeypatch)
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", num_blocks=128, max_model_len=128,
                                    max_num_seqs=batch, max_num_batched_tokens=512), model=model, tokenizer=tok)
    assert "Decode CUDA graphs" in engine.banner
    outputs = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert [list(o.token_ids) for o in outputs] == expected
    replays = {size: graph.replays for size, graph in captured[0].graphs.items()}
    assert replays[batch] == 9      # the first token comes from the prefill; the other nine from replays


def test_a_shrinking_batch_replays_padded_buckets_and_stays_token_identical(monkeypatch):
    """Requests of different lengths: the batch shrinks 5, 4, 3, 2, 1, through buckets 8, 4, 4, 2, 1; padded rows
    (slot -1, context 0) write nowhere (the CPU's store made to skip them as the Triton kernel does)."""
    model, tok = tiny_model("llama")
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 1000) for _ in range(rng.randint(3, 40))] for _ in range(5)]
    lengths = [4, 6, 8, 10, 12]
    expected = [reference_generate(model, tok, prompt, n) for prompt, n in zip(prompts, lengths)]
    captured = graphs_on_cpu(monkeypatch)
    skip_padded_slots(monkeypatch)
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", num_blocks=128, max_model_len=128,
                                    max_num_seqs=5, max_num_batched_tokens=512), model=model, tokenizer=tok)
    outputs = engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                                        for n in lengths])
    assert [list(o.token_ids) for o in outputs] == expected
    replays = {size: graph.replays for size, graph in captured[0].graphs.items()}
    assert replays == {1: 2, 2: 2, 4: 4, 8: 3}


def test_enforce_eager_captures_nothing(monkeypatch):
    model, tok = tiny_model("llama")
    captured = graphs_on_cpu(monkeypatch)
    monkeypatch.setattr("kvscope.engine.model.model_runner.ModelRunner._graphs_wanted",
                        lambda self: not self.config.enforce_eager)
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", num_blocks=64, max_model_len=64,
                                    enforce_eager=True), model=model, tokenizer=tok)
    assert engine.runner.graphs is None and not captured and "CUDA graphs" not in engine.banner


def test_a_forward_that_cannot_be_captured_runs_eagerly_and_the_banner_says_why(monkeypatch):
    model, tok = tiny_model("llama")
    expected = reference_generate(model, tok, [5, 6, 7], 4)
    monkeypatch.setattr("kvscope.engine.model.model_runner.ModelRunner._graphs_wanted", lambda self: True)

    def refuse(self):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(DecodeGraphs, "capture", refuse)
    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", num_blocks=64, max_model_len=64),
                       model=model, tokenizer=tok)
    assert engine.runner.graphs is None
    assert engine.banner.endswith("Decode CUDA graphs could not be captured, so decode runs eagerly: operation not "
                                  "permitted when stream is capturing")
    assert list(engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0,
                                                            ignore_eos=True))[0].token_ids) == expected
