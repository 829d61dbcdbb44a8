"""`kvscope bench SUBCOMMAND`: each bench's help shows its own flags only, parsing needs no textual, and the
host-side scoreboard (`bench host`, `bench ui`) runs on tiny settings and prints every phase and row.

Nothing here asserts on a time's value: only that each is measured and reported.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.app.bench import cli as bench_cli
from kvscope.app.bench.host import PHASES, SAMPLERS, PhasedEngine
from kvscope.app.cli import build_parser, main
from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.fake_runner import fake_engine


def bench_parsers() -> dict[str, argparse.ArgumentParser]:
    bench = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    action = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    return {name: parser for name, parser in action.choices.items() if name != "workloads"}   # an alias


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings if option.startswith("--")}


def test_every_bench_is_a_subcommand_whose_help_shows_only_its_own_flags():
    parsers = bench_parsers()
    assert set(parsers) >= {"throughput", "serve", "logging", "host", "ui", "hybrid", "kernels", "scheduler", "attach",
                            "lessons", "startup"}
    everyone = set().union(*(options(p) for p in parsers.values()))
    for name, parser in parsers.items():
        text = parser.format_help()
        own = options(parser)
        shown = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", text))
        assert own <= shown, (name, own - shown)
        assert not shown & (everyone - own), (name, shown & (everyone - own))
    assert "--rates" in options(parsers["serve"]) and "--pools" not in options(parsers["serve"])
    assert "--pools" in options(parsers["host"]) and "--workload" not in options(parsers["host"])


def every_parser(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from every_parser(child)


def test_no_help_and_no_docstring_of_the_app_names_an_issue():
    for parser in every_parser(build_parser()):
        assert not re.search(r"\bissues?\b|#\d", parser.format_help(), re.IGNORECASE), parser.prog
    app = Path(bench_cli.__file__).parents[1]
    for path in sorted(app.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in (tree, *ast.walk(tree)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                docstring = ast.get_docstring(node) or ""
                assert not re.search(r"\bissues?\b \d|#\d", docstring, re.IGNORECASE), (path, docstring[:80])


def test_bench_alone_lists_the_benchmarks(capsys):
    assert main(["bench"]) == 2
    out = capsys.readouterr().out
    assert all(name in out for name in ("throughput", "host", "ui", "kernels"))
    assert [register.__name__ for register in bench_cli.BENCHES].count("register_host") == 1


def test_bench_host_help_needs_no_textual_and_no_torch():
    probe = ("import sys; sys.modules['textual'] = None\n"
             "from kvscope.app.cli import main\n"
             "try:\n    main(['bench', 'host', '--help'])\nexcept SystemExit as exit_:\n    code = exit_.code\n"
             "print('torch' in sys.modules, 'transformers' in sys.modules, code)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--pools" in done.stdout and done.stdout.strip().splitlines()[-1] == "False False 0"


def test_the_phased_step_does_what_engine_step_does():
    """bench host drives a step phase by phase; it must be the engine's step, or it measures something else."""
    config = EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16, seed=3)
    plain, phased = fake_engine(config), PhasedEngine(fake_engine(config))
    for engine in (plain, phased.engine):
        for index in range(4):
            engine.add_request([7 + index] * (5 + 3 * index), SamplingParams(max_tokens=6 + index, temperature=0.0))
    while plain.has_unfinished_requests():
        expected, got = plain.step(), phased.step()
        assert [(o.request_id, o.token_ids, o.finished) for o in expected.outputs] == \
               [(o.request_id, o.token_ids, o.finished) for o in got.outputs]
        assert (expected.stats.step, expected.stats.num_decode_tokens, expected.stats.num_free_blocks) == \
               (got.stats.step, got.stats.num_decode_tokens, got.stats.num_free_blocks)
        assert (expected.snapshot.block_state == got.snapshot.block_state).all()
        assert expected.events == got.events and expected.kv_events == got.kv_events
    assert not phased.engine.has_unfinished_requests()
    assert all(len(times) == plain.step_counter for times in phased.times.values())


