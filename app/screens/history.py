"""Past runs from the run log: a list, and for the highlighted run its summary and charts.

The run log is a file anything may have damaged (garbage pages, a truncated
copy, a blob that no longer decodes). Every read goes through ``_read``, which
shows what went wrong in the summary panel instead of ending the app. Every
string it holds was written by someone else (a watched server's version and
URL, a model's name): each is drawn as plain text or a markup variable, cleaned
of control characters (app/safe_text.py), never parsed as markup.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.screen import Screen
from textual.widgets import DataTable, Label, Sparkline, Static

from kvscope.app.runlog import RunLogReader, SchemaError, run_origin
from kvscope.app.safe_text import one_line
from kvscope.app.screens.replay import ReplayScreen
from kvscope.app.widgets.formatting import compact
from kvscope.app.widgets.key_bar import KeyBar

T = TypeVar("T")


# What a run replays on: ReplayScreen, or the App's choice by the run's source. The App hands it in, so this
# screen never imports the attached window's replay (attach/ is a layer above the screens).
ReplayFor = Callable[[RunLogReader, int], Screen]


RUN_TEXT = ("status", "started_at", "status_detail", "model", "device", "dtype")
COLUMNS = ("id", "status", "started", "source", "reqs", "tokens", "tok/s", "model")
MIN_TEXT_WIDTH = 8
CUTTABLE = ("source", "model")    # the free-text columns, cut with "…" (the widest first) when the row is too wide


def run_variables(run: dict) -> dict[str, str]:
    """The run's strings, as ``describe_run``'s markup takes them: variables, never markup."""
    config = run.get("config") if isinstance(run.get("config"), dict) else {}
    values = {name: one_line(run.get(name) or "", 200) for name in RUN_TEXT}
    values["started_at"] = values["started_at"][:19]
    values["source"] = one_line(run_origin(run), 200)
    values["allocator"] = one_line(config.get("allocator", "?"), 40)
    values["preemption_mode"] = one_line(config.get("preemption_mode", "?"), 40)
    return values


def cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def run_cells(run: dict) -> tuple[str, ...]:
    """One run's row, in COLUMNS' order; the start without its year (the id already orders the runs)."""
    rate = run.get("mean_tokens_per_s")
    text = run_variables(run)
    return (str(run["id"]), text["status"], text["started_at"][5:16].replace("T", " "), text["source"],
            str(run.get("num_requests") or 0), f"{run.get('num_generated_tokens') or 0:,}",
            "–" if rate is None else compact(rate), text["model"])


def describe_run(run: dict) -> str:
    config = run.get("config") if isinstance(run.get("config"), dict) else {}

    def number(key: str, fmt: str = ",") -> str:
        value = run.get(key)
        return "–" if not isinstance(value, (int, float)) else format(value, fmt)

    hits = run.get("prefix_cache_hits") or 0
    queries = run.get("prefix_cache_queries") or 0
    detail = run.get("status_detail")
    lines = [
        f"[b]Run {number('id', 'd')}[/b] · $status · started $started_at by $source",
        *(["$status_detail"] if detail else []),
        "$model · $device · $dtype · $allocator · preempt $preemption_mode · prefix cache "
        f"{'on' if config.get('enable_prefix_caching', True) else 'off'}",
        f"pool {number('num_blocks')} blocks × {number('block_size')} tokens",
        f"steps {number('num_steps')} · requests {number('num_requests')} "
        f"({number('num_finished_requests')} finished) · generated tokens {number('num_generated_tokens')}",
        f"mean {number('mean_tokens_per_s', ',.1f')} tok/s · peak KV usage "
        f"{100 * (run.get('peak_kv_usage') or 0):.1f}% · preemptions {number('num_preemptions')} · "
        f"prefix hits {100 * hits / queries if queries else 0:.1f}%",
    ]
    return "\n".join(lines)


class RunsTable(DataTable):
    """The list of runs, whose Home and End move the selection (DataTable's only scroll, leaving the summary on a
    run no longer in sight)."""

    BINDINGS = [
        Binding("home,ctrl+home", "first_run", "First", show=False),
        Binding("end,ctrl+end", "last_run", "Last", show=False),
    ]

    def action_first_run(self) -> None:
        if self.row_count:
            self.move_cursor(row=0)

    def action_last_run(self) -> None:
        if self.row_count:
            self.move_cursor(row=self.row_count - 1)


class HistoryScreen(Screen):
    BINDINGS = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("enter", "replay", "Replay"),
        Binding("r", "reload", "Reload"),
    ]

    def __init__(self, db_path: str | Path | None, replay_for: ReplayFor = ReplayScreen) -> None:
        super().__init__(id="history")
        self.db_path = db_path
        self.replay_for = replay_for
        self.reader: RunLogReader | None = None
        self.run_id: int | None = None
        self._runs: list[tuple[str, ...]] = []

    def compose(self) -> ComposeResult:
        yield Static("[b]Run history[/b]", id="history-title")
        with Horizontal(id="history-body"):
            yield RunsTable(id="runs", cursor_type="row", zebra_stripes=True, classes="panel")
            with Vertical(id="run-detail", classes="panel"):
                yield Static("", id="run-summary")
                yield Label("generated tokens/s over the run", classes="chart-label")
                yield Sparkline([], id="run-throughput")
                yield Label("KV usage over the run", classes="chart-label")
                yield Sparkline([], id="run-kv")
        yield KeyBar(own_only=True, id="keys")

    def on_mount(self) -> None:
        self.action_reload()

    def on_resize(self) -> None:
        self.call_after_refresh(self._show_runs)     # once the list has its new width

    def _open(self) -> RunLogReader | None:
        if self.db_path is None:
            self._say("The run log is off (--no-log), so there is no history to show.")
            return None
        try:
            return RunLogReader(self.db_path)
        except FileNotFoundError:
            self._say(f"No run log yet at {self.db_path}: runs appear here once the engine has stepped.")
        except (SchemaError, sqlite3.Error, OSError) as exc:
            self._say(f"Cannot read the run log at {self.db_path}: {exc}")
        return None

    def _say(self, text: str) -> None:
        self.query_one("#run-summary", Static).update(Content(one_line(text)))

    def _read(self, read: Callable[[], T]) -> T | None:
        """``read()``, or None after saying why it failed: whatever a damaged file makes the reader
        raise must not end the app."""
        try:
            return read()
        except Exception as exc:
            self._say(f"Cannot read the run log at {self.db_path}: {type(exc).__name__}: {exc}")
            return None

    def action_reload(self) -> None:
        if self.reader is None:
            self.reader = self._open()
        if self.reader is None:
            return
        runs = self._read(self.reader.list_runs)
        if runs is None:
            return
        self._runs = [run_cells(run) for run in runs]
        self.call_after_refresh(self._show_runs)
        if not runs:
            self._say("The run log is empty.")

    def _show_runs(self) -> None:
        """Every figure column whole; the source and the model take what the others leave (the wider cut first,
        with "…", only if it must), in the width left beside the scrollbar a long list will show."""
        table = self.query_one("#runs", DataTable)
        if not table.size.width:
            return
        highlighted = self.run_id
        widths = [max([len(header), *(len(cells[i]) for cells in self._runs)]) for i, header in enumerate(COLUMNS)]
        region = table.scrollable_content_region
        will_scroll = len(self._runs) + 1 > region.height and not table.show_vertical_scrollbar
        scrollbar = table.styles.scrollbar_size_vertical if will_scroll else 0
        room = region.width - scrollbar - sum(w + 2 for w in widths)
        cuttable = [COLUMNS.index(name) for name in CUTTABLE]
        while room < 0:
            widest = max(cuttable, key=lambda i: widths[i])
            if widths[widest] <= MIN_TEXT_WIDTH:
                break
            widths[widest] -= 1
            room += 1
        table.clear(columns=True)
        for header, width in zip(COLUMNS, widths, strict=True):
            table.add_column(header, width=width, key=header)
        for cells in self._runs:
            # Text, never a str: DataTable would parse a str's square brackets as markup.
            table.add_row(*(Text(cut(cell, widths[i])) for i, cell in enumerate(cells)), key=cells[0])
        if highlighted is not None and str(highlighted) in table.rows:
            table.move_cursor(row=table.get_row_index(str(highlighted)))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.row_key is None or self.reader is None:
            return
        self.run_id = int(event.row_key.value)
        found = self._read(lambda: (self.reader.run(self.run_id), self.reader.steps(self.run_id)))
        if found is None:
            return
        run, steps = found
        self.query_one("#run-summary", Static).update(Content.from_markup(describe_run(run), **run_variables(run)))
        self.query_one("#run-throughput", Sparkline).data = [s.generation_tokens_per_s for s in steps]
        self.query_one("#run-kv", Sparkline).data = [100 * s.kv_usage for s in steps]

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_replay()

    def action_replay(self) -> None:
        if self.reader is not None and self.run_id is not None:
            screen = self._read(lambda: self.replay_for(self.reader, self.run_id))
            if screen is not None:
                self.app.push_screen(screen)

    def on_unmount(self) -> None:
        if self.reader is not None:
            self.reader.close()
