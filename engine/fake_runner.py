"""A stand-in model runner and tokenizer, so the engine runs end to end with no model.

FakeRunner keeps a fake KV pool of token ids instead of keys and values. Each
step it performs the batch's cache moves, writes every item's tokens into the
slots its block table maps, then reads each item's whole context back through
its block table. When ``verify`` is on, a context that differs from what the
sequence should hold raises AssertionError: that is how the tests prove that
copy-on-write, swap, prefix caching and preemption keep the cache right.

Given KV-cache groups (engine/kv_cache_groups.py), it writes each group's blocks
and reads each group as its layers would: a full group the whole context, a
sliding group only the positions the step's first query can see. A read that
meets a NULL_BLOCK entry, or a block the pool holds as free, raises too.

The next token is a deterministic function of the context read back, so a
request's output does not depend on how it was scheduled, only on its tokens.

``fault_at`` makes the next execute() raise InjectedFault at one of its phases
("moves", before any cache move; "forward", after the moves and the K/V writes;
"sample", after the reads): how the tests check that a failed step leaves the
cache consistent.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np

from kvscope.engine.batch import BatchItem, ScheduledBatch
from kvscope.engine.block_pool import NULL_BLOCK
from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.kv_cache_groups import KVCacheGroup
from kvscope.engine.outputs import KVLayout
from kvscope.engine.runner import RunnerInfo, RunnerOutput, format_banner

_MASK64 = (1 << 64) - 1
# The shape the fake pretends its K/V has (SmolLM2-135M's), so a --kv-cache-memory budget sizes its pool as the
# real runner's would: 2 x 30 layers x 3 KV heads x 64 x 4 bytes = 45 KiB a token in float32.
_LAYERS, _KV_HEADS, _HEAD_DIM = 30, 3, 64
_ALPHABET = b"abcdefghijklmnopqrstuvwxyz "


def _mix(x: int) -> int:
    """splitmix64 finaliser: a cheap, well-spread 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@functools.lru_cache(maxsize=4096)
def _sample_salt(sample_index: int, seed: int) -> int:
    return _mix(sample_index + 1) ^ _mix(seed + 7)


class InjectedFault(RuntimeError):
    """Raised by FakeRunner.execute at the phase named by ``fault_at``."""


class FakeTokenizer:
    """Byte-level tokenizer: ids 0..255 are UTF-8 bytes, then three special tokens."""

    eos_token_id = 256
    im_start_id = 257
    im_end_id = 258
    vocab_size = 259
    _specials = {256: "<|endoftext|>", 257: "<|im_start|>", 258: "<|im_end|>"}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        try:
            return bytes(token_ids).decode("utf-8", errors="replace")
        except ValueError:
            pass    # special tokens present
        parts: list[str] = []
        chunk = bytearray()
        for token in token_ids:
            if token < 256:
                chunk.append(token)
                continue
            parts.append(chunk.decode("utf-8", errors="replace"))
            chunk = bytearray()
            if not skip_special_tokens:
                parts.append(self._specials.get(token, ""))
        parts.append(chunk.decode("utf-8", errors="replace"))
        return "".join(parts)

    def apply_chat_template(self, messages, add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = True, **kwargs) -> dict[str, list[int]] | list[int] | str:
        """As transformers 5 answers: tokenized, a dict of ``input_ids`` and ``attention_mask`` (a BatchEncoding
        there) unless ``return_dict=False``, so code that takes len() of it is caught here too."""
        ids: list[int] = []
        for message in messages:
            text = f"{message['role']}\n{message['content']}"
            ids += [self.im_start_id, *self.encode(text), self.im_end_id, *self.encode("\n")]
        if add_generation_prompt:
            ids += [self.im_start_id, *self.encode("assistant\n")]
        if not tokenize:
            return self.decode(ids)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids


