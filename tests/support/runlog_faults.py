"""Ways a run log goes wrong, for the tests (no tests here): a full disk, garbage pages, a bad blob.

Imported as a plain module (tests/ is on sys.path through conftest.py).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from kvscope.app.runlog import opening, record_run
from kvscope.engine.config import EngineConfig
from kvscope.engine.fake_runner import fake_engine


def make_log(path: Path) -> None:
    """Create the run log's schema (and one empty run) at ``path``."""
    record_run(fake_engine(EngineConfig(num_blocks=16, max_model_len=64)), db_path=path).close()


def fill_the_disk(monkeypatch, path: Path, extra_pages: int = 1) -> None:
    """From now on a run-log connection may grow ``path`` by ``extra_pages`` pages only: past
    them SQLite fails the write with "database or disk is full" (SQLITE_FULL), as on a full disk."""
    make_log(path)
    real_connect = opening.connect

    def connect(name, **kwargs):
        db = real_connect(name, **kwargs)
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        db.execute(f"PRAGMA max_page_count = {pages + extra_pages}")
        return db

    monkeypatch.setattr(opening, "connect", connect)


def write_garbage_pages(path: Path, first_page: int = 2) -> None:
    """Overwrite every page from ``first_page`` on (1-based) with noise; the header page stays."""
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")     # everything in the main file
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    conn.close()
    data = bytearray(path.read_bytes())
    for offset in range((first_page - 1) * page_size, len(data)):
        data[offset] = (offset * 131 + 7) % 251
    path.write_bytes(bytes(data))


def corrupt_snapshot(path: Path, run_id: int, step: int) -> None:
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("UPDATE snapshots SET data = ? WHERE run_id = ? AND step = ?",
                     [b"\x78\x9cnot a zlib stream", run_id, step])
    conn.close()
