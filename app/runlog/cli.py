"""`kvscope runs`: list, show, export and remove the runs in the run log.

What a run log holds was written by whatever wrote the file (a model's name, a
watched server's version and URL, a reason): every string is cleaned of control
characters before it is printed (app/safe_text.py), so a log cannot drive the
terminal. A log that cannot be written (read-only, immutable, in a read-only
folder) is said to be so in words.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
from datetime import datetime
from pathlib import Path

from kvscope.app.runlog.reader import EXPORT_TABLES, DamagedRunLog, RunInUse, RunLogReader, RunNotFound, run_origin
from kvscope.app.runlog.schema import SchemaError
from kvscope.app.safe_text import one_line
from kvscope.settings import settings

_LIST_COLUMNS = ("id", "started", "source", "model", "requests", "tokens", "tok/s", "status")
MAX_RUN_ID = 2**63 - 1     # SQLite's largest integer key


def run_id(text: str) -> int:
    """argparse type of a run id: a positive integer SQLite can hold."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a run id is a whole number, got {text!r}") from None
    if not 1 <= value <= MAX_RUN_ID:
        raise argparse.ArgumentTypeError(f"a run id is between 1 and {MAX_RUN_ID}, got {text}")
    return value


def register(subparsers) -> argparse.ArgumentParser:
    runs = subparsers.add_parser("runs", help="list, show, export or remove logged runs",
                                 description="Browse the run log. With no action, lists the runs.")
    _add_db_flag(runs)
    runs.set_defaults(func=list_runs)
    actions = runs.add_subparsers(title="actions", metavar="ACTION")

    show = actions.add_parser("show", help="print a run's summary")
    show.add_argument("run_id", type=run_id, metavar="ID")
    _add_db_flag(show)
    show.set_defaults(func=show_run)

    export = actions.add_parser("export", help="write a run as JSON (everything) or CSV (one table)")
    export.add_argument("run_id", type=run_id, metavar="ID")
    export.add_argument("--format", choices=["json", "csv"], default="json")
    export.add_argument("--table", choices=EXPORT_TABLES, default="steps", help="the table CSV writes")
    export.add_argument("-o", "--output", default=None, help="file to write (default: standard output)")
    _add_db_flag(export)
    export.set_defaults(func=export_run)

    remove = actions.add_parser("rm", help="remove a run and all its rows")
    remove.add_argument("run_id", type=run_id, metavar="ID")
    _add_db_flag(remove)
    remove.set_defaults(func=remove_run)
    return runs


