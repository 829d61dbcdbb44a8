"""The bench's output: ratios of kvscope paged to every other system, a table, and JSON lines."""

from __future__ import annotations

import json
import math

from kvscope.app.bench.accuracy import BELOW_BAR
from kvscope.app.bench.metrics import REPORT_KEYS, ratio
from kvscope.app.bench.systems import PAGED

REFERENCE_SYSTEM = PAGED
RATIO_KEY = "paged_ratio"


def add_ratios(rows: list[dict]) -> list[dict]:
    """Set each row's ``paged_ratio``: kvscope-paged output tok/s over this one's (same workload, dtype)."""
    reference = {(r["workload"], r["dtype"]): r["output_tokens_per_s"]
                 for r in rows if r["system"] == REFERENCE_SYSTEM}
    for row in rows:
        paged = reference.get((row["workload"], row["dtype"]))
        mine = row["output_tokens_per_s"]
        row[RATIO_KEY] = None if row["system"] == REFERENCE_SYSTEM else ratio(paged, mine)
    return rows


def json_lines(rows: list[dict]) -> str:
    """One object per row: the report's keys (REPORT_KEYS) first, then whatever else the system measured."""
    lines = []
    for row in rows:
        ordered = {key: row.get(key) for key in REPORT_KEYS}
        ordered.update((k, v) for k, v in row.items() if k not in REPORT_KEYS)
        lines.append(json.dumps({k: _finite(v) for k, v in ordered.items()}))
    return "\n".join(lines)


def _finite(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _first(row: dict) -> str:
    return f"{row['first_token_agreement']}/{row['accuracy_sample']}{_mark(row)}"


def _lead(row: dict) -> str:
    return f"{row['mean_leading_agreement']:.1f}{_mark(row)}"


def _alone(row: dict) -> str:
    return f"{row['equal_alone']}/{row['accuracy_sample']}"


def _mark(row: dict) -> str:
    return BELOW_BAR if row.get("below_transformers_bf16") else ""


# (header, key, format) per column; a format is a str.format pattern or a function of the row.
_COLUMNS = (
    ("system", "system", "{}"),
    ("out tok/s", "output_tokens_per_s", "{:.1f}"),
    ("all tok/s", "total_tokens_per_s", "{:.1f}"),
    ("batch mean", "mean_batch", "{:.1f}"),
    ("max", "max_batch", "{}"),
    ("KV util", "kv_token_utilisation", "{:.0%}"),
    ("TTFT p50", "ttft_p50_s", "{:.2f}s"),
    ("p99", "ttft_p99_s", "{:.2f}s"),
    ("ITL p50", "itl_p50_s", "{:.0f}ms", 1000),
    ("p99", "itl_p99_s", "{:.0f}ms", 1000),
    ("preempt", "preemptions", "{}"),
    ("prefill computed", "prefill_tokens_computed", "{:,}"),
    ("RSS MiB", "peak_rss_mb", "{:,.0f}"),
    ("MFU", "mfu", "{:.0%}"),      # model FLOPs over wall time, against the measured matmul peak
    ("load", "load_s", "{:.0f}s"),   # outside the timed run: vLLM's load and compile
    ("paged x", RATIO_KEY, "{:.2f}x"),
    ("first", "first_token_agreement", _first),     # accuracy against transformers fp32 (app/bench/accuracy.py)
    ("lead", "mean_leading_agreement", _lead),
    ("= alone", "equal_alone", _alone),
)


def _cell(row: dict, column: tuple) -> str:
    value = row.get(column[1])
    if value is None:
        return "-"
    if callable(column[2]):
        return column[2](row)
    scale = column[3] if len(column) > 3 else 1
    return column[2].format(value * scale)


def format_table(rows: list[dict], notes: dict[tuple[str, str], list[str]] | None = None) -> str:
    """One block per (workload, dtype): a header line, the systems, then that block's notes."""
    blocks = []
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["workload"], row["dtype"]), []).append(row)
    for (workload, dtype), members in groups.items():
        first = members[0]
        title = (f"{workload} · {dtype} · {first['requests']} requests · "
                 f"{first['output_tokens']:,} output tokens")
        cells = [[c[0] for c in _COLUMNS]] + [[_cell(r, c) for c in _COLUMNS] for r in members]
        widths = [max(len(line[i]) for line in cells) for i in range(len(_COLUMNS))]
        lines = [title]
        for line in cells:
            lines.append("  ".join(text.ljust(w) if i == 0 else text.rjust(w)
                                   for i, (text, w) in enumerate(zip(line, widths, strict=True))))
        lines.extend(f"  {note}" for note in (notes or {}).get((workload, dtype), []))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def titled_table(title: list[str], header: list[str], cells: list[list[str]], footer: str) -> str:
    """A bench's text table: its title lines, the aligned rows (``aligned_rows``), and a footer line."""
    return "\n".join([*title, *aligned_rows(header, cells), footer])


def aligned_rows(header: list[str], cells: list[list[str]]) -> list[str]:
    """A header line and one line per row, each column right-aligned to its widest cell."""
    widths = [max(len(header[i]), *(len(row[i]) for row in cells)) for i in range(len(header))]
    return ["  ".join(text.rjust(width) for text, width in zip(row, widths, strict=True)) for row in [header, *cells]]
