"""`kvscope bench hybrid`: what a hybrid KV cache saves on a sliding-window model, at the same memory.

The same workload runs twice on an engine with no model (the FakeRunner, its reads unchecked), with the pool
sized from the same bytes: once with the model's layers grouped by attention kind (the hybrid cache: each
block holds one group's layers, sliding groups give back the blocks that leave the window), once with every
layer kept full (one group, every block holds every layer, nothing is freed before the request ends). The
model's shape is a config's: which layers slide comes from kvscope's one rule for it
(engine/model/layer_kinds.py), its bytes per token from its KV heads, head size and dtype.

Reported per layout: the pool in blocks, the KV bytes and blocks a running request holds while it decodes
(mean over decode steps), the most requests running at once, the steps the workload took, and vLLM's
"Maximum concurrency" figure from what each group holds of one max_model_len request.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

from kvscope.app.bench.report import titled_table
from kvscope.app.bench.scoreboard import HybridSettings
from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.fake_runner import FakeRunner
from kvscope.engine.kv_cache_groups import KVCacheGroup, group_layers, layers_per_block, max_concurrency
from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.model.layer_kinds import layer_attention_kinds

BLOCK_SIZE = 16


@dataclass(frozen=True)
class LayoutRow:
    layout: str
    groups: int
    num_blocks: int
    block_kib: float
    kib_per_request: float
    blocks_per_request: float
    most_running: int
    steps: int
    max_concurrency: float


def model_groups(settings: HybridSettings) -> tuple[KVCacheGroup, ...]:
    """The layers grouped as the engine groups them, from the rule that reads a config."""
    config = SimpleNamespace(num_hidden_layers=settings.layers, sliding_window=settings.window,
                             sliding_window_pattern=settings.pattern)
    return group_layers(layer_attention_kinds(config))


def run_layout(settings: HybridSettings, groups: tuple[KVCacheGroup, ...], name: str) -> LayoutRow:
    layer_token_bytes = 2 * settings.kv_heads * settings.head_dim * settings.element_bytes
    block_bytes = layers_per_block(groups, settings.layers) * BLOCK_SIZE * layer_token_bytes
    num_blocks = settings.memory_mib * 2**20 // block_bytes
    config = EngineConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, max_num_seqs=256,
                          max_num_batched_tokens=settings.chunk, max_model_len=settings.max_model_len,
                          enable_prefix_caching=False, seed=settings.seed)
    runner = FakeRunner(config, max_model_len=settings.max_model_len, verify=False, kv_cache_groups=groups)
    engine = LLMEngine(config, runner=runner)
    rng = random.Random(settings.seed)
    params = SamplingParams(max_tokens=settings.max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    for _ in range(settings.requests):
        engine.add_request([rng.randrange(256) for _ in range(settings.prompt)], params)
    per_request: list[float] = []
    most_running = steps = 0
    while engine.has_unfinished_requests():
        stats = engine.step().stats
        steps += 1
        most_running = max(most_running, stats.num_running)
        if stats.num_running and not stats.num_prefill_tokens:
            per_request.append((stats.num_total_blocks - stats.num_free_blocks) / stats.num_running)
    blocks = sum(per_request) / len(per_request) if per_request else 0.0
    concurrency = max_concurrency(groups, num_blocks, BLOCK_SIZE, settings.max_model_len, settings.chunk)
    return LayoutRow(name, max(len(groups), 1), num_blocks, block_bytes / 1024, blocks * block_bytes / 1024,
                     blocks, most_running, steps, concurrency)


def run_hybrid_bench(settings: HybridSettings) -> list[LayoutRow]:
    groups = model_groups(settings)
    return [run_layout(settings, groups, "hybrid"), run_layout(settings, (), "every layer full")]


def format_table(rows: list[LayoutRow], settings: HybridSettings) -> str:
    header = ["layout", "groups", "blocks", "block KiB", "KiB/request", "blocks/request", "most running",
              "steps", "max concurrency"]
    cells = [[r.layout, str(r.groups), f"{r.num_blocks:,}", f"{r.block_kib:,.0f}", f"{r.kib_per_request:,.0f}",
              f"{r.blocks_per_request:,.1f}", str(r.most_running), str(r.steps), f"{r.max_concurrency:.2f}x"]
             for r in rows]
    s = settings
    title = [
        f"kvscope bench hybrid: {s.layers} layers, window {s.window} on {s.pattern - 1} of every {s.pattern}, "
        f"{s.kv_heads} KV head(s) x {s.head_dim} x {s.element_bytes} bytes; {s.memory_mib} MiB of KV pool",
        f"  {s.requests} requests of {s.prompt} prompt + {s.max_tokens} generated tokens, chunks of {s.chunk}, "
        f"max_model_len {s.max_model_len}, block size {BLOCK_SIZE}; FakeRunner",
    ]
    return titled_table(title, header, cells, "KiB/request and blocks/request: what a running request holds while it "
                        "decodes (mean over decode steps); max concurrency: vLLM's figure for requests of "
                        "max_model_len tokens")


def as_json(rows: list[LayoutRow]) -> list[dict]:
    return [{"bench": "hybrid", **vars(row)} for row in rows]
