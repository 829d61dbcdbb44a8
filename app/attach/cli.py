"""`kvscope attach URL`: find out what the server publishes, then open the window over it.

Everything that can be wrong before the window opens (an unreachable URL, a
page that is not vLLM's, a bad flag) is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from kvscope.app.attach.feed.server import AttachError, make_client, probe_server, user_endpoints
from kvscope.app.safe_text import clean

MIN_INTERVAL_S = 0.1


def register(subparsers) -> None:
    attach = subparsers.add_parser(
        "attach", help="watch a running vLLM server in the kvscope window",
        description="Open the kvscope window over a vLLM server: its pool from KV-cache events, its queues, "
                    "throughput and latencies from /metrics. vLLM serves; kvscope only watches.")
    attach.add_argument("url", help="the server, e.g. http://localhost:8000")
    attach.add_argument("--kv-events", action="append", default=[], metavar="ENDPOINT",
                        help="a KV-event publisher to subscribe to (repeat for data-parallel ranks or several "
                             "servers), e.g. tcp://host:5557; prefix bind: to bind it when vLLM connects. "
                             "Default: what GET /kv_event_sources says")
    attach.add_argument("--replay", action="append", default=[], metavar="ENDPOINT",
                        help="the replay endpoint of each --kv-events, in order (default: discovered)")
    attach.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                        help="seconds between two reads of /metrics (default 1)")
    attach.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="a local model directory (or tokenizer.json) to show prefixes as text "
                             "(default: the directory the server loaded, when it is on this machine)")
    attach.add_argument("--db", default=None, help="run log SQLite file (default: in the user data dir)")
    attach.add_argument("--no-log", action="store_true", help="do not log this session")
    attach.set_defaults(func=run)


def _fail(message: str) -> int:
    # One line whatever the server put in it: it may quote what the server sent.
    print(f"kvscope attach: error: {' '.join(clean(message).split())}", file=sys.stderr)
    return 2


def _with_replays(server, replays: list[str]):
    """--replay without --kv-events overrides the discovered sources' replay endpoints, in order."""
    sources = list(server.event_sources)
    if len(replays) > len(sources):
        raise AttachError(f"{len(replays)} --replay endpoints for {len(sources)} event sources")
    for index, replay in enumerate(replays):
        sources[index] = dataclasses.replace(sources[index], replay=replay)
    return dataclasses.replace(server, event_sources=tuple(sources))


def run(args: argparse.Namespace) -> int:
    try:
        app = prepare(args)
    except AttachError as exc:
        return _fail(str(exc))
    return _open_window(app)


def prepare(args: argparse.Namespace):
    """Everything `kvscope attach` does before its window runs: check the flags, probe the server, build
    the window. AttachError: the one line to print instead."""
    if args.interval < MIN_INTERVAL_S:
        raise AttachError(f"--interval must be at least {MIN_INTERVAL_S} s, got {args.interval}")
    client = make_client()
    try:
        endpoints = user_endpoints(args.kv_events, args.replay) if args.kv_events else ()
        server, sample = probe_server(client, args.url, event_endpoints=endpoints)
        if args.replay and not args.kv_events:
            server = _with_replays(server, args.replay)
    except AttachError:
        client.close()
        raise
    return build_app(args, client, server, sample)


def build_app(args: argparse.Namespace, client, server, sample):
    """The window over ``server``: its data source (run log, tokenizer) ready to start with the app."""
    from kvscope.app.attach.feed.run_log import AttachRunLog
    from kvscope.app.attach.feed.source import AttachSource
    from kvscope.app.attach.feed.tokens import load_preview_text
    from kvscope.app.attach.window.app import AttachApp
    from kvscope.app.messages import RunLogFailed

    preview_text, note = load_preview_text(args.tokenizer, server.model_root)
    # A log that stops writing (a full disk) tells the window, from the log's writer thread, once.
    run_log = AttachRunLog.open(args.db, server, interval_s=args.interval, enabled=not args.no_log,
                                on_failure=lambda warning: app.post_message(RunLogFailed(warning)))
    source = AttachSource(server, client=client, publish=lambda frame: None, interval_s=args.interval,
                          run_log=run_log, preview_text=preview_text, preview_note=note)
    app = AttachApp(source, sample, db_path=args.db, log_warning=run_log.warning)
    return app


def _open_window(app) -> int:
    try:
        app.run()
    finally:
        if not app.source_running:
            app.source.client.close()   # else the process ends with the thread still closing it
    return app.return_code or 0
