"""Finding out, before the window opens, what the URL is and what it publishes.

``probe_server`` reads ``/metrics`` (the one page every vLLM server has), then
``/version``, ``/v1/models`` and ``/kv_event_sources``, which older or
differently configured servers may lack. An unreachable URL or a page that is
not vLLM's is an ``AttachError`` with one line to print; everything optional
that is missing becomes a fact the window states.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from kvscope.app.attach.feed.metrics import MetricsSample, is_vllm_page, parse_metrics

CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 10.0
EVENTS_FLAG = ("--enable-prefix-caching --kv-events-config "
               "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", "
               "\"replay_endpoint\": \"tcp://*:5558\"}'")


class AttachError(Exception):
    """The attach cannot start; the message is the one line the user sees."""


@dataclass(frozen=True)
class EventEndpoint:
    """One KV-event publisher as kvscope reaches it."""

    endpoint: str               # the address kvscope connects to (or binds, when ``bind``)
    replay: str | None = None   # the publisher's replay (ROUTER) address, always connected to
    topic: str = ""
    rank: int | None = None     # the data-parallel rank the server gave it, when discovered
    bind: bool = False          # vLLM connects to a concrete address: the subscriber must bind it

    @property
    def label(self) -> str:
        return f"{'bind ' if self.bind else ''}{self.endpoint}"


@dataclass(frozen=True)
class ServerInfo:
    url: str
    version: str                # "unknown" when /version is missing
    model: str
    model_root: str | None      # where the server loaded the model from (a local path, or a hub id)
    max_model_len: int | None
    num_gpu_blocks: int         # per engine (data-parallel rank)
    block_size: int
    engines: tuple[str, ...]    # the engine labels /metrics carries, one per data-parallel rank
    prefix_caching: bool
    event_sources: tuple[EventEndpoint, ...]
    events_note: str = ""       # why there are no event sources, and what turns them on
    process_start_time: float | None = None


def normalise_url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


def make_client() -> httpx.Client:
    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    return httpx.Client(timeout=timeout, follow_redirects=True, headers={"user-agent": "kvscope-attach"})


def fetch_metrics(client: httpx.Client, url: str) -> MetricsSample:
    """Read and parse /metrics. Raises httpx errors when the server cannot be reached,
    AttachError when what answers is not a vLLM metrics page."""
    response = client.get(f"{url}/metrics")
    if response.status_code != 200:
        raise AttachError(f"{url} is not a vLLM server: GET /metrics answered HTTP {response.status_code}")
    text = response.text
    if not is_vllm_page(text):
        raise AttachError(f"{url} is not a vLLM server: its /metrics page has no vllm: series")
    try:
        return parse_metrics(text, time.time())
    except ValueError as exc:
        raise AttachError(f"{url} is not a vLLM server: its /metrics page does not parse ({exc})") from None


def _json(client: httpx.Client, url: str):
    try:
        response = client.get(url)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return response.json()
    except ValueError:
        return None


def probe_server(client: httpx.Client, url: str, *, event_endpoints: tuple[EventEndpoint, ...] = ()) -> \
        tuple[ServerInfo, MetricsSample]:
    """What the server is and what it publishes; ``event_endpoints`` given by the user win over discovery."""
    url = normalise_url(url)
    try:
        sample = fetch_metrics(client, url)
    except httpx.HTTPError as exc:
        raise AttachError(f"cannot reach {url}: {describe_http_error(exc)}") from None
    engine = sample.engines[0] if sample.engines else None
    if engine is None or engine.num_gpu_blocks is None or engine.block_size is None:
        raise AttachError(f"{url} publishes vLLM metrics without vllm:cache_config_info "
                          "(num_gpu_blocks, block_size); kvscope attach needs a vLLM V1 server")
    version = (_json(client, f"{url}/version") or {}).get("version", "unknown")
    card = _model_card(client, url)
    prefix_caching = dict(engine.cache_config).get("enable_prefix_caching", "True") == "True"
    sources, note = (event_endpoints, "") if event_endpoints else _discover(client, url, prefix_caching)
    info = ServerInfo(
        url=url, version=str(version), model=card.get("id") or sample.model_name or "unknown",
        model_root=card.get("root"), max_model_len=card.get("max_model_len"),
        num_gpu_blocks=engine.num_gpu_blocks, block_size=engine.block_size,
        engines=tuple(e.engine for e in sample.engines), prefix_caching=prefix_caching,
        event_sources=tuple(sources), events_note=note, process_start_time=sample.process_start_time,
    )
    return info, sample


def _model_card(client: httpx.Client, url: str) -> dict:
    models = _json(client, f"{url}/v1/models") or {}
    data = models.get("data") if isinstance(models, dict) else None
    return data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}


def describe_http_error(exc: httpx.HTTPError) -> str:
    if isinstance(exc, httpx.ConnectError):
        return "connection refused or host not found"
    if isinstance(exc, httpx.TimeoutException):
        return "no answer in time"
    if isinstance(exc, (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)):
        return f"the connection was lost ({exc or type(exc).__name__})"
    return str(exc) or type(exc).__name__


def _discover(client: httpx.Client, url: str, prefix_caching: bool) -> tuple[list[EventEndpoint], str]:
    found = _json(client, f"{url}/kv_event_sources")
    host = urlsplit(url).hostname or "127.0.0.1"
    sources = []
    if isinstance(found, dict):
        for rank, config in sorted(found.items(), key=lambda item: _rank(item[0])):
            endpoint = server_endpoint(config, host, _rank(rank))
            if endpoint is not None:
                sources.append(endpoint)
    if sources:
        return sources, ""
    if not prefix_caching:
        return [], ("vLLM publishes no KV-cache events with prefix caching off: start it with " + EVENTS_FLAG)
    if found is None:
        return [], ("this server does not list its KV-event sources (GET /kv_event_sources); pass "
                    "--kv-events ENDPOINT, or start vLLM with " + EVENTS_FLAG)
    return [], "this server publishes no KV-cache events: start vLLM with " + EVENTS_FLAG


def _rank(key) -> int:
    try:
        return int(key)
    except (TypeError, ValueError):
        return 0


def server_binds(endpoint: str) -> bool:
    """vLLM's own rule: it binds wildcard and ipc/inproc endpoints and connects to concrete addresses."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def reachable(endpoint: str, host: str) -> str:
    """A bound endpoint as seen from here: the wildcard becomes the server's host."""
    for wildcard in ("[::]", "*", "::"):
        if f"//{wildcard}:" in endpoint:
            return endpoint.replace(f"//{wildcard}:", f"//{host}:", 1)
    return endpoint


