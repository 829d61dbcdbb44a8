"""The running requests' snapshot views, captured in a few values each and built as views only when read.

In a decode step every running request changes (a token more, a slot more), so the views of all of them were
rebuilt every step: a 16-field tuple per request (and its table's), a quarter of the engine's host time at batch
256. What can change in the view of a request with one sample and no KV-cache groups is a handful of values (its
queue, its tables, its token counts, its preemptions), so a step captures just those, one small tuple per request,
and keeps the requests themselves for what never changes (id, arrival, prompt, limits). The views are built on
first read (the window's frame); the run log reads the fields as columns without building them.
"""

from __future__ import annotations

import threading

from kvscope.engine.outputs import RequestView, view_columns
from kvscope.engine.request import Request

_new_tuple = tuple.__new__
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


class CapturedViews:
    """The views of ``requests`` (one sample each, no groups) as they stood at capture (``moving``: per request,
    what capture() reads), then ``rest`` (views built whole): a snapshot's ``requests``, built on the first call
    of views()."""

    __slots__ = ("_requests", "_moving", "_rest", "_block_size", "_views")

    def __init__(self, requests: list[Request], moving: list[tuple], rest: tuple[RequestView, ...],
                 block_size: int) -> None:
        self._requests = requests
        self._moving = moving
        self._rest = rest
        self._block_size = block_size
        self._views: tuple[RequestView, ...] | None = None

    @classmethod
    def capture(cls, requests: list[Request], rest: tuple[RequestView, ...], block_size: int,
                groups: tuple) -> CapturedViews | None:
        """What changes of each request, now; None where one has several samples or KV-cache groups (every one
        has, where the cache has groups), whose views need the pool's fill."""
        if groups:
            return None
        moving = []
        append = moving.append
        # One plain loop, a tuple per request: specialised attribute reads beat a pass of operator.attrgetter per
        # field several times over.
        for request in requests:
            seqs = request.seqs
            if len(seqs) != 1:
                return None
            sample = seqs[0]
            append((request.status, request.num_cached_tokens, request.num_preemptions, sample.block_table,
                    sample.host_block_table, sample.num_computed_tokens, len(sample.token_ids)))
        return cls(list(requests), moving, rest, block_size)

    def __len__(self) -> int:
        return len(self._requests) + len(self._rest)

    def views(self) -> tuple[RequestView, ...]:
        views = self._views
        if views is None:
            with _building:
                if self._views is None:
                    block_size = self._block_size
                    self._views = (*(one_sample_view(request, status, table, host, num_tokens, computed, cached,
                                                     preemptions, block_size)
                                     for request, (status, cached, preemptions, table, host, computed, num_tokens)
                                     in zip(self._requests, self._moving)), *self._rest)
                views = self._views
        return views

    def columns(self, names: tuple[str, ...]) -> list[list]:
        """RequestView's fields ``names``, a list each in the views' order, without building the views."""
        if self._views is not None:
            return view_columns(self._views, names)
        status, cached, preemptions, tables, hosts, computed, num_tokens = (
            map(list, zip(*self._moving)) if self._moving else ([],) * 7)
        requests, block_size = self._requests, self._block_size
        # List comprehensions, each field where it is asked for: specialised reads beat operator's getters here.
        prompts = [request.seqs[0].num_prompt_tokens for request in requests]
        captured = {
            "request_id": lambda: [request.request_id for request in requests],
            "queue": lambda: status,
            "arrival_index": lambda: [request.arrival_index for request in requests],
            "block_tables": lambda: [(table,) for table in tables],
            "host_block_tables": lambda: [(host,) if host else () for host in hosts],
            "num_prompt_tokens": lambda: prompts,
            "num_output_tokens": lambda: [tokens - prompt for tokens, prompt in zip(num_tokens, prompts)],
            "max_tokens": lambda: [request.params.max_tokens for request in requests],
            "num_computed_tokens": lambda: computed,
            "num_cached_tokens": lambda: cached,
            "num_preemptions": lambda: preemptions,
            "num_samples": lambda: [request.params.n for request in requests],
            "reserved_slots": lambda: [len(table) * block_size for table in tables],
            "used_slots": lambda: [done if table else 0 for done, table in zip(computed, tables)],
            "prompt_preview": lambda: [request.prompt_preview for request in requests],
            "group_block_tables": lambda: [()] * len(requests),
        }
        if not self._rest:
            return [captured[name]() for name in names]
        return [captured[name]() + column for name, column in zip(names, view_columns(self._rest, names), strict=True)]

