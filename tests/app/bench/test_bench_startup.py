"""kvscope bench startup: the table's median row, and a start that fails says why in one line."""

from __future__ import annotations

import pytest

from kvscope.app.bench.startup_bench import StartupTiming, format_table, time_startups


def _timing(ready: float, rss: float) -> StartupTiming:
    return StartupTiming(import_s=1.0, build_s=ready - 1.0, ready_s=ready, first_token_s=ready + 0.5,
                         peak_rss_mb=rss, kernels="C++ kernels")


def test_the_table_has_a_row_per_process_and_their_median():
    table = format_table([_timing(9.0, 3000), _timing(6.0, 3010), _timing(7.0, 3020)], "bfloat16")
    lines = table.splitlines()
    assert lines[0] == "startup · bfloat16 · 3 fresh processes · attention: C++ kernels"
    assert [line.split()[0] for line in lines[2:]] == ["run", "run", "run", "median"]
    median = lines[-1].split()
    assert median[1:5] == ["1.0s", "6.0s", "7.0s", "7.5s"]
    assert median[5] == "3010"


def test_a_start_that_fails_is_reported_with_its_last_line(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(RuntimeError, match="the startup child failed: .*no-such-model"):
        time_startups(str(missing), "cpu", "float32", 1, repeats=1)
