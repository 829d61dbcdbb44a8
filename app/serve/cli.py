"""`kvscope serve`: the engine behind an OpenAI-compatible API, vLLM's /metrics and vLLM's KV-cache events.

Everything that can be wrong before serving (a taken port, a bad --kv-events-config, a model that does not
load) is one line on stderr and exit status 2, found before the model loads where it can be. Ctrl+C (or
SIGTERM, which exits 0 as a service manager expects of a clean stop) ends it cleanly: requests in flight end
with finish_reason "abort" and the run log is closed.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from kvscope.app.flags import add_engine_flags, add_log_flags, config_from_args, first_engine
from kvscope.app.serve.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONCURRENT_REQUESTS

API_KEY_ENV = "KVSCOPE_API_KEY"


def register(subparsers) -> None:
    serve = subparsers.add_parser(
        "serve", help="serve the engine over an OpenAI-compatible API, with vLLM's /metrics and KV-cache events",
        description="Serve kvscope's engine to real clients: the OpenAI API (/v1/completions, "
                    "/v1/chat/completions, /v1/models), vLLM's Prometheus metrics (/metrics) and vLLM's KV-cache "
                    "events over ZMQ, so the openai client, curl, `vllm bench serve` and `kvscope attach` work "
                    "against it. Loopback only unless --host says otherwise.")
    add_server_flags(serve)
    add_engine_flags(serve)
    add_log_flags(serve)
    serve.set_defaults(func=run)


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1: this machine only; any other address makes "
                            "the API reachable from the network)")
    group.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000; 0 picks a free one)")
    group.add_argument("--api-key", default=None,
                       help=f"require 'Authorization: Bearer KEY' on every /v1 route (default: ${API_KEY_ENV})")
    group.add_argument("--served-model-name", default=None,
                       help="the model name clients send and /v1/models lists (default: the model's own name)")
    group.add_argument("--kv-events-config", default=None, metavar="JSON",
                       help="vLLM's KV-cache event config, e.g. '{\"enable_kv_cache_events\": true, \"publisher\": "
                            "\"zmq\", \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}' "
                            "(default: published on ipc:// sockets only this machine reaches)")
    group.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       help=f"largest request body accepted (default {DEFAULT_MAX_BODY_BYTES:,})")
    group.add_argument("--max-concurrent-requests", type=int, default=DEFAULT_MAX_CONCURRENT_REQUESTS,
                       help=f"generation requests served at once; more are refused with 503 (default "
                            f"{DEFAULT_MAX_CONCURRENT_REQUESTS})")
    group.add_argument("--disable-uvicorn-access-log", action="store_true", help="no line per HTTP request")
    group.add_argument("--dev-routes", action="store_true",
                       help="POST /reset_prefix_cache (what VLLM_SERVER_DEV_MODE=1 enables on vLLM): drops every "
                            "cached prefix while the engine is idle, and publishes AllBlocksCleared")


def options_from_args(args: argparse.Namespace):
    """ServeOptions from the flags; SystemExit-free: a bad value raises ServeError."""
    from kvscope.app.serve.kv_events import KVEventsConfigError, parse_config
    from kvscope.app.serve.server import ServeError, ServeOptions

    try:
        events = parse_config(args.kv_events_config) if args.kv_events_config is not None else None
    except KVEventsConfigError as exc:
        raise ServeError(str(exc)) from None
    if args.max_request_bytes < 1 or args.max_concurrent_requests < 1:
        raise ServeError("--max-request-bytes and --max-concurrent-requests must be at least 1")
    if not 0 <= args.port <= 65535:
        raise ServeError(f"--port must be between 0 and 65535, got {args.port}")
    return ServeOptions(
        host=args.host, port=args.port, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        served_model_name=args.served_model_name, kv_events=events, max_body_bytes=args.max_request_bytes,
        max_concurrent_requests=args.max_concurrent_requests, access_log=not args.disable_uvicorn_access_log,
        dev_routes=args.dev_routes)


def parse_address(text: str) -> tuple[str, int]:
    """``--serve [HOST:]PORT``: "8000", "0.0.0.0:8000" or "[::1]:8000"; the host defaults to loopback."""
    host, colon, port = text.rpartition(":")
    host = host.strip("[]") if colon else "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) <= 65535 or (colon and not host):
        raise argparse.ArgumentTypeError(f"expected [HOST:]PORT, e.g. 8000 or 127.0.0.1:8000, got {text!r}")
    return host, int(port)


class Terminated(Exception):
    """SIGTERM: a service manager's clean stop, which ends with status 0 (Ctrl+C's KeyboardInterrupt is 130)."""


def _terminate(signum, frame) -> None:
    raise Terminated    # stops the server as Ctrl+C does: uvicorn re-raises the signal here once it has stopped


def run(args: argparse.Namespace) -> int:
    from kvscope.app.runlog import record_run
    from kvscope.app.serve.connections import raise_file_limit
    from kvscope.app.serve.server import ServeApp, ServeError, listen, start_publisher
    from kvscope.app.serve.status_log import configure_logging

    configure_logging()
    try:
        options = options_from_args(args)
        listener = listen(options.host, options.port)
        publisher = start_publisher(options.kv_events)
    except ServeError as exc:
        print(f"kvscope serve: error: {exc}", file=sys.stderr)
        return 2
    engine = first_engine(config_from_args(args))
    if engine is None:
        listener.close()
        if publisher is not None:
            publisher.close()
        return 2
    options.model_root = _model_root(engine)
    signal.signal(signal.SIGTERM, _terminate)
    raise_file_limit()
    try:
        with record_run(engine, source="serve", db_path=args.db, enabled=not args.no_log,
                        on_failure=lambda warning: print(f"kvscope serve: {warning}", file=sys.stderr)) as run_log:
            if run_log.warning:
                print(f"kvscope serve: {run_log.warning}", file=sys.stderr)
            ServeApp(engine, options, listener=listener, publisher=publisher).serve_forever()
    except Terminated:
        pass
    return 0


def _model_root(engine) -> str:
    """Where the weights came from, for /v1/models' root (kvscope attach reads the tokenizer from there)."""
    from kvscope.engine.model.loader import resolve_model_path

    try:
        return resolve_model_path(engine.config.model)
    except Exception:
        return engine.config.model
