"""Running the command line in-process and reading its one-line errors, for the tests of every subcommand."""

from __future__ import annotations

import argparse

from synthetic_engine import SyntheticEngine

from kvscope.app.cli import main
from kvscope.app.runlog import cli as runs_cli
from kvscope.app.runlog import open_run_log
from kvscope.engine.config import EngineConfig


def run_cli(capsys, *argv):
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def assert_one_line_error(status, err, *needles):
    assert status == 2
    # Progress lines (e.g. "Converting ...") may come first; the error itself is one line.
    errors = [line for line in err.splitlines() if line.startswith("kvscope: error:")]
    assert len(errors) == 1, err
    assert err.rstrip().endswith(errors[0])
    assert "Traceback" not in err
    for needle in needles:
        assert needle in errors[0]


def kvscope(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="kvscope")
    runs_cli.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def log_run(path, num_steps: int, seed: int, model: str = "synthetic") -> tuple[int, list]:
    engine = SyntheticEngine(64, max_running=6, arrivals_per_step=0.6, seed=seed)
    logger = open_run_log(path, source="bench", config=EngineConfig(device="cpu", num_blocks=64), model=model,
                          device="cpu", dtype="float32")
    results = []
    for _ in range(num_steps):
        results.append(engine.step())
        logger.step(results[-1])
    logger.close()
    return logger.run_id, results


def one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err
    return lines[0]
