"""What one system measured on one workload, and the report row computed from it.

Every system records times the same way: seconds since the moment all requests
were submitted (they arrive at once), one timestamp per useful token of each
request's first sample. TTFT is a request's first timestamp; inter-token latency
is the gap between consecutive timestamps of one request, pooled over requests.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass, field

import numpy as np

# The keys every JSON line carries (null where a system cannot report one), in print order.
REPORT_KEYS = (
    "workload", "system", "dtype", "requests",
    "output_tokens", "wall_s", "output_tokens_per_s", "total_tokens_per_s",
    "mean_batch", "max_batch", "kv_token_utilisation",
    "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
    "preemptions", "prefill_tokens_computed", "peak_rss_mb",
)


@dataclass
class RunRecord:
    system: str
    settings: dict
    wall_s: float
    num_prompt_tokens: int
    num_output_tokens: int                      # useful tokens only: what the requests asked for
    token_times: list[list[float]]              # per request, sample 0: seconds since submission
    batch_sizes: list[int] = field(default_factory=list)     # running batch per step; [] when unknown
    kv_used_slots: int | None = None            # summed over steps
    kv_reserved_slots: int | None = None        # summed over steps
    preemptions: int | None = None
    prefill_tokens_computed: int | None = None
    peak_rss_mb: float | None = None
    step_shapes: list[tuple[int, int]] = field(default_factory=list)  # (tokens forwarded, rows sampled)
    step_s: float | None = None                 # time inside the engine's step()
    forward_s: float | None = None              # of which in the model forward
    extra: dict = field(default_factory=dict)   # system-specific figures, reported as they are
    outputs: list[tuple[int, ...]] | None = None            # per request, sample 0's tokens; None if unknown
    alone_outputs: dict[int, list[int]] | None = None       # by request index: its tokens when run alone


def percentile(values, q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no values."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def time_to_first_token(token_times: list[list[float]]) -> list[float]:
    return [times[0] for times in token_times if times]


def inter_token_gaps(token_times: list[list[float]]) -> np.ndarray:
    gaps = [np.diff(np.asarray(times, dtype=np.float64)) for times in token_times if len(times) > 1]
    return np.concatenate(gaps) if gaps else np.empty(0)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def engine_overhead(forward_s: float | None, step_s: float | None) -> float | None:
    """Share of step time spent outside the model forward (scheduling, bookkeeping, sampling)."""
    share = ratio(forward_s, step_s)
    return None if share is None else 1.0 - share


def summarise(record: RunRecord, workload: str, dtype: str, num_requests: int) -> dict:
    """The report row: REPORT_KEYS first, then the system's extra figures."""
    ttft = time_to_first_token(record.token_times)
    gaps = inter_token_gaps(record.token_times)
    wall = record.wall_s
    row = {
        "workload": workload,
        "system": record.system,
        "dtype": dtype,
        "requests": num_requests,
        "output_tokens": record.num_output_tokens,
        "wall_s": wall,
        "output_tokens_per_s": ratio(record.num_output_tokens, wall),
        "total_tokens_per_s": ratio(record.num_output_tokens + record.num_prompt_tokens, wall),
        "mean_batch": float(np.mean(record.batch_sizes)) if record.batch_sizes else None,
        "max_batch": max(record.batch_sizes) if record.batch_sizes else None,
        "kv_token_utilisation": ratio(record.kv_used_slots, record.kv_reserved_slots),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
        "preemptions": record.preemptions,
        "prefill_tokens_computed": record.prefill_tokens_computed,
        "peak_rss_mb": record.peak_rss_mb,
        "engine_overhead": engine_overhead(record.forward_s, record.step_s),
    }
    row.update(record.extra)
    return row


class PeakRss:
    """Peak resident memory of the process over a ``with`` block, in MiB.

    On Linux the kernel's high-water mark is reset on entry (``clear_refs`` 5), so the
    figure belongs to this block alone even though every system runs in one process.
    Elsewhere it falls back to the process's lifetime peak.
    """

    def __init__(self) -> None:
        self.peak_mb: float | None = None
        self._reset = False

    def __enter__(self) -> PeakRss:
        try:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")
            self._reset = True
        except OSError:
            self._reset = False
        return self

    def __exit__(self, *exc) -> None:
        self.peak_mb = _high_water_mark_mb() if self._reset else _lifetime_peak_mb()


def _high_water_mark_mb() -> float | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return _lifetime_peak_mb()


def _lifetime_peak_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB elsewhere
