"""One step's forward inputs, built from the scheduler's batch: token ids, positions, the rows to take logits
from, and the paged-attention context (engine/model/attention.py's AttentionContext).

With KV-cache groups (engine/kv_cache_groups.py) every group has its own block tables and slot mapping, and
the pool holds ``layers_per_block`` layer slots: layer ``group.layers[k]`` keeps its K/V in slot k of its
group's blocks. Each layer then attends with its group's context; a model with one group has one context,
built exactly as before groups existed.
"""

from __future__ import annotations

import operator

import numpy as np
import torch

from kvscope.engine.batch import BatchItem
from kvscope.engine.kv_cache_groups import KVCacheGroup
from kvscope.engine.model.attention import AttentionContext
from kvscope.engine.model.block_tables import BlockTables

_start_pos, _token_ids, _sample_indices = (operator.attrgetter(name)
                                           for name in ("start_pos", "token_ids", "sample_indices"))
_first = operator.itemgetter(0)


class StepInputs:
    def __init__(self, block_size: int, max_model_len: int, device: torch.device,
                 layer_windows: tuple[int | None, ...] = (), groups: tuple[KVCacheGroup, ...] = ()) -> None:
        self.block_size = block_size
        self.device = device
        self.layer_windows = layer_windows     # per layer: its sliding window (engine/model/layer_kinds.py)
        self.groups = groups
        width = -(-max_model_len // block_size)
        # Persistent block tables (engine/model/block_tables.py): one per group.
        self.block_tables = [BlockTables(width, index, group.sliding_window is not None)
                             for index, group in enumerate(groups)] or [BlockTables(width)]
        # (group, slot in the pool) of each model layer.
        self.layer_places = [(0, layer) for layer in range(len(layer_windows))]
        for index, group in enumerate(groups):
            for slot, layer in enumerate(group.layers):
                self.layer_places[layer] = (index, slot)

    def prepare(self, items: list[BatchItem], num_prefill: int, kv_cache: torch.Tensor):
        """Flatten the batch (prefill chunks first, then decodes) into the forward's inputs:
        (context, input ids, positions, logit rows).

        Decodes are the many small items, so they are handled as columns with numpy, not one by one.
        """
        prefill, decode = items[:num_prefill], items[num_prefill:]
        token_ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        for item in prefill:
            token_ids.extend(item.token_ids)
            positions.extend(range(item.start_pos, item.start_pos + len(item.token_ids)))
            if item.sample_indices:
                logit_rows.append(len(token_ids) - 1)
        num_prefill_tokens = len(token_ids)
        prefill_lens = starts = None
        if prefill:
            prefill_lens = np.fromiter((item.context_len for item in prefill), dtype=np.int64, count=len(prefill))
        # Built as numpy arrays and handed to torch whole: torch.tensor over a list of Python ints costs ~0.1 us an
        # element, several times numpy's, and a batch of 256 decodes has three such lists.
        all_ids = np.empty(num_prefill_tokens + len(decode), dtype=np.int64)
        all_positions = np.empty_like(all_ids)
        all_ids[:num_prefill_tokens] = token_ids
        all_positions[:num_prefill_tokens] = positions
        rows = np.asarray(logit_rows, dtype=np.int64)
        if decode:
            # Columns read through C-level getters: no Python frame per item.
            starts = np.fromiter(map(_start_pos, decode), dtype=np.int64, count=len(decode))
            all_ids[num_prefill_tokens:] = np.fromiter(map(_first, map(_token_ids, decode)), dtype=np.int64,
                                                       count=len(decode))
            all_positions[num_prefill_tokens:] = starts
            sampled = np.fromiter(map(bool, map(_sample_indices, decode)), dtype=bool, count=len(decode))
            rows = np.concatenate([rows, num_prefill_tokens + np.flatnonzero(sampled)])
        shared = {
            "num_prefill_tokens": num_prefill_tokens,
            "prefill_cu_seqlens": self._int32(np.cumsum([0] + [len(item.token_ids) for item in prefill]))
            if prefill else None,
            "prefill_context_lens": self._int32(prefill_lens) if prefill else None,
            # Known on the host: passing it spares the CUDA kernel a device-to-host sync per layer.
            "prefill_max_query_len": max((len(item.token_ids) for item in prefill), default=0),
            "decode_context_lens": self._tensor((starts + 1).astype(np.int32)) if decode else None,
            "layer_windows": self.layer_windows,
        }
        contexts = [self._group_context(tables, items, num_prefill, prefill_lens, starts, kv_cache, shared)
                    for tables in self.block_tables]
        ctx = contexts[0]
        if self.groups:
            ctx.layer_contexts = [contexts[group] for group, _ in self.layer_places]
            for group_ctx in contexts:
                # Indexed by model layer, as attention indexes the pool: each layer's slot of the shared pool.
                group_ctx.kv_cache = [kv_cache[slot] for _, slot in self.layer_places]
        return ctx, self._tensor(all_ids[None, :]), self._tensor(all_positions[None, :]), self._tensor(rows)

    def _group_context(self, tables: BlockTables, items: list[BatchItem], num_prefill: int, prefill_lens,
                       starts, kv_cache: torch.Tensor, shared: dict) -> AttentionContext:
        """One group's slot mapping and block tables, with what every group shares."""
        prefill = items[:num_prefill]
        num_blocks, block_size = kv_cache.shape[2], self.block_size
        rows = tables.rows(items)
        slots: list[np.ndarray] = []
        for row, item in zip(rows, prefill):
            pos = np.arange(item.start_pos, item.context_len)
            slots.append(tables.table[row, pos // block_size].astype(np.int64) * block_size + pos % block_size)
        prefill_tables = decode_tables = None
        if prefill:
            prefill_tables = tables.padded(rows[:num_prefill], prefill_lens, block_size, num_blocks)
        if starts is not None:
            decode_tables = tables.padded(rows[num_prefill:], starts + 1, block_size, num_blocks)
            slots.append(decode_tables[np.arange(len(starts)), starts // block_size].astype(np.int64) * block_size
                         + starts % block_size)
        return AttentionContext(
            kv_cache=kv_cache, slot_mapping=self._tensor(np.concatenate(slots)),
            prefill_block_tables=self._tensor(prefill_tables) if prefill_tables is not None else None,
            decode_block_tables=self._tensor(decode_tables) if decode_tables is not None else None, **shared)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device)

    def _int32(self, values) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values, dtype=np.int32), device=self.device)
