"""Every module of the engine's step core stands in the contract that keeps it off the model side, so a new one
is not left unchecked by omission."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
CORE_CONTRACT = "the engine's step core reaches the model side only through the Runner Protocol"


def test_every_step_core_module_is_kept_off_the_model_side():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    [core] = [contract for contract in contracts if contract["name"] == CORE_CONTRACT]
    modules = {f"kvscope.engine.{path.stem}" for path in (ROOT / "engine").glob("*.py") if path.name != "__init__.py"}
    assert core["forbidden_modules"] == ["kvscope.engine.model"]
    assert set(core["source_modules"]) == modules
