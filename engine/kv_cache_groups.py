"""KV-cache groups: which layers share a block table, and what each group holds per sequence.

A model whose layers all attend over the whole context has one group, written as the empty tuple: the engine
then runs exactly as it did before groups existed. A model with sliding-window layers (Mistral's window on every
layer, Gemma's local layers beside global ones, gpt-oss alternating) has its layers grouped by attention kind,
as vLLM's hybrid KV cache manager groups them: every group has the same number of layers (the fewest any kind
has), so one physical block holds the same number of bytes whichever group takes it, and all groups share one
block pool. Each sequence has one block table per group. A sliding group needs only the blocks of the last
window: the ones wholly before the earliest position any query of a step can see go back to the pool, and
their table entries become NULL_BLOCK (engine/block_pool.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class KVCacheGroup(NamedTuple):
    """Layers that share one block table per sequence: the ``layers`` (model layer indices, in order) all attend
    the same way, over the whole context (``sliding_window`` None) or over the last ``sliding_window``
    positions (a query at position p sees p - W + 1 .. p)."""

    layers: tuple[int, ...]
    sliding_window: int | None = None


def group_layers(windows: Sequence[int | None]) -> tuple[KVCacheGroup, ...]:
    """Group layers by attention kind, one window per layer (None: full attention). Empty when every layer is
    full: one group, today's engine. Kinds come in order of their first layer, full attention first."""
    if all(window is None for window in windows):
        return ()
    kinds: dict[int | None, list[int]] = {}
    for kind in sorted(set(windows), key=lambda w: (w is not None, w or 0)):
        kinds[kind] = [layer for layer, window in enumerate(windows) if window == kind]
    size = min(len(layers) for layers in kinds.values())
    groups = []
    for kind, layers in kinds.items():
        # A kind with more layers than the smallest is split into groups of that size; the last may be short,
        # and its unused layer slots are memory the pool carries for nothing (vLLM pads the same way).
        groups.extend(KVCacheGroup(tuple(layers[i:i + size]), kind) for i in range(0, len(layers), size))
    return tuple(groups)


def layers_per_block(groups: Sequence[KVCacheGroup], num_layers: int) -> int:
    """How many layers' K/V one physical block holds: every layer with one group, a group's layers with more."""
    return max(len(group.layers) for group in groups) if groups else num_layers


def first_needed_block(start: int, window: int, block_size: int) -> int:
    """The first block a step whose queries start at position ``start`` reads in a group of this window: the
    ones before it hold only positions no query from ``start`` on can see."""
    return max(0, start - window + 1) // block_size


def blocks_per_sequence(groups: Sequence[KVCacheGroup], num_tokens: int, block_size: int, chunk: int) -> int:
    """The most blocks one sequence of ``num_tokens`` holds at once across all groups, computing at most ``chunk``
    tokens a step. A full group holds every block; a sliding group the window's, plus the step's chunk, plus one
    for a window that straddles a block boundary: ceil(W / B) + 1 blocks for decodes."""
    full = -(-num_tokens // block_size)
    if not groups:
        return full
    total = 0
    for group in groups:
        window = group.sliding_window
        total += full if window is None else min(full, -(-(window - 1 + chunk) // block_size) + 1)
    return total


def longest_sequence(groups: Sequence[KVCacheGroup], num_blocks: int, block_size: int, chunk: int,
                     limit: int) -> int:
    """The most tokens, up to ``limit``, one sequence can have while holding at most ``num_blocks`` blocks across
    all groups: the inverse of blocks_per_sequence, by bisection (the blocks held grow with the tokens)."""
    low, high = 0, limit     # low always fits: no tokens, no blocks
    while low < high:
        mid = (low + high + 1) // 2
        if blocks_per_sequence(groups, mid, block_size, chunk) <= num_blocks:
            low = mid
        else:
            high = mid - 1
    return low


def max_concurrency(groups: Sequence[KVCacheGroup], num_blocks: int, block_size: int, max_model_len: int,
                    chunk: int) -> float:
    """vLLM's "Maximum concurrency": how many requests of max_model_len tokens the pool holds at once, from what
    each group really holds."""
    return num_blocks / blocks_per_sequence(groups, max_model_len, block_size, chunk)


def pool_tokens(groups: Sequence[KVCacheGroup], num_blocks: int, block_size: int) -> int:
    """Tokens the pool holds in every group at once (a token needs a slot in each group's block)."""
    return num_blocks // max(len(groups), 1) * block_size