def server_endpoint(config, host: str, rank: int) -> EventEndpoint | None:
    """The subscriber's side of one rank's publisher config, or None when it cannot be reached."""
    if not isinstance(config, dict) or not config.get("enable_kv_cache_events") or \
            config.get("publisher") != "zmq" or not config.get("endpoint"):
        return None
    endpoint = str(config["endpoint"])
    if endpoint.startswith("inproc://"):
        return None  # in the server's process only
    replay = config.get("replay_endpoint")
    return EventEndpoint(
        endpoint=reachable(endpoint, host), replay=reachable(str(replay), host) if replay else None,
        topic=str(config.get("topic") or ""), rank=rank, bind=not server_binds(endpoint))


def user_endpoints(events: list[str], replays: list[str]) -> tuple[EventEndpoint, ...]:
    """--kv-events (``bind:`` first to bind) paired in order with --replay."""
    endpoints = []
    for index, text in enumerate(events):
        bind = text.startswith("bind:")
        address = text.removeprefix("bind:")
        if "://" not in address:
            raise AttachError(f"--kv-events {text!r}: give a ZMQ address such as tcp://host:5557 or ipc:///path")
        replay = replays[index] if index < len(replays) else None
        endpoints.append(EventEndpoint(address, replay=replay, bind=bind))
    if len(replays) > len(events):
        raise AttachError("--replay is paired with --kv-events in order: give a --kv-events for each --replay")
    return tuple(endpoints)
