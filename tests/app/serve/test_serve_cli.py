"""`kvscope serve` as a user runs it: a real process on the default model, vLLM's startup lines, Ctrl+C while a
request streams (it ends with finish_reason "abort", the run log is closed), and refusals before the model loads."""

from __future__ import annotations

import json
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time

import httpx
import pytest

STARTED = re.compile(r"Starting kvscope server on (http://127\.0\.0\.1:\d+)")
KV_CACHE_LINE = re.compile(r"^INFO \d\d-\d\d \d\d:\d\d:\d\d \[[a-z_]+\.py:\d+\] CPU KV cache size: 4,096 tokens, "
                           r"Maximum concurrency for 8,192 tokens per request: 0\.50x$")


def serve(tmp_path, *flags: str) -> subprocess.Popen:
    # cwd outside the checkout: the checkout's own folders would shadow installed packages
    return subprocess.Popen([sys.executable, "-m", "kvscope.app.cli", "serve", *flags], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def read_until(process: subprocess.Popen, pattern: re.Pattern, lines: list[str], timeout_s: float = 120.0):
    """Lines of the process's output until one matches (collected in ``lines``); the match."""
    found = {}

    def reader() -> None:
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            if "match" not in found and (match := pattern.search(line)):
                found["match"] = match

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while "match" not in found:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError("kvscope serve did not start:\n" + "\n".join(lines))
        time.sleep(0.05)
    return found["match"], thread


def reap(process: subprocess.Popen) -> None:
    """Whatever the test saw, leave no server behind."""
    if process.poll() is None:
        process.kill()
        process.wait()
    process.stdout.close()


def test_ctrl_c_aborts_the_streaming_request_and_closes_the_run_log(tmp_path):
    db = tmp_path / "runs.db"
    process = serve(tmp_path, "--port", "0", "--num-blocks", "256", "--db", str(db))
    lines: list[str] = []
    try:
        match, reader = read_until(process, STARTED, lines)
        url = match.group(1)
        assert any(KV_CACHE_LINE.match(line) for line in lines), lines
        body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Count to 500."}],
                "max_tokens": 2000, "stream": True, "ignore_eos": True}
        chunks = []
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line.removeprefix("data: "))
                    if len(chunks) == 3:
                        process.send_signal(signal.SIGINT)
        assert process.wait(60) in (0, 130)
        reader.join(10)
    finally:
        reap(process)
    assert chunks[-1] == "[DONE]"
    last = json.loads(chunks[-2])
    assert last["choices"][0]["finish_reason"] == "abort"
    with sqlite3.connect(db) as conn:
        run = conn.execute("SELECT status, source, ended_at FROM runs").fetchone()
        requests = conn.execute("SELECT finish_reason, num_output_tokens, request_id FROM requests").fetchall()
    assert run[0] == "finished" and run[1] == "serve" and run[2]
    (request,) = requests
    assert request[0] == "abort" and 2 <= request[1] < 2000
    assert request[2] == "http-1"     # where it came from, as the window and `kvscope runs` show it


def test_a_taken_port_is_one_line_before_the_model_loads(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "kvscope.app.cli", "serve", "--port", str(port), "--no-log"],
                                cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f"kvscope serve: error: cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "loading" not in result.stderr


def test_a_bad_kv_events_config_is_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "kvscope.app.cli", "serve", "--no-log", "--kv-events-config",
                             '{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}'],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "kvscope serve: error: --kv-events-config" in result.stderr and "endpont" in result.stderr


def test_loopback_is_the_default_and_another_address_is_said_to_be_reachable(caplog):
    from serve_helpers import tiny_engine

    from kvscope.app.serve.server import ServeApp, ServeOptions, is_loopback, listen

    assert ServeOptions().host == "127.0.0.1"
    assert all(is_loopback(host) for host in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"))
    assert not any(is_loopback(host) for host in ("0.0.0.0", "::", "192.168.1.4", "example.org"))
    # The listener stays on loopback here; only the words about --host are under test.
    server = ServeApp(tiny_engine(), ServeOptions(host="0.0.0.0", port=0), listener=listen("127.0.0.1", 0))
    try:
        with caplog.at_level("INFO", logger="kvscope.serve"):
            server._startup_lines()
    finally:
        server.close()
    warning = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning and "reachable from the network" in warning[0] and "--host 0.0.0.0" in warning[0]
    assert "set --api-key" in warning[0]


def test_serve_addresses_read_as_host_and_port():
    from kvscope.app.serve.cli import parse_address

    assert parse_address("8000") == ("127.0.0.1", 8000)
    assert parse_address("0.0.0.0:8001") == ("0.0.0.0", 8001)
    assert parse_address("[::1]:8002") == ("::1", 8002)
    for bad in ("", "http", ":8000", "host:", "127.0.0.1:99999"):
        with pytest.raises(Exception, match="HOST:"):
            parse_address(bad)


def test_sigterm_is_a_clean_stop_with_status_0_and_a_small_pool_is_warned_about_at_start(tmp_path):
    process = serve(tmp_path, "--port", "0", "--num-blocks", "256", "--no-log")
    lines: list[str] = []
    try:
        _, reader = read_until(process, STARTED, lines)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0        # not 130, Ctrl+C's: a service manager records a clean stop
        reader.join(10)
    finally:
        reap(process)
    assert any("WARNING" in line and "--max-model-len 4,096" in line for line in lines), lines


def test_the_server_freezes_what_start_up_built_out_of_the_collectors_walks(monkeypatch):
    import gc

    from serve_helpers import tiny_engine

    from kvscope.app.serve.server import ServeApp, ServeOptions, listen

    server = ServeApp(tiny_engine(), ServeOptions(port=0), listener=listen("127.0.0.1", 0))
    frozen_when_serving = []
    monkeypatch.setattr(server.server, "run", lambda sockets: frozen_when_serving.append(gc.get_freeze_count()))
    gc.unfreeze()
    try:
        server.serve_forever()
    finally:
        gc.unfreeze()
    assert frozen_when_serving and frozen_when_serving[0] > 10_000
