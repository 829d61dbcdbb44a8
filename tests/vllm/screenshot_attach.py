"""screenshots/attach.svg: the attached window over a real vLLM CPU server under load (`make screenshots`).

    KVSCOPE_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python tests/vllm/screenshot_attach.py [OUT.svg]

Starts the server of tests/vllm/server.py, attaches exactly as `kvscope attach URL` does (probe, data
source thread, the model's tokenizer for prefix text), sends the load of load.py, and saves the window
once the overload has requests waiting and the pool is busy.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))

import load  # noqa: E402 - the sibling module, found through the path set above
from server import VllmServer  # noqa: E402

from kvscope.app.attach.feed.server import make_client, probe_server  # noqa: E402
from kvscope.app.attach.feed.source import IDLE_WAKE_S, AttachSource  # noqa: E402
from kvscope.app.attach.feed.tokens import load_preview_text  # noqa: E402
from kvscope.app.attach.window.app import AttachApp  # noqa: E402
from kvscope.engine.model.loader import fetch_default_model  # noqa: E402

SIZE = (160, 48)
TIMEOUT_S = 300


def busy(app: AttachApp) -> bool:
    frame = app.view.latest
    if frame is None or not frame.queue_history:
        return False
    now = frame.queue_history[-1]
    return now.num_waiting > 0 and now.num_running > 1 and frame.pools[0].num_known_blocks > 40


def send_load(client) -> None:
    try:
        load.shared_phase(client)
        load.overload_phase(client)
    except openai.APIConnectionError:
        pass    # the server is stopped as soon as the screenshot is saved, mid-load


async def shoot(app: AttachApp, out: Path, client_url: str) -> None:
    async with app.run_test(size=SIZE) as pilot:
        client = load.client_for(client_url)
        threading.Thread(target=send_load, args=(client,), daemon=True).start()
        deadline = time.monotonic() + TIMEOUT_S
        while not busy(app) and time.monotonic() < deadline:
            await pilot.pause(0.2)
        await pilot.pause(1.5)      # a few more frames, so the throughput has a history
        app.view.paint(force=True)
        await pilot.pause()
        out.parent.mkdir(parents=True, exist_ok=True)
        app.save_screenshot(filename=out.name, path=str(out.parent))


def main(out: Path) -> None:
    python = os.environ.get("KVSCOPE_VLLM_PYTHON", ".venv-vllm/bin/python")
    model = str(fetch_default_model())
    log = Path("/tmp") / f"kvscope-screenshot-vllm-{os.getpid()}.log"
    with VllmServer(python, model, log) as server, make_client() as http:
        info, sample = probe_server(http, server.url)
        preview, note = load_preview_text(model)
        source = AttachSource(info, client=http, publish=lambda frame: None, interval_s=0.5,
                              preview_text=preview, preview_note=note)
        app = AttachApp(source, sample)
        asyncio.run(shoot(app, out, server.url))
        source.stop()
        time.sleep(IDLE_WAKE_S * 2)   # the data source thread notices and closes its sockets
    print(f"saved {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "screenshots"
         / "attach.svg")
