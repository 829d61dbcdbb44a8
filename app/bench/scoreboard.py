"""The settings of the host-side scoreboard (`kvscope bench host` and `kvscope bench ui`) and of `kvscope bench
hybrid`, and their defaults.

Apart from the benches themselves so that the command line builds their flags from here without importing the
engine: a setting with help text is a flag of the same name, its default the setting's own, and each class's
docstring is its subcommand's help (the first line) and description (the rest). The sizes are the ones the
scoreboard's targets are stated at.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SMOLLM2_VOCAB = 49_152


def flag(default, text: str):
    """A setting that the command line offers as a flag, with ``text`` as its help."""
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)
class HostSettings:
    """the host's work in one engine step, by phase, without the forward

    Thread CPU time of each phase of a decode step (schedule, prepare, update, snapshot, events, run-log encode)
    on an engine with no model, for every pool, batch and context asked for, and the sampler at each batch over
    the default model's vocabulary."""

    pools: tuple[int, ...] = flag((4_096, 65_536, 400_000), "pool sizes in blocks")   # 400,000: about an H200's
    batches: tuple[int, ...] = flag((8, 64, 256), "decoding requests per step")
    contexts: tuple[int, ...] = flag((100, 1_200), "tokens of context each request has")
    steps: int = flag(40, "measured steps per cell")
    # 20: a median of 3 calls swung by 40% between runs (p10-p90 2.4-4.5 ms at batch 256), its first calls paying
    # the caches' warm-up; of 20, by a few per cent.
    sampler_repeats: int = flag(20, "timed sampler calls per batch and setting")
    vocab: int = flag(SMOLLM2_VOCAB, "the sampler's vocabulary, SmolLM2's")
    warmup: int = 3
    seed: int = 0


@dataclass(frozen=True)
class UiSettings:
    """a block-map frame at a big pool, and what the open window and the run log cost the engine

    On an engine with no model whose pool is mostly in use: the block map's frame time (UI-thread CPU), engine
    steps per CPU second headless and with the app open, and the engine thread's time a step alone and with the
    run log recording."""

    # An H200 at 0.9 utilisation holds about 340,000 blocks of SmolLM2.
    blocks: int = flag(330_000, "pool size in blocks")
    usage: float = flag(0.8, "share of the pool in use, below 1")
    batch: int = flag(256, "decoding requests")
    steps: int = flag(500, "engine steps per side; fewer make the window's cost noisy")
    frames: int = flag(10, "block-map frames timed")
    rounds: int = flag(4, "segments a side, alternated in one engine process, for the engine-process rows")
    size: tuple[int, int] = (120, 40)
    seed: int = 0


@dataclass(frozen=True)
class HybridSettings:
    """a hybrid KV cache against every layer kept full, at the same memory

    On an engine with no model and a sliding-window model's shape: the KV a request holds, the requests that
    run at once and vLLM's concurrency figure, with the layers grouped by attention kind and with every layer
    kept full, from the same pool memory."""

    # Gemma 3 270M's shape: 18 layers, five sliding (window 512) per full one, one KV head of 256, bf16.
    layers: int = flag(18, "decoder layers")
    window: int = flag(512, "sliding window in tokens")
    pattern: int = flag(6, "every pattern-th layer is full, the others slide")
    kv_heads: int = flag(1, "KV heads per layer")
    head_dim: int = flag(256, "head size")
    element_bytes: int = flag(2, "bytes per K or V element (2: bf16)")
    memory_mib: int = flag(96, "the KV pool's MiB, the same for both layouts")
    requests: int = flag(48, "requests in the workload")
    prompt: int = flag(1024, "prompt tokens per request")
    max_tokens: int = flag(256, "generated tokens per request")
    max_model_len: int = flag(2048, "max_model_len, for the concurrency figure")
    chunk: int = flag(512, "max_num_batched_tokens")
    seed: int = 0
