"""Every ``KVSCOPE_*`` environment setting, read in one place.

The engine (the model cache) and the app (the run log) both need the user's
directories, and the engine may not import the app, so the lookup lives at the
package root. Each call reads the environment afresh: a test or a script that
changes a variable sees the change. Defaults are the XDG locations, through
platformdirs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import platformdirs

APP_NAME = "kvscope"


@dataclass(frozen=True)
class Settings:
    cache_dir: Path     # converted models: safe to delete, rebuilt on the next load
    data_dir: Path      # what the user keeps: the run log

    @property
    def db_path(self) -> Path:
        """The run log used when no --db is given."""
        return self.data_dir / "runs.db"


def settings(environ: Mapping[str, str] | None = None) -> Settings:
    """The settings from ``environ`` (default: os.environ); an unset or empty variable means the default."""
    environ = os.environ if environ is None else environ

    def directory(variable: str, default: str) -> Path:
        value = environ.get(variable)
        return Path(value).expanduser() if value else Path(default)

    return Settings(cache_dir=directory("KVSCOPE_CACHE", platformdirs.user_cache_dir(APP_NAME)),
                    data_dir=directory("KVSCOPE_DATA", platformdirs.user_data_dir(APP_NAME)))
