"""Record what a real vLLM server publishes, for the tests that run without one (tests/data/vllm/).

    KVSCOPE_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python tests/vllm/record_samples.py [OUT_DIR]

Starts a server (tests/vllm/server.py), subscribes to its KV-cache events and
samples its /metrics page twice a second while it drives the load of
tests/vllm/load.py: the shared-prompt phase, the overload phase (evictions and
preemptions), then ``POST /reset_prefix_cache`` (dev mode: ``AllBlocksCleared``)
and one more request. Then asks for a replay of everything from seq 0, and
stops the server. Writes, into OUT_DIR (default tests/data/vllm/recorded):

    kv-events.frames.jsonl   every live message, as recorded by kvscope.app.attach.feed.recording
    kv-replay.frames.jsonl   the replies to the replay request, end marker included
    metrics-timeseries.txt.gz  at each sample, a "# t=<time>" line, then the lines of the page that
                             carry a series kvscope reads (the whole page is 60 KB)
    metrics.txt              the last page, whole
    phases.json              when each phase began and ended (time.time())
    serve.txt                the server's command line
"""

from __future__ import annotations

import gzip
import json
import os
import shlex
import sys
import threading
import time
from pathlib import Path

import httpx
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))

import load  # noqa: E402 - the sibling module, found through the path set above
from server import VllmServer  # noqa: E402

from kvscope.app.attach.feed import metrics  # noqa: E402
from kvscope.app.attach.feed.recording import write_messages  # noqa: E402
from kvscope.engine.model.loader import fetch_default_model  # noqa: E402

SAMPLE_EVERY_S = 0.5
KEPT_FAMILIES = (*metrics.GAUGES, *metrics.COUNTERS, *metrics.HISTOGRAMS, metrics.WAITING_BY_REASON,
                 metrics.FINISHED_BY_REASON, metrics.CACHE_CONFIG, metrics.PROCESS_START)


def kept_lines(page: str) -> str:
    """The page's lines for the series kvscope reads (their # TYPE lines too), without _created ones."""
    return "".join(line + "\n" for line in page.splitlines()
                   if "_created" not in line and not line.startswith("# HELP")
                   and any(family in line for family in KEPT_FAMILIES))


class Recorder:
    def __init__(self, server: VllmServer) -> None:
        self.server = server
        self.messages: list[list[bytes]] = []
        self.pages: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._threads = [threading.Thread(target=self._subscribe), threading.Thread(target=self._sample)]

    def __enter__(self) -> Recorder:
        for thread in self._threads:
            thread.start()
        time.sleep(1.0)     # let the subscription reach the publisher before any load
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(2 * SAMPLE_EVERY_S)
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self._context.term()

    def _subscribe(self) -> None:
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(f"tcp://127.0.0.1:{self.server.events_port}")
        while not self._stop.is_set():
            if socket.poll(100):
                self.messages.append(socket.recv_multipart())
        socket.close(linger=0)

    def _sample(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                now = time.time()
                self.pages.append((now, client.get(f"{self.server.url}/metrics").text))
                self._stop.wait(max(0.0, SAMPLE_EVERY_S - (time.time() - now)))

    def replay(self) -> list[list[bytes]]:
        context = zmq.Context()
        socket = context.socket(zmq.DEALER)
        socket.connect(f"tcp://127.0.0.1:{self.server.replay_port}")
        socket.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = []
        while socket.poll(5000):
            replies.append(socket.recv_multipart())
            if replies[-1][2] == (-1).to_bytes(8, "big", signed=True):
                break
        socket.close(linger=0)
        context.term()
        return replies


def record(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    python = os.environ.get("KVSCOPE_VLLM_PYTHON", ".venv-vllm/bin/python")
    phases: dict[str, list[float]] = {}
    with VllmServer(python, str(fetch_default_model()), out / "server.log") as server, Recorder(server) as rec:
        client = load.client_for(server.url)
        for name, run in (("shared", lambda: load.shared_phase(client)),
                          ("overload", lambda: load.overload_phase(client)),
                          ("reset", lambda: httpx.post(f"{server.url}/reset_prefix_cache", timeout=30)),
                          ("after_reset", lambda: load.chat(client, load.questions()[7], 16))):
            began = time.time()
            run()
            phases[name] = [began, time.time()]
            time.sleep(1.5)
        replies = rec.replay()
    print(f"{len(rec.messages)} event messages, {len(rec.pages)} metrics pages, {len(replies)} replay replies")
    write_messages(out / "kv-events.frames.jsonl", rec.messages)
    write_messages(out / "kv-replay.frames.jsonl", replies)
    with gzip.open(out / "metrics-timeseries.txt.gz", "wt") as series:
        series.write("".join(f"# t={t:.3f}\n{kept_lines(page)}" for t, page in rec.pages))
    (out / "metrics.txt").write_text(rec.pages[-1][1])
    (out / "phases.json").write_text(json.dumps(phases, indent=1) + "\n")
    (out / "serve.txt").write_text(anonymise(shlex.join(server.command), python) + "\n")
    log = out / "server.log"
    log.write_text(anonymise(log.read_text(errors="replace"), python))


def anonymise(text: str, python: str) -> str:
    """Paths of this machine replaced by the names the README uses."""
    venv = str(Path(python).resolve().parents[1])
    return text.replace(str(fetch_default_model()), "$MODEL_DIR").replace(venv, "$VLLM_VENV")


if __name__ == "__main__":
    record(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "data" / "vllm"
           / "recorded")