class FakeRunner:
    """A runner (engine.runner.Runner) with no model; see the module docstring."""

    def __init__(self, config: EngineConfig, *, num_blocks: int | None = None, num_host_blocks: int = 0,
                 max_model_len: int | None = None, verify: bool = True, eos_period: int | None = None,
                 fail_on: Sequence[str] = (), kv_cache_groups: tuple[KVCacheGroup, ...] = ()) -> None:
        self.tokenizer = FakeTokenizer()
        self.block_size = config.block_size
        self.kv_layout = KVLayout(_LAYERS, _KV_HEADS, _HEAD_DIM, 2 if config.dtype in ("bfloat16", "float16") else 4)
        from_budget = (config.kv_cache_memory // (self.kv_layout.bytes_per_token * self.block_size)
                       if config.kv_cache_memory else None)
        num_device_blocks = num_blocks or config.num_blocks or from_budget or 512
        max_model_len = max_model_len or config.max_model_len or 1024
        self.verify = verify
        self.eos_period = eos_period            # about one token in eos_period is EOS; None: never
        self.fail_on: set[str] = set(fail_on)   # request ids whose items fail, as NaN logits would
        self.fault_at: str | None = None        # "moves" | "forward" | "sample": the next execute() raises there
        # Set by fake_engine(): the tokens a sequence should hold, to check the context read back.
        self.expected_tokens: Callable[[BatchItem], Sequence[int]] | None = None
        # Set by fake_engine(): whether the engine's pool holds a block as free (nobody may read one).
        self.block_is_free: Callable[[int], bool] | None = None
        # The contiguous allocator is the pre-paging baseline: one group, whatever the model's layers are.
        kv_cache_groups = tuple(kv_cache_groups) if config.allocator == "paged" else ()
        self.windows = tuple(group.sliding_window for group in kv_cache_groups)
        # The header and the run log show the configured names: there is no model, device or dtype to report.
        self.info = RunnerInfo(
            model_name=config.model, device=config.device, dtype=config.dtype, block_size=self.block_size,
            num_device_blocks=num_device_blocks, num_host_blocks=num_host_blocks, max_model_len=max_model_len,
            vocab_size=self.tokenizer.vocab_size, eos_token_ids=frozenset({self.tokenizer.eos_token_id}),
            kv_cache_bytes=None, kv_layout=self.kv_layout, kv_cache_groups=kv_cache_groups,
            max_num_batched_tokens=config.max_num_batched_tokens,
            banner=format_banner(num_device_blocks, self.block_size, None, max_model_len, "cpu", kv_cache_groups,
                                 config.max_num_batched_tokens) + " (fake runner)")
        self.pool = np.full((num_device_blocks, self.block_size), -1, dtype=np.int64)
        self.host_pool = np.full((max(num_host_blocks, 1), self.block_size), -1, dtype=np.int64)
        self._weights = np.random.default_rng(0).integers(1, 2**63, max_model_len, dtype=np.uint64)

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        self._fault("moves")
        self._move_blocks(batch)
        if self.verify:
            # Write everything first, then read: a real forward stores a layer's K/V before attending.
            for item in batch.items:
                for table in item.group_tables or (item.block_table,):
                    self.pool[self._slots(item, item.start_pos, table)] = item.token_ids
            self._fault("forward")
            read = self._read_groups if self.windows else self._read_context
            hashes = [read(item) for item in batch.items]
        else:
            self._fault("forward")
            hashes = [_mix(item.token_ids[-1] * 1_000_003 + item.context_len) for item in batch.items]
        self._fault("sample")
        results: RunnerOutput = []
        for item, context_hash in zip(batch.items, hashes, strict=True):
            if item.request_id in self.fail_on:
                results.append(None)
            else:
                results.append([self._next_token(context_hash, k, item.params) for k in item.sample_indices])
        return results

    def _fault(self, phase: str) -> None:
        if self.fault_at == phase:
            self.fault_at = None
            raise InjectedFault(f"injected fault in the runner's {phase} phase")

    def _move_blocks(self, batch: ScheduledBatch) -> None:
        for device_block, host_block in batch.blocks_to_swap_out:
            self.host_pool[host_block] = self.pool[device_block]
        for host_block, device_block in batch.blocks_to_swap_in:
            self.pool[device_block] = self.host_pool[host_block]
        for src, dst in batch.blocks_to_copy:
            self.pool[dst] = self.pool[src]

    def _slots(self, item: BatchItem, start: int, table=None) -> tuple[np.ndarray, np.ndarray]:
        positions = np.arange(start, item.context_len)
        table = np.asarray(item.block_table if table is None else table, dtype=np.int64)
        return table[positions // self.block_size], positions % self.block_size

    def _read_context(self, item: BatchItem, table=None, start: int = 0) -> int:
        """Read positions ``start ..`` of the context through ``table`` (the item's own by default), check them,
        and hash them with their positions."""
        blocks, offsets = self._slots(item, start, table)
        if (blocks == NULL_BLOCK).any():
            raise AssertionError(f"request {item.request_id} read a NULL block-table entry: table {table}, "
                                 f"positions {start}..{item.context_len - 1}")
        if self.block_is_free is not None:
            free = [int(block) for block in np.unique(blocks) if self.block_is_free(int(block))]
            if free:
                raise AssertionError(f"request {item.request_id} read freed blocks {free}")
        context = self.pool[blocks, offsets]
        if self.expected_tokens is not None:
            expected = np.asarray(self.expected_tokens(item)[start:item.context_len], dtype=np.int64)
            if not np.array_equal(context, expected):
                bad = int(np.flatnonzero(context != expected)[0]) + start if len(context) == len(expected) else -1
                raise AssertionError(f"KV cache of request {item.request_id} (seq {item.seq_id}) is wrong at "
                                     f"position {bad}: block table {table or item.block_table}, "
                                     f"read {context.tolist()}, expected {expected.tolist()}")
        return int((context.astype(np.uint64) * self._weights[start:item.context_len]).sum())

    def _read_groups(self, item: BatchItem) -> int:
        """Read every group as its layers would; the next token comes from the first full group's context, or,
        with none, from the last window."""
        hashes = []
        for window, table in zip(self.windows, item.group_tables, strict=True):
            start = 0 if window is None else max(0, item.start_pos - window + 1)
            hashes.append(self._read_context(item, table, start))
        if None in self.windows:
            return hashes[self.windows.index(None)]
        window = self.windows[0]
        return self._read_context(item, item.group_tables[0], max(0, item.context_len - window))

    def _next_token(self, context_hash: int, sample_index: int, params: SamplingParams) -> int:
        if params.greedy:
            sample_index = 0    # greedy: every sample draws the same token
        x = _mix(context_hash ^ _sample_salt(sample_index, params.seed or 0))
        if self.eos_period and x % self.eos_period == 0:
            return self.tokenizer.eos_token_id
        return _ALPHABET[(x >> 16) % len(_ALPHABET)]


def fake_engine(config: EngineConfig | None = None, **runner_kwargs):
    """An LLMEngine on a FakeRunner whose reads are checked against the engine's own sequences."""
    from kvscope.engine.llm_engine import LLMEngine

    config = config or EngineConfig()
    runner = FakeRunner(config, **runner_kwargs)
    engine = LLMEngine(config, runner=runner)
    if runner.verify:
        def expected_tokens(item: BatchItem) -> list[int]:
            return engine.scheduler.get_sequence(item.request_id, item.seq_id).token_ids

        runner.expected_tokens = expected_tokens
        ref_counts = engine.scheduler.kv.block_pool.ref_counts
        runner.block_is_free = lambda block: ref_counts[block] == 0
    return engine


def build_fake_engine(config: EngineConfig, previous=None):
    """An engine factory (app/worker/factory.py's signature) on the checked FakeRunner: a module-level function, so
    an engine process can be given it pickled."""
    return fake_engine(config)
