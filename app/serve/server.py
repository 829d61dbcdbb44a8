"""Everything `kvscope serve` runs around one engine, started and stopped as one.

ServeApp wires the bridge, the metrics, the KV-event publisher and the status line to the engine (each an
engine observer), builds the ASGI app, and runs it on uvicorn: in the main thread for `kvscope serve`, where
Ctrl+C is handled, or in a background thread for tests and for the window (``start_in_thread``).

Stopping is the same either way: new requests are refused, every request in flight is aborted (its client
gets finish_reason "abort"), uvicorn waits for those responses to end, then the engine loop, the status
line and the publisher stop, in that order, so nothing is left half done.
"""

from __future__ import annotations

import gc
import logging
import socket
import threading
import time
from dataclasses import dataclass

import uvicorn
import zmq

from kvscope import __version__
from kvscope.app.serve import kv_events
from kvscope.app.serve.bridge import EngineBridge, EngineLoop
from kvscope.app.serve.connections import DeadlineProtocol, connection_limit, is_loopback, rate_limit_accept_errors
from kvscope.app.serve.generation import EngineFacts
from kvscope.app.serve.kv_events import KVEventPublisher, KVEventsConfig
from kvscope.app.serve.limits import (
    BODY_READ_DEADLINE_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    DEFAULT_WRITE_STALL_S,
    PROMPT_BUDGET_POOLS,
    ConcurrencyLimit,
    PromptTokenBudget,
)
from kvscope.app.serve.metrics import ServeMetrics
from kvscope.app.serve.routes import ServeState, build_app
from kvscope.app.serve.status_log import STATUS_INTERVAL_S, StatusLine, StatusLogger
from kvscope.engine.runner import capacity_sentence, pool_capacity, pool_warning

log = logging.getLogger("kvscope.serve")
GRACEFUL_SHUTDOWN_S = 30.0
STARTUP_TIMEOUT_S = 30.0


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    kv_events: KVEventsConfig | None = None     # None: the default loopback-only (ipc) publisher
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    max_connections: int = 2 * DEFAULT_MAX_CONCURRENT_REQUESTS     # open HTTP connections; more get 503
    write_stall_s: float = DEFAULT_WRITE_STALL_S
    body_read_deadline_s: float = BODY_READ_DEADLINE_S
    access_log: bool = True
    status_interval_s: float = STATUS_INTERVAL_S
    model_root: str | None = None               # what /v1/models says the model was loaded from
    dev_routes: bool = False                    # POST /reset_prefix_cache
    terminal_logs: bool = True                  # uvicorn's and vLLM's lines; off under a window, which shows it all


class ServeError(Exception):
    """The server cannot start; the message is the one line the user sees."""


