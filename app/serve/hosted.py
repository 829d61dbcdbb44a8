"""kvscope serve hosted by a program that builds and steps the engine itself: the window (`kvscope --serve PORT`).

The host calls ``engine_installed`` from its engine thread with every engine it installs: the first starts the
server in front of it, a later one (a rebuild with new cache settings) takes its place behind the same port
and the same KV-event publisher (ServeApp.replace_engine). ``wake`` is how the server tells the host's engine
thread that it has engine calls (new requests, aborts); the host runs them with ``run_pending()`` between
steps, on its engine thread, then steps as usual. The socket and the publisher are made when the host is
made, before the model loads, so a taken port is one clear error before any window opens.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from kvscope.app.serve.server import ServeApp, ServeOptions, listen, start_publisher

REBUILT = "the window rebuilt its engine with new settings"


class HostedServe:
    def __init__(self, options: ServeOptions) -> None:
        self.options = dataclasses.replace(options, terminal_logs=False)   # the window is the terminal
        self.wake: Callable[[], None] | None = None     # set by the host before its first engine is installed
        self.listener = listen(options.host, options.port)
        try:
            self.publisher = start_publisher(options.kv_events)
        except Exception:
            self.listener.close()
            raise
        self.server: ServeApp | None = None
        self._lock = threading.Lock()
        self._closed = False

    def engine_installed(self, engine) -> None:
        with self._lock:
            if self.server is None:
                self.server = ServeApp(engine, self.options, own_engine_loop=False, listener=self.listener,
                                       publisher=self.publisher, on_call=self._wake)
                self.server.start_in_thread()
            else:
                self.server.replace_engine(engine, REBUILT)

    def run_pending(self) -> None:
        """The host's engine thread, between steps: add and abort what the server asked for."""
        server = self.server
        if server is not None:
            server.bridge.run_pending()

    def _wake(self) -> None:
        if self.wake is not None:
            self.wake()

    def network_warning(self) -> str | None:
        """Who beyond this machine can reach the API or its KV events, in words; None when nobody can."""
        warnings = self.server.warnings() if self.server is not None else []
        return ". ".join(warnings) or None

    @property
    def url(self) -> str | None:
        return self.server.url if self.server is not None else None

    def close(self) -> None:
        """Stop serving: requests in flight are aborted (the host's next steps report them, so every stream
        ends with "abort"). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.server is not None:
                self.server.stop()
            else:
                self.listener.close()
                if self.publisher is not None:
                    self.publisher.close()
