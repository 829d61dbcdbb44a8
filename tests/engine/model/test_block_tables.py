import numpy as np
import pytest

from kvscope.engine.batch import BatchItem
from kvscope.engine.block_pool import NULL_BLOCK
from kvscope.engine.config import SamplingParams
from kvscope.engine.model.block_tables import BlockTables

PARAMS = SamplingParams()


def item(seq_id, table, start=0):
    return BatchItem(seq_id, f"r{seq_id}", (1,), start, table, (0,), PARAMS)


def flattened(tables, context_lens, block_size):
    """The padded tables by the book: each row its needed blocks, then its own first block."""
    needed = [-(-n // block_size) for n in context_lens]
    width = max(needed)
    return np.array([list(t[:k]) + [t[0]] * (width - k) for t, k in zip(tables, needed)], dtype=np.int32)


def test_rows_are_written_only_when_a_table_changes_and_pad_with_their_own_first_block():
    tables = BlockTables(width=4)
    first = (5, 6, 7)
    rows = tables.rows([item(1, first), item(2, (9,))])
    tables.table[rows[0], 2] = 99       # a row is trusted while its tuple is the one it was written from
    assert tables.rows([item(1, first)])[0] == rows[0] and tables.table[rows[0], 2] == 99
    tables.table[rows[0], 2] = 7        # and so is the part of it a longer table starts with: only its tail is new
    grown = (5, 6, 7, 8, 10, 11)        # a longer table than the array was made for widens it
    rows = tables.rows([item(1, grown), item(2, (9,))])
    padded = tables.padded(rows, np.array([90, 3]), 16, num_blocks=12)
    assert padded.tolist() == flattened([grown, (9,)], [90, 3], 16).tolist()


def test_many_sequences_evict_the_ones_a_batch_does_not_hold_and_come_back_rewritten():
    tables = BlockTables(width=2)
    rng = np.random.default_rng(0)
    live = {}
    for _ in range(40):
        batch_ids = rng.choice(500, size=100, replace=False)
        for seq_id in batch_ids:
            if seq_id not in live or rng.random() < 0.2:
                live[seq_id] = tuple(int(b) for b in rng.integers(0, 50, size=rng.integers(1, 6)))
        items = [item(int(s), live[s]) for s in batch_ids]
        # Mostly contexts in a table's last block, as decodes have; sometimes short of it, as a reservation is.
        lens = np.array([len(live[s]) * 16 - int(rng.integers(0, 16 if rng.random() < 0.9 else len(live[s]) * 16))
                         for s in batch_ids])
        got = tables.padded(tables.rows(items), lens, 16, num_blocks=50)
        assert got.tolist() == flattened([live[s] for s in batch_ids], lens, 16).tolist()


def test_a_table_holding_blocks_past_its_context_pads_them_with_its_first_block():
    """Rows are kept padded past their table's end; a contiguous reservation also holds blocks its context has
    not reached, and those are padded too, while a batch with none takes its rows as they are."""
    tables = BlockTables(width=2)
    reserved, short, mid = (4, 5, 6, 7), (8,), (1, 2, 3)
    for batch, lens in [([reserved, short], [20, 10]), ([mid, short], [40, 10]), ([short, mid], [16, 33])]:
        rows = tables.rows([item(k, table) for k, table in enumerate(batch)])
        padded = tables.padded(rows, np.array(lens), 16, num_blocks=10)
        assert padded.tolist() == flattened(batch, lens, 16).tolist()


def test_a_block_outside_the_pool_or_a_table_shorter_than_its_context_is_refused():
    tables = BlockTables(width=4)
    with pytest.raises(IndexError, match="outside the pool of 8"):
        tables.padded(tables.rows([item(1, (3, 8))]), np.array([20]), 16, num_blocks=8)
    with pytest.raises(IndexError, match="shorter than its context"):
        tables.padded(tables.rows([item(2, (3,))]), np.array([20]), 16, num_blocks=8)


def test_a_sliding_groups_freed_entries_reach_the_kernels_as_the_rows_first_block_still_held():
    tables = BlockTables(width=4, group=1, sliding=True)
    full, sliding = (1, 2, 3, 4), (NULL_BLOCK, NULL_BLOCK, 7, 8)
    short = (NULL_BLOCK, 9)
    items = [BatchItem(1, "r1", (1,), 60, full + sliding, (0,), PARAMS, (full, sliding)),
             BatchItem(2, "r2", (1,), 20, (5, 9), (0,), PARAMS, ((5, 6), short))]
    rows = tables.rows(items)
    padded = tables.padded(rows, np.array([61, 21]), 16, num_blocks=12)
    assert padded.tolist() == [[7, 7, 7, 8], [9, 9, 9, 9]]


def test_tables_that_grow_or_change_inside_stay_equal_to_the_book():
    """A table that took a block has only its new entries written; one changed anywhere else (a copy-on-write in
    the middle, a sliding window's freed front, a different first block, a shorter table) is written whole."""
    tables = BlockTables(width=2)
    rng = np.random.default_rng(1)
    live = {seq_id: (int(rng.integers(0, 50)),) for seq_id in range(8)}
    for _ in range(300):
        seq_id = int(rng.integers(0, 8))
        table = list(live[seq_id])
        change = rng.integers(0, 5)
        if change <= 1:
            table += [int(b) for b in rng.integers(0, 50, size=int(rng.integers(1, 3)))]
        elif change == 2:
            table[int(rng.integers(0, len(table)))] = int(rng.integers(0, 50))
        elif change == 3 and len(table) > 1:
            table = table[:int(rng.integers(1, len(table)))]
        else:
            table[0] = int(rng.integers(0, 50))
        live[seq_id] = tuple(table)
        items = [item(s, live[s]) for s in live]
        lens = np.array([len(live[s]) * 16 for s in live])
        got = tables.padded(tables.rows(items), lens, 16, num_blocks=50)
        assert got.tolist() == flattened([live[s] for s in live], lens, 16).tolist()
        # Rows stay padded past their table's end with their own first block (padded() relies on it).
        for s in live:
            row = tables._written[s][0]
            assert (tables.table[row, len(live[s]):] == live[s][0]).all()
