"""Load-generator presets: the situations a teacher wants to show, built from app/load/prompts/*.txt.

Each preset sizes its requests from the running engine (pool, max_model_len,
token budget, allocator), so the same preset overloads a small pool and a large
one, chunks prefill whatever the budget is, and never plans a request the pool
could not hold on its own. An engine that can run no request at all (the
contiguous allocator on a pool smaller than one max_model_len reservation) gets
one clear refusal and a max_model_len that would work, not one per request.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvscope.engine.config import SamplingParams, max_request_tokens
from kvscope.engine.outputs import KVCacheGroup  # the type of CacheSnapshot.kv_cache_groups

PROMPTS_DIR = Path(__file__).with_name("prompts")
CHAT_TEMPLATE_MARGIN = 48  # tokens a chat template adds around the messages, with room to spare


@functools.cache
def prompt_file(name: str) -> str:
    return (PROMPTS_DIR / name).read_text(encoding="utf-8").strip()


@functools.cache
def prompt_lines(name: str) -> tuple[str, ...]:
    return tuple(line.strip() for line in prompt_file(name).splitlines() if line.strip())


@dataclass(frozen=True)
class PresetContext:
    """What a preset may know about the engine it loads."""

    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_batched_tokens: int
    count_tokens: Callable[[str], int]
    tokenize_chat: Callable[[list[dict]], Any] | None = None   # the engine's own: a TokenizedPrompt
    allocator: str = "paged"
    kv_cache_groups: tuple[KVCacheGroup, ...] = ()   # the engine's layers by attention kind; empty: all full

    @property
    def pool_tokens(self) -> int:
        return self.block_size * self.num_blocks

    def max_request_tokens(self, n: int = 1) -> int:
        """The longest prompt plus output one request of ``n`` samples may have; 0 when none can run (the
        engine's own rule, LLMEngine.max_request_tokens)."""
        return max_request_tokens(n, self.num_blocks, self.block_size, self.max_model_len,
                                  self.allocator == "contiguous")

    def check_runnable(self) -> None:
        """ValueError, with a max_model_len that would fit, when the engine can run no request at all."""
        if self.max_request_tokens() > 0:
            return
        reservation = -(-self.max_model_len // self.block_size)
        raise ValueError(
            f"the contiguous allocator reserves max_model_len = {self.max_model_len:,} tokens ({reservation:,} "
            f"blocks) per request, but the pool holds {self.num_blocks:,} blocks, so no request can run; "
            f"try --max-model-len {suggest_max_model_len(self.num_blocks, self.block_size):,} or the paged "
            "allocator")

    def chat_prompt(self, messages: list[dict]) -> tuple[Any, int]:
        """What to queue for ``messages`` and its length in tokens. With the engine at hand, the prompt is
        tokenized here once, template included, and queued as tokenized; else the length is an estimate."""
        if self.tokenize_chat is not None:
            prompt = self.tokenize_chat(messages)
            return prompt, len(prompt.token_ids)
        return messages, sum(self.count_tokens(m["content"]) for m in messages) + CHAT_TEMPLATE_MARGIN

    @classmethod
    def from_engine(cls, engine) -> PresetContext:
        tokenizer = engine.tokenizer
        encode = getattr(tokenizer, "encode", None)
        count = (lambda text: len(encode(text))) if callable(encode) else (lambda text: len(text) // 4 + 1)
        info = engine.info
        return cls(info.block_size, info.num_device_blocks, info.max_model_len,
                   engine.config.max_num_batched_tokens, count, engine.tokenize if tokenizer is not None else None,
                   engine.config.allocator, info.kv_cache_groups)


def suggest_max_model_len(num_blocks: int, block_size: int) -> int:
    """A max_model_len under which a contiguous pool holds four requests at once (one when it is tiny)."""
    rows = 4 if num_blocks >= 4 * 8 else 1
    return max(block_size, num_blocks // rows * block_size)


def fit_reply(ctx: PresetContext, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> int:
    """``max_tokens``, shrunk so the prompt plus the reply fit max_model_len and the pool (at least 1: a
    prompt that leaves no room is then refused by the engine with its own words)."""
    return max(1, min(max_tokens, ctx.max_request_tokens(n) - num_prompt_tokens))


@dataclass(frozen=True)
class PlannedRequest:
    prompt: Any                 # chat messages, plain text, or a prompt the engine tokenized
    params: SamplingParams
    delay_steps: int = 0        # add it this many engine steps after the preset starts
    name: str | None = None     # the request id to use (lessons name theirs); else the preset numbers it


@dataclass(frozen=True)
class Preset:
    key: str
    title: str
    description: str
    default_count: int
    plan: Callable[[int, PresetContext], list[PlannedRequest]]


def _user(text: str, system: str | None = None) -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": text}]


def fit_text(text: str, budget: int, ctx: PresetContext) -> str:
    """Cut ``text`` at paragraph, then word boundaries until it holds at most ``budget`` tokens."""
    if ctx.count_tokens(text) <= budget:
        return text
    paragraphs = text.split("\n\n")
    while len(paragraphs) > 1 and ctx.count_tokens("\n\n".join(paragraphs)) > budget:
        paragraphs.pop()
    words = "\n\n".join(paragraphs).split(" ")
    while len(words) > 1 and ctx.count_tokens(" ".join(words)) > budget:
        words = words[: max(1, len(words) * 9 // 10)]
    return " ".join(words)


def _document(min_tokens: int, ctx: PresetContext) -> str:
    """The long document, repeated until it reaches ``min_tokens``."""
    base = prompt_file("long_document.txt")
    text = base
    while ctx.count_tokens(text) < min_tokens:
        text += "\n\n" + base
    return text


def plan_chat_burst(count: int, ctx: PresetContext) -> list[PlannedRequest]:
    questions = prompt_lines("chat_questions.txt")
    planned = []
    for i in range(count):
        prompt, num_tokens = ctx.chat_prompt(_user(questions[i % len(questions)]))
        params = SamplingParams(max_tokens=fit_reply(ctx, num_tokens, 96), temperature=0.7, top_p=0.9, seed=i)
        planned.append(PlannedRequest(prompt, params))
    return planned


def plan_shared_prefix(count: int, ctx: PresetContext) -> list[PlannedRequest]:
    """One request computes the long system prompt; the rest arrive once its blocks are cached."""
    system = fit_text(prompt_file("system_prompt.txt"), ctx.max_request_tokens() // 2, ctx)
    questions = prompt_lines("support_questions.txt")
    prefill_steps = -(-ctx.count_tokens(system) // ctx.max_num_batched_tokens)
    planned = []
    for i in range(count):
        prompt, num_tokens = ctx.chat_prompt(_user(questions[i % len(questions)], system))
        params = SamplingParams(max_tokens=fit_reply(ctx, num_tokens, 64), temperature=0.7, top_p=0.9, seed=i)
        planned.append(PlannedRequest(prompt, params, delay_steps=0 if i == 0 else prefill_steps + 1))
    return planned


def plan_long_prompts(count: int, ctx: PresetContext) -> list[PlannedRequest]:
    """Prompts longer than one step's token budget, so each prefill is split into chunks."""
    max_tokens = 64
    room = ctx.max_request_tokens() - max_tokens - CHAT_TEMPLATE_MARGIN
    target = min(room, max(3 * ctx.max_num_batched_tokens, ctx.max_model_len // 2))
    if target < 32:
        raise ValueError(f"max_model_len {ctx.max_model_len:,} and a pool of {ctx.num_blocks:,} blocks leave no "
                         "room for a long prompt")
    if target <= ctx.max_num_batched_tokens:     # the teaching pool: 256-token requests, 2,048-token steps
        raise ValueError(f"a prompt can hold at most {target:,} tokens here (max_model_len {ctx.max_model_len:,}) "
                         f"and one step takes {ctx.max_num_batched_tokens:,}, so none would be split into chunks; "
                         f"start with --max-num-batched-tokens {max(16, target // 4):,}, or see the chunked-prefill "
                         "lesson")
    document = fit_text(_document(target, ctx), target, ctx)
    instructions = prompt_lines("long_prompt_tasks.txt")
    return [PlannedRequest(_user(f"{document}\n\n{instructions[i % len(instructions)]}"),
                           SamplingParams(max_tokens=max_tokens, temperature=0.7, top_p=0.9, seed=i))
            for i in range(count)]


def plan_parallel_sampling(count: int, ctx: PresetContext) -> list[PlannedRequest]:
    """n=4: the four samples share the prompt's blocks and copy the last one on their first write. On a pool
    too small for four unshared copies of a prompt (what the engine checks), fewer samples."""
    prompts = prompt_lines("sampling_prompts.txt")
    planned = []
    for i in range(count):
        prompt, num_tokens = ctx.chat_prompt(_user(prompts[i % len(prompts)]))
        n = next((n for n in (4, 3, 2) if ctx.max_request_tokens(n) - num_tokens >= 8), 1)
        params = SamplingParams(n=n, max_tokens=fit_reply(ctx, num_tokens, 64, n=n), temperature=1.0, top_p=0.95,
                                seed=i)
        planned.append(PlannedRequest(prompt, params))
    return planned


def plan_overload(count: int, ctx: PresetContext) -> list[PlannedRequest]:
    """Requests that together need about 1.5x the pool's tokens, so the scheduler must preempt."""
    questions = prompt_lines("chat_questions.txt")
    per_request = -(-3 * ctx.pool_tokens // (2 * count))
    planned = []
    for i in range(count):
        prompt, num_tokens = ctx.chat_prompt(_user(questions[i % len(questions)]))
        max_tokens = fit_reply(ctx, num_tokens, max(16, min(per_request, ctx.max_model_len) - num_tokens))
        params = SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True)
        planned.append(PlannedRequest(prompt, params))
    return planned


PRESETS: dict[str, Preset] = {preset.key: preset for preset in (
    Preset("burst", "Chat burst", "N short chat questions at once: watch the pool fill and drain.",
           16, plan_chat_burst),
    Preset("shared", "Shared system prompt",
           "One long system prompt, N questions: its blocks are computed once and shared (ref > 1).",
           12, plan_shared_prefix),
    Preset("long", "Long prompts", "Prompts longer than one step's token budget: prefill runs in chunks.",
           3, plan_long_prompts),
    Preset("sample", "Parallel sampling n=4",
           "Four samples per prompt share its blocks; the first write to the shared last block copies it.",
           4, plan_parallel_sampling),
    Preset("overload", "Overload the pool",
           "More KV demand than the pool holds: requests are preempted (recompute or swap).",
           24, plan_overload),
)}


def build(key: str, count: int, ctx: PresetContext) -> list[PlannedRequest]:
    if key not in PRESETS:
        raise ValueError(f"unknown preset {key!r}; choose one of {', '.join(PRESETS)}")
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    ctx.check_runnable()
    return PRESETS[key].plan(count, ctx)
