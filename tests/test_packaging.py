"""kvscope installs one import name, `kvscope`, and nothing that collides with other packages."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_FOLDERS = ("app", "engine", "kernels", "themes")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel built from a copy of the checkout, so the build leaves nothing behind in it."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist")
    for folder in PACKAGE_FOLDERS:
        shutil.copytree(ROOT / folder, source / folder, ignore=ignore)
    for name in ("__init__.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "--wheel-dir", str(work / "out"), str(source)], check=True, capture_output=True)
    (built,) = (work / "out").glob("kvscope-*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_installs_only_kvscope(wheel):
    top_level = {name.split("/")[0] for name in wheel.namelist() if ".dist-info/" not in name}
    assert top_level == {"kvscope"}


def test_the_wheel_carries_every_module_and_style_sheet(wheel):
    names = set(wheel.namelist())
    for folder in PACKAGE_FOLDERS:
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".tcss", ".txt", ".cpp") and "__pycache__" not in path.parts:
                assert f"kvscope/{path.relative_to(ROOT).as_posix()}" in names, path


def test_the_engine_imports_from_outside_the_checkout(tmp_path):
    result = subprocess.run([sys.executable, "-c", "import kvscope.engine; print(kvscope.engine.LLMEngine.__name__)"],
                            cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "LLMEngine"
