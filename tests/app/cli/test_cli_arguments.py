"""Numbers on the command line that cannot mean anything are argparse errors: usage, one line, exit 2
(issue 13 item 16), not a traceback from deep inside."""

from __future__ import annotations

import pytest
from cli_helpers import kvscope, one_error_line
from runlog_faults import make_log

from kvscope.app.cli import main


@pytest.mark.parametrize("run_id", ["9223372036854775808", "0", "-3", "1e3"])
def test_a_run_id_sqlite_cannot_hold_is_an_argument_error(tmp_path, capsys, run_id):
    make_log(tmp_path / "runs.db")
    for action in ("show", "export", "rm"):
        with pytest.raises(SystemExit) as exit_:
            kvscope("runs", action, run_id, "--db", str(tmp_path / "runs.db"))
        assert exit_.value.code == 2
        assert "run id" in capsys.readouterr().err


def test_the_largest_run_id_is_simply_not_found(tmp_path, capsys):
    make_log(tmp_path / "runs.db")
    assert kvscope("runs", "show", str(2**63 - 1), "--db", str(tmp_path / "runs.db")) == 2
    assert "no run with id" in one_error_line(capsys)


@pytest.mark.parametrize("argv", [
    ["throughput", "--requests", "0"], ["throughput", "--requests", "-5"], ["throughput", "--threads", "-1"],
    ["kernels", "--threads", "0"], ["startup", "--repeats", "0"], ["scheduler", "--requests", "0"],
    ["logging", "--requests", "x"], ["throughput", "--hf-batch-size", "0"], ["host", "--pools", "4096,0"],
    ["host", "--steps", "0"], ["ui", "--usage", "0"],
])
def test_bench_counts_below_one_are_argument_errors(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith(f"kvscope bench {argv[0]}: error: argument")
