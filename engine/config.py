"""Engine and sampling configuration: plain dataclasses, validated on construction."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal


class ConfigError(ValueError):
    """A configuration value the engine cannot run with. The message names the fix."""


class RequestError(ValueError):
    """A request the engine refuses. Raised by ``add_request``; the engine state is unchanged."""


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}


def parse_bytes(value: int | str | None, name: str) -> int | None:
    """Accept 536870912, "512MiB", "0.5GiB" or "1G"; None passes through."""
    if value is None or isinstance(value, int):
        if isinstance(value, int) and value <= 0:
            raise ConfigError(f"{name} must be positive, got {value}")
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"{name}: cannot read {value!r} as a size; use bytes or e.g. '512MiB', '2GiB'")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ConfigError(f"{name} must be positive, got {value!r}")
    return size


@dataclass
class EngineConfig:
    model: str = "default"
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | str | None = None
    gpu_memory_utilization: float = 0.90
    swap_space: int | str = "1GiB"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    allocator: Literal["paged", "contiguous"] = "paged"
    seed: int = 0

    def __post_init__(self) -> None:
        bs = self.block_size
        if not isinstance(bs, int) or bs < 1 or bs > 256 or bs & (bs - 1):
            raise ConfigError(f"block_size must be a power of two between 1 and 256, got {bs!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be at least 1, got {self.num_blocks}")
        self.kv_cache_memory = parse_bytes(self.kv_cache_memory, "kv_cache_memory")
        self.swap_space = parse_bytes(self.swap_space, "swap_space") if self.swap_space else 0
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ConfigError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.allocator not in ("paged", "contiguous"):
            raise ConfigError(f"allocator must be 'paged' or 'contiguous', got {self.allocator!r}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ConfigError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # False skips turning tokens into text (outputs carry token ids only), as vLLM's option of the same
    # name does: for callers that only want ids, like the bench with its synthetic prompts.
    detokenize: bool = True

    def validate(self) -> None:
        """Raise RequestError naming the first bad field. Called by add_request."""
        if not isinstance(self.n, int) or self.n < 1:
            raise RequestError(f"n must be at least 1, got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise RequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise RequestError(f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop):
            raise RequestError("stop strings must be non-empty")
        if self.stop and not self.detokenize:
            raise RequestError("stop strings need detokenize=True: they are matched against the text")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