def listen(host: str, port: int) -> socket.socket:
    """The API's listening socket, bound now so a taken port is one clear error before the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host.strip("[]"), port), family=family, backlog=2048)
    except OSError as exc:
        reason = exc.strerror or exc
        raise ServeError(f"cannot listen on {host}:{port}: {reason}; choose another --port or --host") from None


def start_publisher(config: KVEventsConfig | None) -> KVEventPublisher | None:
    """The KV-event publisher for ``config`` (None: the default loopback-only one), or None when events are off."""
    config = config if config is not None else kv_events.default_config()
    if not config.active:
        return None
    try:
        return KVEventPublisher(config)
    except zmq.ZMQError as exc:
        raise ServeError(f"KV-cache events: {exc}; change --kv-events-config") from None


class _Uvicorn(uvicorn.Server):
    """uvicorn, telling the server first when a signal asks it to exit (the requests in flight are aborted,
    so their responses end and uvicorn's graceful wait ends with them)."""

    def __init__(self, config: uvicorn.Config, on_exit, on_started) -> None:
        super().__init__(config)
        self.on_exit = on_exit
        self.on_started = on_started

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_started()

    def handle_exit(self, sig, frame) -> None:
        self.on_exit()
        super().handle_exit(sig, frame)


class ServeApp:
    def __init__(self, engine, options: ServeOptions, *, own_engine_loop: bool = True,
                 listener: socket.socket | None = None, publisher: KVEventPublisher | None = None,
                 on_call=None) -> None:
        """``listener`` and ``publisher``, when given, were made before the model loaded (see listen()).
        Without ``own_engine_loop`` another thread steps the engine (the window's worker); ``on_call`` then
        tells it that the server has engine calls (new requests, aborts) for it to run between steps, with
        ``self.bridge.run_pending()``."""
        self.options = options
        self.on_call = on_call
        self.listener = listener or listen(options.host, options.port)
        self.publisher = publisher if publisher is not None else start_publisher(options.kv_events)
        self._detachers: list = []
        self._bind(engine)
        self.state = ServeState(self.bridge, self.facts, ConcurrencyLimit(options.max_concurrent_requests),
                                self.metrics, kv_events.sources(self.publisher.config if self.publisher else None),
                                self._prompt_budget(), options.api_key, options.dev_routes)
        self.app = build_app(self.state, options.max_body_bytes, options.body_read_deadline_s)
        self.engine_loop = EngineLoop(engine, self.bridge) if own_engine_loop else None
        self.status = StatusLogger(self._status_line(), options.status_interval_s)
        quiet = {} if options.terminal_logs else {"log_config": None}
        rate_limit_accept_errors()
        config = uvicorn.Config(self.app, host=options.host, port=options.port, lifespan="off",
                                access_log=options.access_log and options.terminal_logs,
                                http=DeadlineProtocol.for_server(options.write_stall_s),
                                limit_concurrency=connection_limit(options.max_connections),
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, **quiet)
        self.server = _Uvicorn(config, on_exit=lambda: self.bridge.abort_all(), on_started=self._startup_lines)
        self._thread: threading.Thread | None = None
        self._closed = False

    def _bind(self, engine) -> None:
        """Everything that belongs to one engine: its facts, its bridge, its metrics, the observers."""
        self.engine = engine
        info, options = engine.info, self.options
        self.facts = EngineFacts(options.served_model_name or info.model_name,
                                 options.model_root or engine.config.model, info, engine.tokenizer)
        self.bridge = EngineBridge(engine, on_call=self.on_call)
        self.metrics = ServeMetrics(self.facts.model_name, info.max_model_len, self._cache_config())
        self._detachers = [engine.add_observer(observer)
                           for observer in [self.metrics] + ([self.publisher] if self.publisher else [])]

    def _prompt_budget(self) -> PromptTokenBudget:
        info = self.engine.info
        return PromptTokenBudget(PROMPT_BUDGET_POOLS * info.num_device_blocks * info.block_size)

    def _status_line(self) -> StatusLine:
        return StatusLine(self.metrics, self.engine.info.device, self.engine.config.preemption_mode == "swap")

    def replace_engine(self, engine, reason: str) -> None:
        """The host (the window) replaced its engine: requests in flight on the old one end with a 503 saying
        ``reason``, subscribers hear AllBlocksCleared (the new pool is empty), and the API, the metrics and
        the events go on from the new engine. Only for a server without its own engine loop."""
        if self.engine_loop is not None:
            raise RuntimeError("replace_engine is for a server whose engine another thread steps")
        old_bridge = self.bridge
        self._detach()
        old_bridge.close_streams(reason)
        old_bridge.close()
        self._bind(engine)
        self.state.bridge, self.state.facts, self.state.metrics = self.bridge, self.facts, self.metrics
        self.state.prompt_tokens = self._prompt_budget()
        self.status.status = self._status_line()
        if self.publisher is not None:
            self.publisher.publish_cleared()

    def _detach(self) -> None:
        for detach in self._detachers:
            detach()

    def _cache_config(self) -> dict[str, str]:
        """vllm:cache_config_info's labels: vLLM's names, kvscope's values (num_cpu_blocks is the swap pool)."""
        info, config = self.engine.info, self.engine.config
        tokens, concurrency = pool_capacity(info)
        return {"block_size": str(info.block_size), "num_gpu_blocks": str(info.num_device_blocks),
                "num_cpu_blocks": str(info.num_host_blocks or None), "cache_dtype": "auto",
                "enable_prefix_caching": str(config.enable_prefix_caching and config.allocator == "paged"),
                "gpu_memory_utilization": str(config.gpu_memory_utilization),
                "kv_cache_memory_bytes": str(info.kv_cache_bytes), "kv_cache_size_tokens": str(tokens),
                "kv_cache_max_concurrency": f"{concurrency:.1f}",
                "prefix_caching_hash_algo": "builtin", "sliding_window": "None"}

    @property
    def port(self) -> int:
        """The port bound (the one asked for, or the one the system chose for port 0)."""
        return self.listener.getsockname()[1]

    @property
    def url(self) -> str:
        host = self.options.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def network_warning(self) -> str | None:
        """What a non-loopback --host means, in words; None on loopback."""
        if is_loopback(self.options.host):
            return None
        return (f"The API is reachable from the network at {self.url} (--host {self.options.host})"
                + ("" if self.options.api_key else "; anyone who reaches it can use the model: set --api-key"))

    def warnings(self) -> list[str]:
        """What the user should know about who can reach this server: the API's address, the KV events'."""
        config = self.publisher.config if self.publisher is not None else None
        found = [self.network_warning(), kv_events.exposure_warning(config) if config else None]
        return [warning for warning in found if warning]

    def _startup_lines(self) -> None:
        if not self.options.terminal_logs:
            return
        info = self.engine.info
        log.info("kvscope serve %s · model %s (%s, %s)", __version__, self.facts.model_name, info.device, info.dtype)
        log.info(capacity_sentence(info))
        if self.publisher is not None:
            config = self.publisher.config
            log.info("KV-cache events: ZMQ on %s, replay on %s, topic %r", config.endpoint,
                     config.replay_endpoint or "none", config.topic)
        log.info("Starting kvscope server on %s (OpenAI-compatible API, vLLM's /metrics)", self.url)
        for warning in self.warnings() + ([pool_warning(info)] if pool_warning(info) else []):
            log.warning(warning)

    # --- running ------------------------------------------------------------------------------------------

    def _start_engine_side(self) -> None:
        if self.engine_loop is not None:
            self.engine_loop.start()
        if self.options.terminal_logs:
            self.status.start()

    def serve_forever(self) -> None:
        """Run in the main thread until Ctrl+C (or SIGTERM); in-flight requests end with "abort"."""
        # Everything built so far (the model, the engine, every imported module's objects) lives as long as the
        # server: frozen out of the cyclic collector's reach, as vLLM's server does after start-up, a full
        # collection set off by requests' garbage walks only what came since, not the whole heap under the GIL.
        gc.collect()
        gc.freeze()
        self._start_engine_side()
        try:
            self.server.run(sockets=[self.listener])
        finally:
            self.close()

    def start_in_thread(self) -> None:
        """Run uvicorn in a background thread; returns once it listens (RuntimeError if it cannot)."""
        self._start_engine_side()
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.listener]},
                                        name="kvscope-serve-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"kvscope serve could not start on {self.options.host}:{self.options.port}")
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop a server started with start_in_thread, as Ctrl+C stops one in the main thread."""
        self.bridge.abort_all()
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join()
        self.close()

    def close(self) -> None:
        """Abort what is left, let the engine report it, then stop every part. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.bridge.abort_all()
        if self.engine_loop is not None:
            self.engine_loop.wait_idle(GRACEFUL_SHUTDOWN_S)
            self.engine_loop.stop()
        self.status.stop()
        self.bridge.close()
        self._detach()
        if self.publisher is not None:
            self.publisher.close()
        self.listener.close()