def test_bench_host_prints_every_phase_for_every_cell(capsys):
    argv = ["bench", "host", "--pools", "96,128", "--batches", "2", "--contexts", "20,40", "--steps", "2",
            "--sampler-repeats", "1", "--vocab", "300"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("blocks"))
    for column in (*PHASES[:5], "engine", "run-log", *(f"sampler {name}" for name in SAMPLERS)):
        assert column in header
    rows = [line.split() for line in out.splitlines() if re.match(r"\s*\d+\s+2\s+\d+", line)]
    assert sorted((row[0], row[2]) for row in rows) == [("128", "20"), ("128", "40"), ("96", "20"), ("96", "40")]
    assert main([*argv, "--json"]) == 0
    cells = json.loads(capsys.readouterr().out)
    assert len(cells) == 4
    for cell in cells:
        assert set(cell["phases_ms"]) == {*PHASES, "engine"} and set(cell["sampler_ms"]) == set(SAMPLERS)
        assert all(0 <= s["p10"] <= s["median"] <= s["p90"] for s in cell["phases_ms"].values())


def test_bench_host_refuses_a_cell_that_does_not_fit_its_pool(capsys):
    with pytest.raises(SystemExit, match="need .* blocks, more than the pool of 8"):
        main(["bench", "host", "--pools", "8", "--batches", "4", "--contexts", "100", "--steps", "1",
              "--sampler-repeats", "1", "--vocab", "300"])


def test_bench_ui_refuses_a_usage_that_is_not_a_share_below_one_in_one_line(capsys):
    with pytest.raises(SystemExit, match="^kvscope bench ui: --usage is a share below 1, got 1.5$"):
        main(["bench", "ui", "--usage", "1.5"])


def test_bench_ui_prints_the_frame_and_the_window_cost(capsys):
    argv = ["bench", "ui", "--blocks", "2048", "--usage", "0.5", "--batch", "4", "--steps", "6", "--frames", "2",
            "--size", "100x30", "--rounds", "1"]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["blocks"] == 2048 and 0.4 < result["usage"] < 0.7 and result["cells"] > 0
    assert result["frame_ms"]["median"] > 0 and result["cells_ms"]["median"] > 0
    assert result["headless_steps_per_cpu_s"] > 0 and result["window_steps_per_cpu_s"] > 0
    assert result["headless_engine_ms"] > 0 and result["window_engine_ms"] > 0 and result["window_ui_ms"] >= 0
    # The engine in a process of its own: measured there, on both sides.
    assert result["process_headless_steps_per_cpu_s"] > 0 and result["process_window_steps_per_cpu_s"] > 0
    assert result["process_headless_engine_ms"] > 0 and result["process_window_engine_ms"] > 0
    assert result["process_ui_ms"] > 0
    assert result["process_headless_steps_per_s"] > 0 and result["process_window_steps_per_s"] > 0
    assert len(result["process_turn_costs"]) == 1     # one turn a round
    # Every step the window was sent came in a post: the warm-up, the settling and the measured steps, 6 each.
    assert result["process_posts_per_s"] > 0 and 1 <= result["process_steps_per_post"] <= 18
    # The run log beside one engine: every step it was handed is in the log.
    run_log = result["run_log"]
    assert run_log["steps"] == run_log["steps_written"] == 6
    assert run_log["alone_engine_ms"] > 0 and run_log["logging_engine_ms"] > 0 and run_log["writer_ms"] > 0
    assert main(argv) == 0
    out = capsys.readouterr().out
    for row in ("pool", "block map", "frame: cells from the snapshot", "frame: cells and every line",
                "engine headless", "engine, window open", "the window's cost", "engine thread per step",
                "UI thread per engine step", "engine in its own process", "engine alone", "window open",
                "window's process per engine step", "posts to the window", "steps per wall-clock second", "the run log",
                "wall-clock per step", "writer thread per step", "6 of 6 steps recorded", "turn by turn"):
        assert row in out


def test_bench_hybrid_shows_a_sliding_window_model_holding_less_at_the_same_memory(capsys):
    argv = ["bench", "hybrid", "--layers", "4", "--window", "32", "--pattern", "2", "--memory-mib", "4",
            "--requests", "6", "--prompt", "100", "--max-tokens", "20", "--max-model-len", "256", "--chunk", "64"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "hybrid" in out and "every layer full" in out
    assert main([*argv, "--json"]) == 0
    hybrid, full = json.loads(capsys.readouterr().out)
    assert (hybrid["groups"], full["groups"]) == (2, 1) and hybrid["block_kib"] * 2 == full["block_kib"]
    assert hybrid["kib_per_request"] < full["kib_per_request"]
    assert hybrid["max_concurrency"] > full["max_concurrency"]
