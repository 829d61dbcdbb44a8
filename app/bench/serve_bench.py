"""`kvscope bench serve`: the same client at the same request rates against `kvscope serve` and vLLM's server, one
after the other on the same cores, with request throughput, output tok/s, TTFT and ITL p50/p99 and the ratios.

Beside the client's view, each server's own: both export vLLM's request-time histograms on ``/metrics``, so a
scrape before and after each rate's run gives the server's mean time to first token and how much of it the request
waited in the engine's queue and spent from its first scheduling to its first token (the prefill). A TTFT gap
between the two servers is then placed: in the front end, in the wait for the step in progress, or in the prefill.

The client is vLLM's own `vllm bench serve` (random dataset, EOS ignored, greedy) when a vLLM venv is there,
else kvscope's OpenAI-client load generator (serve_load.py), which measures the same quantities the same way;
the table says which. Each server is a fresh process started outside the checkout, with the same model,
dtype, max_model_len, block size and KV-cache memory, and is stopped before the next one starts. vLLM gets
every core (``VLLM_CPU_OMP_THREADS_BIND`` over all of them, none reserved), as kvscope's torch does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvscope.app.attach.feed.metrics import MetricsSample, parse_metrics
from kvscope.app.bench.serve_load import LoadResult, random_prompts, run_load

SERVED_NAME = "bench"
START_TIMEOUT_S = 900       # vLLM's first start compiles the model
# `vllm bench serve`, run as vLLM's CLI runs it. The CPU build's distribution is named vllm-cpu, and the CLI
# asks for the version of "vllm" before it does anything, so the lookup falls back to the real name.
VLLM_CLI = (
    "import importlib.metadata as metadata, runpy, sys\n"
    "version = metadata.version\n"
    "def lookup(name):\n"
    "    try:\n"
    "        return version(name)\n"
    "    except metadata.PackageNotFoundError:\n"
    "        return version('vllm-cpu') if name == 'vllm' else version(name)\n"
    "metadata.version = lookup\n"
    "sys.argv = ['vllm', *sys.argv[1:]]\n"
    "runpy.run_module('vllm.entrypoints.cli.main', run_name='__main__', alter_sys=True)\n")


@dataclass(frozen=True)
class ServeBenchSettings:
    model_dir: str
    dtype: str = "bfloat16"
    rates: tuple[float, ...] = (1.0, 4.0)
    num_prompts: int = 32
    input_len: int = 256
    output_len: int = 64
    max_model_len: int = 1024
    block_size: int = 32             # vLLM's CPU attention takes multiples of 32 only
    kv_cache_gib: int = 1
    systems: tuple[str, ...] = ("kvscope", "vllm")
    vllm_python: str | None = None
    client: str = "auto"            # auto | vllm | openai
    seed: int = 0

    def client_for(self) -> str:
        if self.client != "auto":
            return self.client
        return "vllm" if self.vllm_python else "openai"


@dataclass(frozen=True)
class ServerTimes:
    """Means over one run's requests, in ms, from the server's own histograms; None where it exports none."""

    ttft_ms: float | None
    queue_ms: float | None
    prefill_ms: float | None

    @classmethod
    def between(cls, before: MetricsSample, after: MetricsSample) -> ServerTimes | None:
        """The requests between two scrapes of one server (the attach feed's parse of its page)."""
        if not before.engines or not after.engines:
            return None
        earlier, later = before.totals(), after.totals()

        def mean_ms(key: str) -> float | None:
            histogram = later.histogram(key)
            recent = histogram.minus(earlier.histogram(key)) if histogram is not None else None
            return recent.sum / recent.count * 1e3 if recent is not None and recent.count > 0 else None

        return cls(mean_ms("ttft"), mean_ms("queue"), mean_ms("prefill"))


def scrape(url: str) -> MetricsSample | None:
    """The server's /metrics page, parsed as `kvscope attach` parses it; None when it cannot be had or read (the
    client's figures then stand without the split)."""
    try:
        response = httpx.get(f"{url}/metrics", timeout=30)
        response.raise_for_status()
        return parse_metrics(response.text, time.time())
    except (httpx.HTTPError, ValueError):
        return None


@dataclass(frozen=True)
class Row:
    system: str
    client: str
    rate: float
    completed: int
    failed: int
    request_throughput: float
    output_throughput: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    ttft_mean_ms: float | None = None
    server: ServerTimes | None = None


# ---- servers ----------------------------------------------------------------------------------------------

def kvscope_server(settings: ServeBenchSettings, port: int) -> tuple[list[str], dict]:
    return ([sys.executable, "-m", "kvscope.app.cli", "serve", "--model", settings.model_dir, "--port", str(port),
             "--served-model-name", SERVED_NAME, "--dtype", settings.dtype, "--max-model-len",
             str(settings.max_model_len), "--block-size", str(settings.block_size), "--kv-cache-memory",
             f"{settings.kv_cache_gib}GiB", "--no-log", "--disable-uvicorn-access-log"], dict(os.environ))


def vllm_server(settings: ServeBenchSettings, port: int) -> tuple[list[str], dict]:
    cores = f"0-{os.cpu_count() - 1}" if (os.cpu_count() or 1) > 1 else "0"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": str(settings.kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": cores,
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    return ([settings.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", settings.model_dir,
             "--served-model-name", SERVED_NAME, "--dtype", settings.dtype, "--max-model-len",
             str(settings.max_model_len), "--block-size", str(settings.block_size), "--enable-prefix-caching",
             "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"], env)


class ServerProcess:
    """A server started in its own process group, outside the checkout; stopped (Ctrl+C, then kill) on exit."""

    def __init__(self, command: list[str], env: dict, port: int, log_path: Path) -> None:
        self.command, self.env, self.log_path = command, env, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            cwd=tempfile.gettempdir(), start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                tail = self.log_path.read_text(errors="replace").splitlines()[-15:]
                raise RuntimeError(f"{self.command[2]} did not start; the end of its log:\n" + "\n".join(tail))
            time.sleep(1.0)
        return self

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def __exit__(self, *exc) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGINT)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ---- clients ----------------------------------------------------------------------------------------------

