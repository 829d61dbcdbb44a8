"""Finding out, before the window opens, what the URL is and what it publishes.

``probe_server`` reads ``/metrics`` (the one page every vLLM server has), then
``/version``, ``/v1/models`` and ``/kv_event_sources``, which older or
differently configured servers may lack. An unreachable URL, a page that is
not vLLM's, or one whose numbers are not plausible (limits.py) is an
``AttachError`` with one line to print; everything optional that is missing or
malformed becomes a fact the window states. Every request has a deadline and a
byte cap (fetch.py); every string kept is cut to a length (the window and the
run log make it safe to draw or print).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvscope.app.attach.feed.fetch import Fetcher, FetchError
from kvscope.app.attach.feed.limits import (
    INFO_DEADLINE_S,
    INFO_MAX_BYTES,
    MAX_RANKS,
    MAX_TEXT,
    METRICS_DEADLINE_S,
    METRICS_MAX_BYTES,
)
from kvscope.app.attach.feed.metrics import MetricsSample, is_vllm_page, parse_metrics, sample_problem

MAX_MODEL_LEN = 1 << 31
MAX_ENDPOINT = 1000     # characters of a ZMQ address
EVENTS_FLAG = ("--enable-prefix-caching --kv-events-config "
               "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", "
               "\"replay_endpoint\": \"tcp://*:5558\"}'")


class AttachError(Exception):
    """The attach cannot start; the message is the one line the user sees."""


class BadPage(AttachError):
    """The server answered, with a page that is not a plausible vLLM metrics page."""


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


KVSCOPE_KIND = "kvscope"


def server_kind(version: str, owned_by: str | None) -> str:
    """kvscope's own server, told by its /version or its model card; anything else is taken for vLLM."""
    return KVSCOPE_KIND if version.startswith(KVSCOPE_KIND) or owned_by == KVSCOPE_KIND else "vLLM"


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
    # What answers: vLLM, or a `kvscope serve` (its /version says "kvscope …", its model card is owned_by
    # "kvscope"), which publishes vLLM's series but may swap preempted requests to a host pool of that many blocks.
    kind: str = "vLLM"
    swap_blocks: int | None = None

    @property
    def is_kvscope(self) -> bool:
        return self.kind == KVSCOPE_KIND

    @property
    def version_label(self) -> str:
        """"vLLM 0.32.0", or kvscope's own "kvscope 0.4.0" (its /version already names it)."""
        return self.version if self.version.startswith(self.kind) else f"{self.kind} {self.version}"


def normalise_url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


def make_client() -> Fetcher:
    return Fetcher()


def fetch_metrics(client: Fetcher, url: str, previous: MetricsSample | None = None,
                  stop: threading.Event | None = None) -> MetricsSample:
    """Read, parse and check /metrics (after ``previous``, when there is one). Raises FetchError when no
    whole answer came (fetch.Stopped when ``stop`` was set), BadPage when what answered is not a plausible
    vLLM metrics page."""
    page = client.get(f"{url}/metrics", max_bytes=METRICS_MAX_BYTES, deadline_s=METRICS_DEADLINE_S, stop=stop)
    if page.status != 200:
        raise BadPage(f"{url} is not a vLLM server: GET /metrics answered HTTP {page.status}")
    text = page.text
    if not is_vllm_page(text):
        raise BadPage(f"{url} is not a vLLM server: its /metrics page has no vllm: series")
    try:
        sample = parse_metrics(text, time.time())
    except ValueError as exc:
        raise BadPage(f"{url} is not a vLLM server: its /metrics page does not parse ({exc})") from None
    problem = sample_problem(sample, previous)
    if problem:
        raise BadPage(f"{url}: kvscope cannot use its /metrics page: {problem}")
    return sample


def _json(client: Fetcher, url: str):
    """The JSON at ``url``, or None when it is missing, slow, too big or not JSON: these pages are optional."""
    try:
        page = client.get(url, max_bytes=INFO_MAX_BYTES, deadline_s=INFO_DEADLINE_S)
    except FetchError:
        return None
    if page.status != 200:
        return None
    try:
        return json.loads(page.body)
    except ValueError:
        return None


def probe_server(client: Fetcher, url: str, *, event_endpoints: tuple[EventEndpoint, ...] = ()) -> \
        tuple[ServerInfo, MetricsSample]:
    """What the server is and what it publishes; ``event_endpoints`` given by the user win over discovery."""
    url = normalise_url(url)
    try:
        sample = fetch_metrics(client, url)
    except FetchError as exc:
        raise AttachError(f"cannot reach {url}: {exc}" if exc.unreachable else
                          f"cannot read {url}/metrics: {exc}") from None
    engine = sample.engines[0]
    version = _text((_json(client, f"{url}/version") or {}).get("version")) or "unknown"
    card = _model_card(client, url)
    prefix_caching = dict(engine.cache_config).get("enable_prefix_caching", "True") == "True"
    sources, note = (event_endpoints, "") if event_endpoints else _discover(client, url, prefix_caching)
    kind = server_kind(version, _text(card.get("owned_by")))
    host_blocks = dict(engine.cache_config).get("num_cpu_blocks", "")
    info = ServerInfo(
        kind=kind, swap_blocks=int(host_blocks) if kind == KVSCOPE_KIND and host_blocks.isdigit() else None,
        url=url, version=version, model=_text(card.get("id")) or sample.model_name or "unknown",
        model_root=_text(card.get("root"), 4096), max_model_len=_model_len(card.get("max_model_len")),
        num_gpu_blocks=engine.num_gpu_blocks, block_size=engine.block_size,
        engines=tuple(e.engine for e in sample.engines), prefix_caching=prefix_caching,
        event_sources=tuple(sources), events_note=note, process_start_time=sample.process_start_time,
    )
    return info, sample


def _text(value, limit: int = MAX_TEXT) -> str | None:
    """A string the server sent, cut to ``limit``; None for anything else."""
    return value[:limit] if isinstance(value, str) and value else None


def _model_len(value) -> int | None:
    return value if type(value) is int and 1 <= value <= MAX_MODEL_LEN else None


def _model_card(client: Fetcher, url: str) -> dict:
    models = _json(client, f"{url}/v1/models") or {}
    data = models.get("data") if isinstance(models, dict) else None
    return data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}


def _discover(client: Fetcher, url: str, prefix_caching: bool) -> tuple[list[EventEndpoint], str]:
    found = _json(client, f"{url}/kv_event_sources")
    host = urlsplit(url).hostname or "127.0.0.1"
    sources = []
    if isinstance(found, dict):
        listed = sorted(found.items(), key=lambda item: _rank(item[0]))
        if len(listed) > MAX_RANKS:
            raise AttachError(f"{url} lists {len(listed):,} KV-event sources (at most {MAX_RANKS} ranks)")
        for rank, config in listed:
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
        rank = int(key)
    except (TypeError, ValueError):
        return 0
    return rank if 0 <= rank < MAX_RANKS else 0


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
    endpoint = _text(config["endpoint"], MAX_ENDPOINT)
    if endpoint is None or endpoint.startswith("inproc://"):
        return None  # not an address, or in the server's process only
    replay = _text(config.get("replay_endpoint"), MAX_ENDPOINT)
    return EventEndpoint(
        endpoint=reachable(endpoint, host), replay=reachable(replay, host) if replay else None,
        topic=_text(config.get("topic"), MAX_TEXT) or "", rank=rank, bind=not server_binds(endpoint))


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
