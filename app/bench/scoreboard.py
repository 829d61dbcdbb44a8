"""The settings of the host-side scoreboard (`kvscope bench host` and `kvscope bench ui`), and their defaults.

Apart from the benches themselves so that the command line takes its defaults from here without importing the
engine: the sizes below are the ones the scoreboard's targets are stated at.
"""

from __future__ import annotations

from dataclasses import dataclass

SMOLLM2_VOCAB = 49_152


@dataclass(frozen=True)
class HostSettings:
    pools: tuple[int, ...] = (4_096, 65_536, 400_000)   # 400,000: about what an H200 holds of SmolLM2
    batches: tuple[int, ...] = (8, 64, 256)
    contexts: tuple[int, ...] = (100, 1_200)
    steps: int = 40                 # measured steps per cell
    warmup: int = 3
    sampler_repeats: int = 3        # timed calls per batch and sampler
    vocab: int = SMOLLM2_VOCAB
    seed: int = 0


@dataclass(frozen=True)
class UiSettings:
    blocks: int = 330_000           # an H200 at 0.9 utilisation holds about 340,000 blocks of SmolLM2
    usage: float = 0.8
    batch: int = 256
    steps: int = 500                # per side: the window's cost is noisy over fewer
    frames: int = 10
    size: tuple[int, int] = (120, 40)
    seed: int = 0