def _add_db_flag(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: a subcommand's unset --db must not overwrite one given before it.
    parser.add_argument("--db", default=argparse.SUPPRESS,
                        help=f"run log SQLite file (default: {settings().db_path})")


def _db_path(args: argparse.Namespace) -> Path:
    db = getattr(args, "db", None)
    return Path(db).expanduser() if db else settings().db_path


def _fail(message: str) -> int:
    print(f"kvscope runs: {one_line(message)}", file=sys.stderr)
    return 2


def _cannot_write(path: Path, exc: sqlite3.Error) -> str | None:
    """Words for a run log SQLite could not write to, or None when ``exc`` is about something else."""
    reason = str(exc).lower()
    if not any(word in reason for word in ("readonly", "read-only", "unable to open", "permission")):
        return None
    if not os.access(path, os.W_OK):
        what = f"{path} is read-only (its permissions, a read-only disk, or the immutable flag: chattr -i)"
    elif not os.access(path.parent, os.W_OK | os.X_OK):
        what = f"its folder {path.parent} is read-only, and SQLite writes its journal there"
    else:
        what = f"SQLite cannot write {path} ({exc})"
    return f"cannot change the run log: {what}; nothing was removed"


def _with_reader(action, *, writable: bool = False):
    """Run ``action(reader, args)``; turn every expected failure into one line on stderr and exit 2."""
    def failed(path: Path, exc: sqlite3.Error) -> int:
        return _fail((writable and _cannot_write(path, exc)) or f"cannot read {path}: {exc}")

    def command(args: argparse.Namespace) -> int:
        path = _db_path(args)
        try:
            reader = RunLogReader(path, writable=writable)
        except (FileNotFoundError, SchemaError) as exc:
            return _fail(str(exc))
        except sqlite3.Error as exc:
            return failed(path, exc)
        try:
            return action(reader, args)
        except (RunNotFound, RunInUse, SchemaError, DamagedRunLog) as exc:
            return _fail(str(exc))
        except sqlite3.Error as exc:
            return failed(path, exc)
        except BrokenPipeError:
            raise       # the reader of a pipe went away: kvscope's main ends quietly
        except OSError as exc:
            return _fail(f"cannot write {exc.filename or 'the output'}: {exc.strerror}")
        finally:
            reader.close()
    return command


def _local_time(iso: str | None) -> str:
    try:
        return datetime.fromisoformat(iso).astimezone().strftime("%Y-%m-%d %H:%M:%S") if iso else "-"
    except (TypeError, ValueError):     # not a time this kvscope wrote: show it as it is
        return one_line(iso, 40)


def _number(value, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def list_runs(args: argparse.Namespace) -> int:
    if not _db_path(args).exists():
        print(f"no runs logged yet ({_db_path(args)} does not exist)")
        return 0
    return _with_reader(_list)(args)


def _list(reader: RunLogReader, args: argparse.Namespace) -> int:
    rows = [
        (str(r["id"]), _local_time(r["started_at"]), one_line(run_origin(r), 60), one_line(r["model"] or "-", 60),
         _number(r["num_requests"]), _number(r["num_generated_tokens"]), _number(r["mean_tokens_per_s"], 1),
         one_line(r["status"]))
        for r in reader.list_runs()
    ]
    if not rows:
        print(f"no runs logged yet in {reader.path}")
        return 0
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(_LIST_COLUMNS)]
    right_aligned = {0, 4, 5, 6}
    for row in [_LIST_COLUMNS, *rows]:
        cells = [cell.rjust(widths[i]) if i in right_aligned else cell.ljust(widths[i])
                 for i, cell in enumerate(row)]
        print("  ".join(cells).rstrip())
    return 0


def _show(reader: RunLogReader, args: argparse.Namespace) -> int:
    run = reader.run(args.run_id)
    queries, hits = run["prefix_cache_queries"], run["prefix_cache_hits"]
    hit_rate = hits / queries if queries else None
    lines = [
        ("run", f"{run['id']} ({run['status']}, started by {run_origin(run)})"),
        *([("why", run["status_detail"])] if run.get("status_detail") else []),
        ("started", _local_time(run["started_at"])),
        ("ended", _local_time(run["ended_at"])),
        ("kvscope", run["kvscope_version"]),
        ("model", run["model"]),
        ("device / dtype", f"{run['device']} / {run['dtype']}"),
        ("KV blocks", f"{_number(run['num_blocks'])} x {run['block_size']} tokens"),
        ("steps", f"{_number(run['num_steps'])} ({_number(run['busy_seconds'], 2)} s in the engine)"),
        ("requests", f"{_number(run['num_requests'])} ({_number(run['num_finished_requests'])} finished: "
                     + (", ".join(f"{k} {v}" for k, v in run["finish_reasons"].items()) or "none") + ")"),
        # Computed prompt tokens are fewer than the prompts' own where the prefix cache hit, and more where a
        # preempted request computed its prompt again: both numbers, never one under the other's name.
        ("tokens", f"{_number(run['num_prefill_tokens'])} computed of {_number(run['num_prompt_tokens'])} prompt, "
                   f"{_number(run['num_generated_tokens'])} generated"),
        ("mean tok/s", _number(run["mean_tokens_per_s"], 1)),
        ("mean TTFT", f"{_number(run['mean_time_to_first_token'], 3)} s"),
        ("mean latency", f"{_number(run['mean_latency'], 3)} s"),
        ("KV usage", f"peak {_number(_percent(run['peak_kv_usage']), 1)}%, "
                     f"mean {_number(_percent(run['mean_kv_usage']), 1)}%"),
        ("prefix cache", f"{_number(hits)} of {_number(queries)} tokens hit "
                         f"({_number(_percent(hit_rate), 1)}%)"),
        ("preemptions", _number(run["num_preemptions"])),
        ("events", ", ".join(f"{k} {v}" for k, v in run["events"].items()) or "none"),
        ("config", json.dumps(run["config"], sort_keys=True)),
    ]
    if run["num_dropped_records"]:
        lines.append(("dropped", f"{run['num_dropped_records']} records (the disk fell behind)"))
    width = max(len(label) for label, _ in lines)
    for label, value in lines:
        print(f"{label.ljust(width)}  {one_line(value)}")
    return 0


def _percent(fraction: float | None) -> float | None:
    return None if fraction is None else 100 * fraction


def _export(reader: RunLogReader, args: argparse.Namespace) -> int:
    if args.output is None:
        reader.export(args.run_id, sys.stdout, args.format, args.table)
        return 0
    with open(args.output, "w", encoding="utf-8", newline="") as out:
        reader.export(args.run_id, out, args.format, args.table)
    print(f"wrote run {args.run_id} to {args.output}", file=sys.stderr)
    return 0


def _remove(reader: RunLogReader, args: argparse.Namespace) -> int:
    reader.delete(args.run_id)
    print(f"removed run {args.run_id} from {reader.path}")
    return 0


show_run = _with_reader(_show)
export_run = _with_reader(_export)
remove_run = _with_reader(_remove, writable=True)
