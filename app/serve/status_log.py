"""vLLM's log lines, from kvscope's engine: the startup facts and the 10-second status line.

The format is vLLM's (``INFO 12-01 19:47:34 [loggers.py:335] …``), and so are the messages, word for word
where kvscope has the quantity: "CPU KV cache size: 3,072 tokens, Maximum concurrency for 1,024 tokens per
request: 3.00x" at startup, and every 10 seconds "Engine 000: Avg prompt throughput: … tokens/s, Avg
generation throughput: … tokens/s, Running: N reqs, Waiting: N reqs, CPU KV cache usage: …%, Prefix cache
hit rate: …%", so the scripts and habits of people who watch vLLM's log work here. Like vLLM, an idle
server logs one zero line and then stays quiet until work comes. kvscope swaps: with --preemption-mode swap
the line also counts swapped requests. The hit rate is over the server's lifetime (vLLM's is over recent
requests). Both sentences are the window's too, written once: engine/runner.py's kv_cache_sentence and
app/status_sentence.py.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

from kvscope.app.status_sentence import status_sentence

FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"
STATUS_INTERVAL_S = 10.0

log = logging.getLogger("kvscope.serve")


def configure_logging(stream=None) -> None:
    """vLLM's format on kvscope's serve logger (once)."""
    if log.handlers:
        return
    handler = logging.StreamHandler(stream or sys.stdout)
    handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


class StatusLine:
    """Computes the 10-second line from the serve metrics' running totals and latest step."""

    def __init__(self, metrics, device: str, show_swapped: bool) -> None:
        self.metrics = metrics
        self.device = device
        self.show_swapped = show_swapped
        self._last_time = time.monotonic()
        self._last_totals = dict(metrics.totals)
        self._last_busy = True      # the first line is logged even when idle, as vLLM's first is

    def line(self, now: float | None = None) -> str | None:
        """The line for the interval that ends now, or None when it and the one before were idle."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self._last_time, 1e-9)
        totals = dict(self.metrics.totals)
        prompt = (totals["prompt_tokens"] - self._last_totals["prompt_tokens"]) / elapsed
        generation = (totals["generation_tokens"] - self._last_totals["generation_tokens"]) / elapsed
        self._last_time, self._last_totals = now, totals
        busy = bool(prompt or generation)
        if not busy and not self._last_busy:
            return None
        self._last_busy = busy
        stats = self.metrics.latest
        running, waiting, swapped = (stats.num_running, stats.num_waiting, stats.num_swapped) if stats else (0, 0, 0)
        usage = stats.kv_usage if stats else 0.0
        hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats and stats.prefix_cache_queries \
            else 0.0
        return "Engine 000: " + status_sentence(prompt, generation, running, waiting,
                                                swapped if self.show_swapped else None, self.device, usage, hit_rate)


class StatusLogger:
    """Logs the status line every ``interval_s`` seconds from its own thread."""

    def __init__(self, status: StatusLine, interval_s: float = STATUS_INTERVAL_S) -> None:
        self.status = status
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvscope-serve-status", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            line = self.status.line()
            if line is not None:
                log.info(line)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
