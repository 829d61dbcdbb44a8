"""Every room of app/ stands in the app's layers contract, so none stops being checked by omission."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def _app_layers() -> set[str]:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    [layers] = [c["layers"] for c in contracts if c.get("type") == "layers" and c["layers"][0] == "kvscope.app.cli"]
    return {name.strip() for layer in layers for name in layer.split("|")}


def test_every_app_room_and_leaf_module_is_a_layer():
    app = ROOT / "app"
    rooms = {f"kvscope.app.{path.name}" for path in app.iterdir() if (path / "__init__.py").exists()}
    leaves = {f"kvscope.app.{path.stem}" for path in app.glob("*.py") if path.name != "__init__.py"}
    assert rooms | leaves == _app_layers()
