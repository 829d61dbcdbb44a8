"""The bench's workloads: deterministic from a seed, prompts as synthetic token ids, EOS ignored.

Each workload also fixes the KV budget every system gets (``kv_cache_tokens``) and
the longest request it can hold (``max_model_len``, the bound of its length
distribution), so the contiguous allocator reserves what a deployer would set.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORKLOAD_NAMES = ("mixed", "shared-prefix", "parallel-sampling", "overload", "chat")
# Synthetic ids stay clear of the special and byte tokens at the bottom of the vocabulary.
TOKEN_ID_RANGE = (1000, 40000)
# Pool for the workloads that are not about memory pressure: room for every request of
# the mixed workload at full length (27,069 tokens), so paging is never the bottleneck.
AMPLE_KV_TOKENS = 32768
OVERLOAD_RESIDENT_REQUESTS = 4


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    n: int = 1


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple[BenchRequest, ...]
    max_model_len: int
    kv_cache_tokens: int
    temperature: float = 0.0
    preemption_mode: str = "recompute"
    description: str = ""

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens * r.n for r in self.requests)

    @property
    def num_sequences(self) -> int:
        return sum(r.n for r in self.requests)


def _random_ids(rng: random.Random, count: int) -> tuple[int, ...]:
    low, high = TOKEN_ID_RANGE
    return tuple(rng.randrange(low, high) for _ in range(count))


def _mixed_requests(num_requests: int, seed: int) -> tuple[BenchRequest, ...]:
    # The exact recipe the reference figures were measured on.
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len = rng.randint(16, 512)
        prompt = _random_ids(rng, prompt_len)
        requests.append(BenchRequest(prompt, rng.randint(16, 256)))
    return tuple(requests)


def mixed(num_requests: int = 64, seed: int = 0) -> Workload:
    return Workload("mixed", _mixed_requests(num_requests, seed), max_model_len=512 + 256,
                    kv_cache_tokens=AMPLE_KV_TOKENS,
                    description="prompts 16-512, outputs 16-256, all arriving at once")


def shared_prefix(num_requests: int = 64, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    system_prompt = _random_ids(rng, 512)
    requests = tuple(BenchRequest(system_prompt + _random_ids(rng, rng.randint(32, 128)), 64)
                     for _ in range(num_requests))
    return Workload("shared-prefix", requests, max_model_len=512 + 128 + 64, kv_cache_tokens=AMPLE_KV_TOKENS,
                    description="one 512-token system prompt + unique 32-128-token suffix, 64 outputs each")


def parallel_sampling(num_prompts: int = 16, seed: int = 0, n: int = 4) -> Workload:
    requests = tuple(BenchRequest(r.prompt_token_ids, r.max_tokens, n)
                     for r in _mixed_requests(num_prompts, seed))
    return Workload("parallel-sampling", requests, max_model_len=512 + 256, kv_cache_tokens=AMPLE_KV_TOKENS,
                    temperature=0.8, description=f"{num_prompts} mixed prompts, n={n} samples each (T=0.8)")


def overload(num_requests: int = 64, seed: int = 0, preemption_mode: str = "recompute") -> Workload:
    max_model_len = 512 + 256
    return Workload(f"overload-{preemption_mode}", _mixed_requests(num_requests, seed),
                    max_model_len=max_model_len,
                    kv_cache_tokens=OVERLOAD_RESIDENT_REQUESTS * max_model_len,
                    preemption_mode=preemption_mode,
                    description=f"mixed requests into a pool of {OVERLOAD_RESIDENT_REQUESTS} max-length "
                                f"requests, {preemption_mode} preemption")


CHAT_PROMPT_TOKENS = 40
CHAT_OUTPUT_TOKENS = 256


def chat(seed: int = 0) -> Workload:
    """One user at a time: a chat-sized prompt and a long reply; what a person waiting on the reply feels is
    the inter-token latency."""
    rng = random.Random(seed)
    request = BenchRequest(_random_ids(rng, CHAT_PROMPT_TOKENS), CHAT_OUTPUT_TOKENS)
    return Workload("chat", (request,), max_model_len=CHAT_PROMPT_TOKENS + CHAT_OUTPUT_TOKENS,
                    kv_cache_tokens=AMPLE_KV_TOKENS,
                    description=f"one request: a {CHAT_PROMPT_TOKENS}-token prompt, {CHAT_OUTPUT_TOKENS} output tokens")


def warm_up_request(n: int = 1) -> BenchRequest:
    """The small untimed generation every system runs before its timed one."""
    return BenchRequest(tuple(range(TOKEN_ID_RANGE[0], TOKEN_ID_RANGE[0] + 32)), max_tokens=8, n=n)


def build_workloads(name: str, num_requests: int | None = None, seed: int = 0) -> list[Workload]:
    """The workloads ``--workload name`` stands for; ``num_requests`` overrides each one's count."""
    def count(default: int) -> int:
        return default if num_requests is None else num_requests

    builders = {
        "mixed": lambda: [mixed(count(64), seed)],
        "shared-prefix": lambda: [shared_prefix(count(64), seed)],
        "parallel-sampling": lambda: [parallel_sampling(count(16), seed)],
        "overload": lambda: [overload(count(64), seed, mode) for mode in ("recompute", "swap")],
        "chat": lambda: [chat(seed)],
    }
    if name == "all":
        return [w for key in WORKLOAD_NAMES for w in builders[key]()]
    if name not in builders:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOAD_NAMES)} or all")
    return builders[name]()
