"""`kvscope runs`: list, show, export, rm, and one-line errors with exit status 2."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import sqlite3
import subprocess

import pytest
from cli_helpers import kvscope, log_run, one_error_line


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "runs.db"
    first, _ = log_run(path, 30, seed=1, model="model-a")
    second, results = log_run(path, 50, seed=2, model="model-b")
    return path, first, second, results


def test_list_shows_one_line_per_run_newest_first(db, capsys):
    path, first, second, results = db
    assert kvscope("runs", "--db", str(path)) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    assert header.split() == ["id", "started", "source", "model", "requests", "tokens", "tok/s", "status"]
    assert [line.split()[0] for line in lines] == [str(second), str(first)]
    cells = lines[0].split()
    assert cells[3] == "bench" and cells[4] == "model-b" and cells[-1] == "finished"
    assert cells[6] == f"{sum(r.stats.num_decode_tokens for r in results):,}"


def test_list_without_a_database_says_so(tmp_path, capsys):
    assert kvscope("runs", "--db", str(tmp_path / "none.db")) == 0
    assert "no runs logged yet" in capsys.readouterr().out
    assert not (tmp_path / "none.db").exists()


def test_show_prints_a_summary(db, capsys):
    path, _, second, results = db
    assert kvscope("runs", "show", str(second), "--db", str(path)) == 0
    out = capsys.readouterr().out
    fields = dict(line.split(None, 1) for line in out.splitlines() if not line.startswith(("device", "mean ",
                                                                                           "KV ", "prefix")))
    assert fields["run"].startswith(f"{second} (finished, started by bench)")
    assert fields["model"] == "model-b"
    assert fields["steps"].startswith("50 ")
    assert '"num_blocks": 64' in fields["config"]
    assert "mean tok/s" in out and "prefix cache" in out and "KV usage" in out


def test_db_flag_may_come_before_the_action(db, capsys):
    path, first, _, _ = db
    assert kvscope("runs", "--db", str(path), "show", str(first)) == 0
    assert "model-a" in capsys.readouterr().out


def test_export_json_holds_the_summary_and_every_table(db, capsys):
    path, _, second, results = db
    assert kvscope("runs", "export", str(second), "--format", "json", "--db", str(path)) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["run"]["id"] == second
    assert [s["step"] for s in document["steps"]] == [r.stats.step for r in results]
    assert len(document["events"]) == sum(len(r.events) for r in results)
    assert all(r["run_id"] == second for r in document["requests"])


def test_export_csv_writes_one_table(db, capsys, tmp_path):
    path, _, second, results = db
    assert kvscope("runs", "export", str(second), "--format", "csv", "--db", str(path)) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [int(r["step"]) for r in rows] == [r.stats.step for r in results]
    assert float(rows[-1]["kv_usage"]) == pytest.approx(results[-1].stats.kv_usage)
    out = tmp_path / "requests.csv"
    assert kvscope("runs", "export", str(second), "--format", "csv", "--table", "requests",
                   "-o", str(out), "--db", str(path)) == 0
    assert "request_id" in out.read_text().splitlines()[0]


def test_rm_removes_the_run_and_its_rows(db, capsys):
    path, first, second, _ = db
    assert kvscope("runs", "rm", str(first), "--db", str(path)) == 0
    assert f"removed run {first}" in capsys.readouterr().out
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT count(*) FROM steps WHERE run_id = ?", [first]).fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM steps WHERE run_id = ?", [second]).fetchone()[0] == 50
    conn.close()
    assert kvscope("runs", "show", str(first), "--db", str(path)) == 2


@pytest.mark.parametrize("action", [("show", "99"), ("export", "99"), ("rm", "99")])
def test_an_unknown_run_is_one_line_and_exit_2(db, capsys, action):
    path = db[0]
    assert kvscope("runs", *action, "--db", str(path)) == 2
    assert "no run with id 99" in one_error_line(capsys)


def test_a_missing_database_is_one_line_and_exit_2(tmp_path, capsys):
    assert kvscope("runs", "show", "1", "--db", str(tmp_path / "none.db")) == 2
    assert "no run log at" in one_error_line(capsys)


def test_a_corrupt_database_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "runs.db"
    path.write_bytes(b"\x00garbage" * 1000)
    assert kvscope("runs", "--db", str(path)) == 2
    assert str(path) in one_error_line(capsys)


def test_a_newer_database_is_refused(db, capsys):
    path = db[0]
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    assert kvscope("runs", "rm", "1", "--db", str(path)) == 2
    assert "newer kvscope" in one_error_line(capsys)


def test_an_unwritable_export_target_is_one_line(db, capsys, tmp_path):
    path, first, _, _ = db
    target = tmp_path / "no-such-dir" / "out.json"
    assert kvscope("runs", "export", str(first), "-o", str(target), "--db", str(path)) == 2
    assert "cannot write" in one_error_line(capsys)


@contextlib.contextmanager
def read_only(path):
    """``path`` (a file or a folder) made unwritable: the immutable flag as root, whom modes do not stop."""
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not available here")
        undo = ["chattr", "-i", str(path)]
    else:
        mode = path.stat().st_mode
        path.chmod(0o555 if path.is_dir() else 0o444)
        undo = None
    try:
        yield
    finally:
        if undo:
            subprocess.run(undo, check=True)
        else:
            path.chmod(mode)


@pytest.mark.parametrize("which", ["file", "folder"])
def test_rm_on_a_read_only_log_says_so_in_words(db, capsys, which):
    path, first, _, _ = db
    target = path if which == "file" else path.parent
    with read_only(target):
        assert kvscope("runs", "rm", str(first), "--db", str(path)) == 2
    line = one_error_line(capsys)
    assert line.startswith("kvscope runs: cannot change the run log: ") and line.endswith("nothing was removed")
    assert (f"{path} is read-only" if which == "file" else f"its folder {path.parent} is read-only") in line
    assert kvscope("runs", "show", str(first), "--db", str(path)) == 0     # it is still there


def test_list_and_show_print_logged_strings_without_control_characters(tmp_path, capsys):
    path = tmp_path / "runs.db"
    run_id, _ = log_run(path, 3, seed=1, model="evil\x1b]0;pwned\x07\x9b2J-model")
    assert kvscope("runs", "--db", str(path)) == 0 and kvscope("runs", "show", str(run_id), "--db", str(path)) == 0
    out = capsys.readouterr().out
    assert "evil]0;pwned2J-model" in out and not any(c in out for c in "\x1b\x07\x9b")


def test_show_names_computed_prompt_tokens_beside_the_prompts_own(tmp_path, capsys):
    """The prefix cache computes fewer prompt tokens than the prompts hold: `runs show` called the computed ones
    "prompt", as if they were the prompts' length."""
    from kvscope.app.runlog import record_run
    from kvscope.engine.config import EngineConfig, SamplingParams
    from kvscope.engine.fake_runner import fake_engine

    path = tmp_path / "runs.db"
    engine = fake_engine(EngineConfig(num_blocks=64, max_model_len=256))
    prompt = "the same long prompt, asked twice so the second reuses its cached blocks " * 2
    with record_run(engine, db_path=path) as logger:
        for _ in range(2):
            engine.add_request(prompt, SamplingParams(max_tokens=2))
            while engine.has_unfinished_requests():
                engine.step()
    assert kvscope("runs", "show", str(logger.run_id), "--db", str(path)) == 0
    tokens = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("tokens"))
    computed, prompts = (int(word.replace(",", "")) for word in tokens.split()[1:5:3])
    assert f"{computed:,} computed of {prompts:,} prompt" in tokens and computed < prompts
