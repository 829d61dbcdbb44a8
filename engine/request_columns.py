"""The running requests' snapshot views, captured as columns and built as views only when a consumer reads them.

In a decode step every running request changes (a token more, a slot more), so the views of all of them were
rebuilt every step: a 16-field tuple per request, a quarter of the engine's host time at batch 256. What a view
of a request with one sample and no KV-cache groups says that can change is a handful of values (its queue, its
tables, its token counts, its preemptions), so a step captures just those, a list per field read through C-level
getters (no object per request), and keeps the requests themselves for what never changes (id, arrival, prompt,
limits). The views are built on first read (the window's frame, a run-log consumer); the run log reads the
columns directly.
"""

from __future__ import annotations

import operator
import threading
from itertools import repeat

from kvscope.engine.outputs import RequestView, view_columns
from kvscope.engine.request import Request

_new_tuple = tuple.__new__
_seqs = operator.attrgetter("seqs")
_first = operator.itemgetter(0)
_token_ids, _params = operator.attrgetter("token_ids"), operator.attrgetter("params")
# What a step captures: RequestView's fields that change while a request runs, read off the request (the first
# three) or its only sample.
_MOVING_OF_REQUEST = ("status", "num_cached_tokens", "num_preemptions")
_MOVING_OF_SAMPLE = ("block_table", "host_block_table", "num_computed_tokens")
_building = threading.Lock()     # a snapshot is read from other threads (the window, the run-log writer)


def one_sample_view(request: Request, status, table: tuple[int, ...], host_table: tuple[int, ...], num_tokens: int,
                    num_computed_tokens: int, num_cached_tokens: int, num_preemptions: int,
                    block_size: int) -> RequestView:
    """The view of a request with one sample and no KV-cache groups, from what changes as it runs."""
    first = request.seqs[0]
    num_prompt_tokens, params = first.num_prompt_tokens, request.params
    # tuple.__new__ with the fields in order: the NamedTuple's own constructor (a Python function) costs twice as
    # much.
    return _new_tuple(RequestView, (
        request.request_id, status, request.arrival_index, (table,), (host_table,) if host_table else (),
        num_prompt_tokens, num_tokens - num_prompt_tokens, params.max_tokens, num_computed_tokens,
        num_cached_tokens, num_preemptions, params.n, len(table) * block_size,
        num_computed_tokens if table else 0, request.prompt_preview, ()))


def one_sample_requests(requests: list[Request], groups: tuple) -> bool:
    """Whether every request has one sample and no KV-cache groups (none has, where the cache has no groups):
    what CapturedViews covers."""
    return not groups and max(map(len, map(_seqs, requests)), default=1) == 1


class CapturedViews:
    """The views of ``requests`` (one sample each, no groups) as they stood at capture, then ``rest`` (views
    built whole): a snapshot's ``requests``, built on the first call of views()."""

    __slots__ = ("_requests", "_moving", "_rest", "_block_size", "_views")

    def __init__(self, requests: list[Request], rest: tuple[RequestView, ...], block_size: int) -> None:
        self._requests = requests
        samples = list(map(_first, map(_seqs, requests)))
        self._moving = (*(list(map(operator.attrgetter(name), requests)) for name in _MOVING_OF_REQUEST),
                        *(list(map(operator.attrgetter(name), samples)) for name in _MOVING_OF_SAMPLE),
                        list(map(len, map(_token_ids, samples))))
        self._rest = rest
        self._block_size = block_size
        self._views: tuple[RequestView, ...] | None = None

    def __len__(self) -> int:
        return len(self._requests) + len(self._rest)

    def views(self) -> tuple[RequestView, ...]:
        views = self._views
        if views is None:
            with _building:
                if self._views is None:
                    status, cached, preemptions, tables, hosts, computed, num_tokens = self._moving
                    self._views = (*map(one_sample_view, self._requests, status, tables, hosts, num_tokens,
                                        computed, cached, preemptions, repeat(self._block_size)), *self._rest)
                views = self._views
        return views

    def columns(self, names: tuple[str, ...]) -> list[list]:
        """RequestView's fields ``names``, a list each in the views' order, without building the views."""
        if self._views is not None:
            return view_columns(self._views, names)
        status, cached, preemptions, tables, hosts, computed, num_tokens = self._moving
        requests, block_size = self._requests, self._block_size
        samples = list(map(_first, map(_seqs, requests)))
        prompts = list(map(operator.attrgetter("num_prompt_tokens"), samples))
        params = list(map(_params, requests))
        captured = {
            "request_id": lambda: list(map(operator.attrgetter("request_id"), requests)),
            "queue": lambda: status,
            "arrival_index": lambda: list(map(operator.attrgetter("arrival_index"), requests)),
            "block_tables": lambda: [(table,) for table in tables],
            "host_block_tables": lambda: [(host,) if host else () for host in hosts],
            "num_prompt_tokens": lambda: prompts,
            "num_output_tokens": lambda: list(map(operator.sub, num_tokens, prompts)),
            "max_tokens": lambda: list(map(operator.attrgetter("max_tokens"), params)),
            "num_computed_tokens": lambda: computed,
            "num_cached_tokens": lambda: cached,
            "num_preemptions": lambda: preemptions,
            "num_samples": lambda: list(map(operator.attrgetter("n"), params)),
            "reserved_slots": lambda: [len(table) * block_size for table in tables],
            "used_slots": lambda: [done if table else 0 for done, table in zip(computed, tables)],
            "prompt_preview": lambda: list(map(operator.attrgetter("prompt_preview"), requests)),
            "group_block_tables": lambda: [()] * len(requests),
        }
        rest = view_columns(self._rest, names)
        return [captured[name]() + column for name, column in zip(names, rest, strict=True)]

