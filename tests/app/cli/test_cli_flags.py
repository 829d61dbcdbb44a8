"""Every top-level flag before and after every subcommand: honoured in both places, or refused in one line in both
(issue 25, defect 2: `kvscope --dtype float32 chat hi` ran in the default dtype, silently)."""

from __future__ import annotations

import argparse

import pytest
from cli_helpers import assert_one_line_error, run_cli
from runlog_faults import make_log

from kvscope.app import cli
from kvscope.app.arguments import FlagRefused
from kvscope.app.runlog.reader import RunLogReader

# A value for each flag that differs from its default, so "honoured" cannot be the default showing through.
VALUES = {"model": "/nonexistent/model", "device": "cpu", "dtype": "float32", "block_size": "32", "num_blocks": "64",
          "kv_cache_memory": "64MiB", "gpu_memory_utilization": "0.5", "swap_space": "16MiB", "max_model_len": "512",
          "max_num_seqs": "8", "max_num_batched_tokens": "256", "preemption_mode": "swap",
          "allocator": "contiguous", "seed": "7", "db": "/tmp/elsewhere.db", "serve": "8123",
          "cpu_threads_bind": "auto"}


def top_level_flags() -> list[tuple[str, list[str], object]]:
    """(dest, the words that type it, the value it should give) for every top-level flag but -h and --version."""
    flags, parser = [], cli.build_parser()
    for action in parser._actions:
        if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        if isinstance(action, argparse.BooleanOptionalAction):       # default on: type the "off" spelling
            flags.append((action.dest, [action.option_strings[1]], False))
        elif action.nargs == 0:
            flags.append((action.dest, [action.option_strings[0]], True))
        else:   # a flag added later gets a value of its kind: a choice other than its default, or its type's
            other = [c for c in action.choices or () if c != parser.typed_defaults[action.dest]]
            text = VALUES.get(action.dest) or (other[0] if other else {int: "3", float: "0.5"}.get(action.type, "x1"))
            flags.append((action.dest, [action.option_strings[0], text], (action.type or str)(text)))
    return flags


def subcommands() -> list[list[str]]:
    """Each subcommand (and each action of one that has actions), with the positional words it needs."""
    found = []

    def walk(parser: argparse.ArgumentParser, words: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    needed = [("http://localhost:8000" if a.dest == "url" else "1") for a in child._actions
                              if not a.option_strings and a.nargs is None]
                    found.append([*words, name, *needed])
                    walk(child, [*words, name])

    walk(cli.build_parser(), [])
    return found


def outcome(argv: list[str], dest: str):
    """("honoured", the value parsed) or ("refused", the message)."""
    try:
        return "honoured", getattr(cli.parse_args(argv), dest)
    except FlagRefused as exc:
        return "refused", str(exc)


def test_every_top_level_flag_is_honoured_or_refused_alike_before_and_after_every_subcommand():
    commands, flags = subcommands(), top_level_flags()
    assert {words[0] for words in commands} >= {"chat", "lesson", "bench", "runs", "screenshots", "attach"}
    honoured = 0
    for words in commands:
        for dest, typed, value in flags:
            before, after = outcome([*typed, *words], dest), outcome([*words, *typed], dest)
            assert before[0] == after[0], (typed, words, before, after)
            if before[0] == "honoured":
                assert before[1] == after[1] == value, (typed, words, before, after)
                honoured += 1
            else:
                assert typed[0] in before[1] and "\n" not in before[1] and f"kvscope {words[0]}" in before[1]
    assert honoured >= 2 * len(flags)    # chat takes every one of them, and more subcommands take some


@pytest.mark.parametrize("argv", [
    ["--dtype", "float32", "chat", "hi"], ["--num-blocks", "64", "chat", "hi"], ["--no-log", "chat", "hi"],
    ["--teach", "chat", "hi"]])
def test_the_flags_of_the_issue_reach_the_chat_engine(argv):
    args = cli.parse_args(argv)
    config = cli.engine_config(args)
    assert (config.dtype, config.num_blocks, args.no_log) == (
        "float32" if "--dtype" in argv else "auto", 64 if "--num-blocks" in argv or "--teach" in argv else None,
        "--no-log" in argv)


def test_a_model_typed_before_chat_is_the_model_it_loads(capsys, tmp_path):
    status, _, err = run_cli(capsys, "--model", str(tmp_path / "nope"), "chat", "hi")
    assert_one_line_error(status, err, "does not exist", str(tmp_path / "nope"))


def test_a_db_typed_before_runs_is_the_log_it_lists(capsys, tmp_path):
    make_log(tmp_path / "runs.db")
    (run,) = RunLogReader(tmp_path / "runs.db").list_runs()
    assert cli.main(["--db", str(tmp_path / "runs.db"), "runs"]) == 0
    assert run["model"] in capsys.readouterr().out      # not the user's own log, which has no such run


@pytest.mark.parametrize("argv", [["--dtype", "float32", "runs"], ["runs", "--dtype", "float32"],
                                  ["lesson", "--num-blocks", "3"], ["runs", "show", "3", "--teach"]])
def test_a_flag_the_subcommand_does_not_take_is_one_line_and_exit_2(capsys, argv):
    status, _, err = run_cli(capsys, *argv)
    assert_one_line_error(status, err, "does not take")
