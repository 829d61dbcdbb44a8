"""Where kvscope keeps its files: XDG locations through platformdirs, overridable by environment."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

from kvscope.engine.loader import cache_dir

APP_NAME = "kvscope"
__all__ = ["cache_dir", "data_dir", "default_db_path"]


def data_dir() -> Path:
    """Data the user keeps (the run log). ``KVSCOPE_DATA`` overrides it."""
    override = os.environ.get("KVSCOPE_DATA")
    return Path(override).expanduser() if override else Path(platformdirs.user_data_dir(APP_NAME))


def default_db_path() -> Path:
    return data_dir() / "runs.db"
