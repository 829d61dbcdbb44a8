"""The synthetic engine of the run-log tests (tests/support/synthetic_engine.py) keeps its own books."""

from __future__ import annotations

import numpy as np
from synthetic_engine import SyntheticEngine

from kvscope.engine.outputs import BLOCK_USED


def test_synthetic_engine_keeps_ref_counts_equal_to_table_entries():
    engine = SyntheticEngine(128, max_running=16, arrivals_per_step=1.0, seed=3)
    for _ in range(150):
        result = engine.step()
        snapshot = result.snapshot
        counts = np.zeros(snapshot.num_blocks, np.int32)
        for view in snapshot.requests:
            for table in view.block_tables:
                np.add.at(counts, list(table), 1)
        assert (counts == snapshot.ref_counts).all()
        assert ((snapshot.block_state == BLOCK_USED) == (snapshot.ref_counts > 0)).all()
    assert engine.num_preemptions > 0 and engine.prefix_hits > 0