def openai_client_row(system: str, url: str, settings: ServeBenchSettings, rate: float, vocab_size: int) -> Row:
    prompts = random_prompts(settings.num_prompts, settings.input_len, vocab_size, settings.seed)
    result = asyncio.run(run_load(f"{url}/v1", SERVED_NAME, prompts, settings.output_len, rate, settings.seed))
    return _row(system, "openai", result)


def _row(system: str, client: str, result: LoadResult) -> Row:
    return Row(system, client, result.rate, result.completed, result.failed, result.request_throughput,
               result.output_throughput, result.percentile_ms("ttft", 50), result.percentile_ms("ttft", 99),
               result.percentile_ms("itl", 50), result.percentile_ms("itl", 99), result.mean_ms("ttft"))


def vllm_client_row(system: str, url: str, settings: ServeBenchSettings, rate: float, scratch: Path) -> Row:
    """One `vllm bench serve` run; its saved JSON result becomes a row."""
    name = f"{system}-{rate}.json"
    command = [settings.vllm_python, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai", "--base-url", url,
               "--endpoint", "/v1/completions", "--model", SERVED_NAME, "--tokenizer", settings.model_dir,
               "--dataset-name", "random", "--random-input-len", str(settings.input_len), "--random-output-len",
               str(settings.output_len), "--num-prompts", str(settings.num_prompts), "--request-rate", str(rate),
               "--ignore-eos", "--temperature", "0", "--seed", str(settings.seed), "--percentile-metrics",
               "ttft,itl", "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(scratch),
               "--result-filename", name, "--disable-tqdm"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(command, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed against {system}:\n{done.stderr[-3000:]}")
    data = json.loads((scratch / name).read_text())
    return Row(system, "vllm bench serve", rate, data["completed"], data.get("failed", 0),
               data["request_throughput"], data["output_throughput"], data.get("p50_ttft_ms"),
               data.get("p99_ttft_ms"), data.get("p50_itl_ms"), data.get("p99_itl_ms"), data.get("mean_ttft_ms"))


# ---- the run ----------------------------------------------------------------------------------------------

def run_serve_bench(settings: ServeBenchSettings, vocab_size: int, progress=print) -> tuple[list[Row], list[str]]:
    """The rows measured, and notes on what could not be (a server that did not start, and where its log is)."""
    client = settings.client_for()
    if client == "vllm" and not settings.vllm_python:
        raise RuntimeError("--client vllm needs a vLLM venv (--vllm-python, or .venv-vllm)")
    rows, notes = [], []
    logs = Path(tempfile.mkdtemp(prefix="kvscope-bench-serve-"))     # kept: the servers' logs are evidence
    for system in settings.systems:
        port = free_port()
        command, env = (kvscope_server if system == "kvscope" else vllm_server)(settings, port)
        log_path = logs / f"{system}.log"
        progress(f"starting {system} on port {port} (log: {log_path}) …")
        try:
            with ServerProcess(command, env, port, log_path) as server:
                for rate in settings.rates:
                    progress(f"  {system}: {settings.num_prompts} requests at {_rate(rate)} req/s ({client} client)")
                    before = scrape(server.url)
                    row = (vllm_client_row(system, server.url, settings, rate, logs) if client == "vllm"
                           else openai_client_row(system, server.url, settings, rate, vocab_size))
                    after = scrape(server.url)
                    split = ServerTimes.between(before, after) if before and after else None
                    rows.append(dataclasses.replace(row, server=split))
        except RuntimeError as exc:
            notes.append(f"{system}: {exc}".splitlines()[0] + f" (its log: {log_path})")
            progress(str(exc))
    return rows, notes


def _rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def format_table(rows: list[Row], settings: ServeBenchSettings, notes: list[str] = ()) -> str:
    head = (f"kvscope bench serve: {settings.num_prompts} requests per rate, random prompts of "
            f"{settings.input_len} tokens, {settings.output_len} output tokens (EOS ignored, greedy), "
            f"{settings.dtype}, max_model_len {settings.max_model_len}, block size {settings.block_size}, "
            f"{settings.kv_cache_gib} GiB KV cache; client: {rows[0].client if rows else '-'}")
    lines = [head, "", f"{'system':<8} {'rate':>5} {'ok':>4} {'fail':>4} {'req/s':>7} {'out tok/s':>9} "
                       f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}  (ms)"]
    for row in rows:
        lines.append(f"{row.system:<8} {_rate(row.rate):>5} {row.completed:>4} {row.failed:>4} "
                     f"{row.request_throughput:>7.2f} {row.output_throughput:>9.1f} {_ms(row.ttft_p50_ms):>9} "
                     f"{_ms(row.ttft_p99_ms):>9} {_ms(row.itl_p50_ms):>8} {_ms(row.itl_p99_ms):>8}")
    lines += _server_times_table(rows)
    ratios = _ratios(rows)
    if ratios:
        lines += ["", "kvscope / vLLM (throughput: above 1 is better; TTFT: below 1 is better)"]
        lines += ratios
    lines += [f"not measured: {note}" for note in notes]
    return "\n".join(lines)


def _server_times_table(rows: list[Row]) -> list[str]:
    timed = [row for row in rows if row.server is not None]
    if not timed:
        return []
    lines = ["", "TTFT means (ms): the client's, the server's own, and the server's split of it (its queue, then "
                 "first scheduling to first token).", "vLLM's queue starts in its engine core, after the hop from "
                 "its front end: its wait for the step in progress is server less queue and prefill.",
             f"{'system':<8} {'rate':>5} {'client':>8} {'server':>8} {'queue':>8} {'prefill':>8}"]
    for row in timed:
        lines.append(f"{row.system:<8} {_rate(row.rate):>5} {_ms(row.ttft_mean_ms):>8} {_ms(row.server.ttft_ms):>8} "
                     f"{_ms(row.server.queue_ms):>8} {_ms(row.server.prefill_ms):>8}")
    return lines


def _ratios(rows: list[Row]) -> list[str]:
    by = {(row.system, row.rate): row for row in rows}
    lines = []
    for rate in dict.fromkeys(row.rate for row in rows):
        ours, theirs = by.get(("kvscope", rate)), by.get(("vllm", rate))
        if ours is None or theirs is None:
            continue
        parts = [f"rate {_rate(rate)}:",
                 f"output tok/s {_ratio(ours.output_throughput, theirs.output_throughput)}",
                 f"req/s {_ratio(ours.request_throughput, theirs.request_throughput)}",
                 f"TTFT p50 {_ratio(ours.ttft_p50_ms, theirs.ttft_p50_ms)}",
                 f"ITL p50 {_ratio(ours.itl_p50_ms, theirs.itl_p50_ms)}"]
        lines.append("  " + "  ".join(parts))
    return lines


def _ratio(ours: float | None, theirs: float | None) -> str:
    return "-" if not ours or not theirs else f"{ours / theirs:.2f}x"
