"""`kvscope` with no subcommand: a model or pool it cannot start is one line and exit 2, before any
window opens (issue 13 item 12), in the engine's own process (the default) and in the window's (--in-process,
--serve), where the window then runs the engine built for that check."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from cli_helpers import assert_one_line_error, run_cli

from kvscope.app import app as app_module
from kvscope.app.worker.factory import first_engine_then_build
from kvscope.engine.config import EngineConfig
from kvscope.engine.fake_runner import fake_engine
from kvscope.engine.model.loader import ModelError


@pytest.fixture
def no_window(monkeypatch):
    def run_app(*args, **kwargs):
        raise AssertionError("the window opened")

    monkeypatch.setattr(app_module, "run_app", run_app)


def test_a_missing_model_is_one_line_and_exit_2(capsys, tmp_path, no_window):
    status, _, err = run_cli(capsys, "--in-process", "--model", str(tmp_path / "nope"))
    assert_one_line_error(status, err, "does not exist", str(tmp_path / "nope"))


def test_a_pool_too_small_for_one_request_is_one_line_and_exit_2(capsys, no_window):
    status, _, err = run_cli(capsys, "--in-process", "--device", "cpu", "--dtype", "float32",
                             "--kv-cache-memory", "1KiB")
    assert_one_line_error(status, err, "KV blocks", "--kv-cache-memory")


def test_a_pool_torch_cannot_allocate_is_one_line_and_exit_2(capsys, no_window):
    status, _, err = run_cli(capsys, "--in-process", "--device", "cpu", "--dtype", "float32",
                             "--num-blocks", str(10**10))
    assert_one_line_error(status, err, "cannot build the engine")


def test_a_real_process_with_stdin_from_dev_null_exits_2_at_once(tmp_path):
    result = subprocess.run([sys.executable, "-m", "kvscope.app.cli", "--model", str(tmp_path / "x")],
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("kvscope: error:")


def test_the_window_runs_the_engine_that_was_checked(capsys, monkeypatch):
    built, opened = [], {}

    def llm_engine(config):
        built.append(fake_engine(config))
        return built[-1]

    def run_app(config, *, db_path, log_enabled, engine, serve, chat_sampling):
        opened.update(config=config, engine=engine, serve=serve, chat_sampling=chat_sampling)
        return 0

    monkeypatch.setattr("kvscope.engine.LLMEngine", llm_engine)
    monkeypatch.setattr(app_module, "run_app", run_app)
    status, _, _ = run_cli(capsys, "--in-process", "--num-blocks", "32", "--no-log")
    assert status == 0 and opened["engine"] is built[0] and opened["config"].num_blocks == 32
    assert opened["serve"] is None     # no --serve: no server
    assert opened["chat_sampling"] == ()   # no knob typed: the model's own sampling


def test_the_first_build_hands_out_the_checked_engine_and_later_ones_are_built():
    config = EngineConfig(num_blocks=32)
    checked = fake_engine(config)
    factory = first_engine_then_build(checked)
    assert factory(config) is checked
    with pytest.raises(ModelError, match="does not exist"):  # a real build, not the checked engine again
        factory(EngineConfig(num_blocks=32, model="/no/such/model"), checked)


@pytest.mark.parametrize("flags", [(), ("--engine-process",)], ids=["default", "named"])
def test_the_engine_process_a_missing_model_is_one_line_and_exit_2_before_any_window(capsys, tmp_path, monkeypatch,
                                                                                   flags):
    """By default the first engine is built in the engine's own process, and a model it cannot load is told as
    plainly, before the window opens."""
    monkeypatch.setattr(app_module.KVScopeApp, "run", lambda self: pytest.fail("the window opened"))
    status, _, err = run_cli(capsys, *flags, "--model", str(tmp_path / "nope"))
    assert status == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("kvscope: error: could not start the engine")
    assert str(tmp_path / "nope") in err


def test_by_default_the_engine_runs_in_a_process_of_its_own_and_with_serve_in_the_windows(capsys, monkeypatch):
    opened = []
    monkeypatch.setattr(app_module, "run_app", lambda config, **kwargs: opened.append(kwargs) or 0)
    monkeypatch.setattr("kvscope.app.cli.first_engine", fake_engine)
    assert run_cli(capsys, "--num-blocks", "32", "--no-log")[0] == 0
    assert opened[-1]["engine_process"] is True and "engine" not in opened[-1]
    assert run_cli(capsys, "--serve", "0", "--num-blocks", "32", "--no-log")[0] == 0
    assert "engine_process" not in opened[-1] and opened[-1]["serve"] is not None
    opened[-1]["serve"].close()


def test_engine_process_and_serve_are_refused_together_and_in_process_with_engine_process(capsys, no_window):
    status, _, err = run_cli(capsys, "--engine-process", "--serve", "0")
    assert_one_line_error(status, err, "--engine-process and --serve")
    with pytest.raises(SystemExit):
        run_cli(capsys, "--engine-process", "--in-process")
    assert "not allowed with argument" in capsys.readouterr().err
