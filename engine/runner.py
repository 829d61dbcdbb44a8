"""The model runner's contract with the engine: what the engine calls, and what it may know about it.

LLMEngine reads a runner through this interface only: ``info`` once, when it is built,
``tokenizer`` for text, and ``execute`` once per step. ModelRunner (a transformers model on
our paged attention) and FakeRunner (token ids in a fake pool, for tests and the scheduler
bench) both implement it; anything else that does can stand in for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

from kvscope.engine.batch import ScheduledBatch
from kvscope.engine.kv_cache_groups import (
    KVCacheGroup,
    blocks_per_sequence,
    longest_sequence,
    max_concurrency,
    pool_tokens,
)
from kvscope.engine.outputs import KVLayout, TokenLogprob

# One entry per BatchItem: the token drawn for each of its sample_indices, or None when the item failed
# (non-finite logits), which finishes that request with an error and lets the rest of the batch go on.
RunnerOutput = list[list[int] | None]


class ItemLogprobs(NamedTuple):
    """The log-probabilities one batch item asked for: of each token it drew (one per sample index), and of the
    prompt tokens its chunk computed, the first of them at prompt position ``prompt_start``."""

    sampled: tuple[TokenLogprob, ...] = ()
    prompt_start: int = 0
    prompt: tuple[TokenLogprob, ...] = ()


class SampledWithLogprobs(list):
    """A RunnerOutput that also carries log-probabilities: ``logprobs`` maps a batch item's index to its
    ItemLogprobs. A runner returns a plain list where no item asked, so most steps carry nothing extra."""

    def __init__(self, tokens: RunnerOutput, logprobs: dict[int, ItemLogprobs]) -> None:
        super().__init__(tokens)
        self.logprobs = logprobs


@dataclass(frozen=True)
class RunnerInfo:
    """Facts about a built runner that do not change while it runs: what the engine sizes itself by,
    and what the app's header and the run log show."""

    model_name: str
    device: str                     # "cpu", "cuda:0"
    dtype: str                      # "float32", "bfloat16", "float16"
    block_size: int
    num_device_blocks: int
    num_host_blocks: int            # the swap pool; 0 unless preemption_mode is "swap"
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    kv_cache_bytes: int | None      # the device pool's size; None where it holds no real K/V
    banner: str                     # one line saying how big the pool is, printed at start
    # The model's own sampling defaults (its generation_config), as (field, value) pairs for SamplingParams;
    # empty for a model that asks for greedy decoding, as transformers' generate then decodes. The chat pane,
    # `kvscope chat` and the server start from these, as vLLM takes its defaults from the generation_config.
    sampling_defaults: tuple[tuple[str, float | int], ...] = ()
    kv_layout: KVLayout | None = None   # None for a runner that holds no real K/V and pretends no shape
    # The layers grouped by attention kind (engine/kv_cache_groups.py); empty: one group, every layer full.
    kv_cache_groups: tuple[KVCacheGroup, ...] = ()
    # The step's token budget the pool was sized with: a sliding group holds a window plus a step's chunk.
    max_num_batched_tokens: int = 1


@runtime_checkable
class Runner(Protocol):
    info: RunnerInfo
    tokenizer: Any                  # a transformers tokenizer, or None for token-id-only runners

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        """Perform the batch's cache moves (swap out, swap in, copy, in that order), run one forward over its
        items, and sample. The engine's bookkeeping for the step happens only after this returns."""
        ...


def kv_cache_sentence(device: str, num_tokens: int, max_model_len: int, detail: str, concurrency: float) -> str:
    """vLLM's KV-cache line, in its words and number format, written once for the window, the engine's banner
    and the server's log: "CPU KV cache size: 46,592 tokens, Maximum concurrency for 1,024 tokens per request:
    45.50x"; ``detail`` goes in brackets after the size; pool_figures gives both numbers."""
    return (f"{'GPU' if device.startswith('cuda') else 'CPU'} KV cache size: {num_tokens:,} tokens"
            f"{f' ({detail})' if detail else ''}, Maximum concurrency for {max_model_len:,} tokens per request: "
            f"{concurrency:.2f}x")


def pool_figures(groups: tuple[KVCacheGroup, ...], num_blocks: int, block_size: int, max_model_len: int,
                 chunk: int) -> tuple[int, float]:
    """vLLM's two figures for a pool: the tokens it holds (in every group at once) and its "Maximum concurrency"
    for max_model_len. With one group, tokens over max_model_len, as vLLM divides them; with KV-cache groups,
    from what each group really holds of a request (computing ``chunk`` tokens a step)."""
    if not groups:
        return num_blocks * block_size, num_blocks * block_size / max_model_len
    return (pool_tokens(groups, num_blocks, block_size),
            max_concurrency(groups, num_blocks, block_size, max_model_len, chunk))


def pool_capacity(info: RunnerInfo) -> tuple[int, float]:
    """pool_figures for a built runner's pool."""
    return pool_figures(info.kv_cache_groups, info.num_device_blocks, info.block_size, info.max_model_len,
                        info.max_num_batched_tokens)


def capacity_sentence(info: RunnerInfo) -> str:
    """kv_cache_sentence for a built runner: the server's start-up line."""
    tokens, concurrency = pool_capacity(info)
    return kv_cache_sentence(info.device, tokens, info.max_model_len, "", concurrency)


def pool_warning(info: RunnerInfo) -> str | None:
    """What a pool smaller than one request of max_model_len means, said at start (where vLLM refuses to start):
    the server's log, the window's toast and `kvscope chat` all say it in these words. With KV-cache groups a
    request needs in each group what that group holds of it (a sliding group only its window's blocks)."""
    groups, blocks, size, chunk = (info.kv_cache_groups, info.num_device_blocks, info.block_size,
                                   info.max_num_batched_tokens)
    if blocks_per_sequence(groups, info.max_model_len, size, chunk) <= blocks:
        return None
    fits = longest_sequence(groups, blocks, size, chunk, info.max_model_len)
    holds = f"{fits:,} tokens of one request in its {len(groups)} KV-cache groups" if groups else f"{fits:,} tokens"
    return (f"The KV pool holds {holds}, less than one request of max_model_len "
            f"({info.max_model_len:,} tokens): longer requests will be refused; pass --max-model-len "
            f"{fits:,} (or less), or a larger pool with --num-blocks or --kv-cache-memory")


def format_banner(num_blocks: int, block_size: int, pool_bytes: int | None, max_model_len: int,
                  device: str = "cpu", groups: tuple[KVCacheGroup, ...] = (), chunk: int = 1) -> str:
    """vLLM's start-up line with the blocks it is made of: "CPU KV cache size: 46,592 tokens (2,912 blocks x 16,
    2,048 MiB), Maximum concurrency for 1,024 tokens per request: 45.50x". With KV-cache groups the tokens are
    those every group can hold at once, and the concurrency counts what each group holds of a request
    (computing ``chunk`` tokens a step), as vLLM counts them."""
    size = f", {pool_bytes / 2**20:,.0f} MiB" if pool_bytes is not None else ""
    groups_note = f", {len(groups)} KV-cache groups" if groups else ""
    tokens, concurrency = pool_figures(groups, num_blocks, block_size, max_model_len, chunk)
    return kv_cache_sentence(device, tokens, max_model_len, f"{num_blocks:,} blocks x {block_size}{size}{groups_note}",
                             concurrency)
