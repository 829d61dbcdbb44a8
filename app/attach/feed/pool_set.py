"""The pools of an attached server: one per data-parallel rank of each event publisher.

vLLM gives each data-parallel rank its own scheduler and block pool, and each
rank publishes its own events (on its own port). A batch names its rank, so
pools are keyed by (publisher, rank). Ranks the server lists but that have not
spoken yet get their pool up front, so the map shows every pool from the start;
a server without events still gets one pool per engine, drawn from its usage
alone. A pool's usage band comes from ``/metrics`` for the engine label equal
to its rank.

A publisher given by hand (``--kv-events``) does not say its rank until its
first batch. It gets rank 0's pool up front, vLLM's only rank without data
parallelism, so the window and the run log have a pool from the first sample;
if its first batch names another rank, that still empty pool takes the rank.
Pools are made only within limits.py's bounds (MAX_RANKS pools, MAX_BLOCKS
blocks in all): past them ``pool`` says None and the batch is not drawn.
"""

from __future__ import annotations

from kvscope.app.attach.feed.limits import MAX_BLOCKS, MAX_RANKS
from kvscope.app.attach.feed.metrics import MetricsSample
from kvscope.app.attach.feed.pool import Journal, PoolModel
from kvscope.app.attach.feed.pool_view import PoolPicture, PoolView
from kvscope.app.attach.feed.server import ServerInfo


class PoolSet:
    def __init__(self, server: ServerInfo, preview_text=None) -> None:
        self.server = server
        self.preview_text = preview_text
        self._pictures: dict[tuple[int, int], PoolPicture] = {}
        self._assumed: set[int] = set()     # streams whose pool's rank is vLLM's default, not yet confirmed
        sources = server.event_sources
        for index, source in enumerate(sources):
            self.pool(index, 0 if source.rank is None else source.rank)
            if source.rank is None:
                self._assumed.add(index)
        if not sources:
            for engine in server.engines:
                self.pool(-1, _rank_of(engine))

    def pool(self, stream_index: int, rank: int) -> PoolModel | None:
        """The pool of ``rank`` as ``stream_index`` publishes it; None past the limits."""
        picture = self._pictures.get((stream_index, rank))
        if picture is not None:
            self._assumed.discard(stream_index)
            return picture.pool
        if stream_index in self._assumed:
            self._assumed.discard(stream_index)
            assumed = self._pictures[(stream_index, 0)]
            if assumed.pool.version == 0:   # nothing drawn in it yet: it was this rank's all along
                del self._pictures[(stream_index, 0)]
                self._pictures[(stream_index, rank)] = assumed
                self._relabel()
                return assumed.pool
        blocks = (len(self._pictures) + 1) * self.server.num_gpu_blocks
        if len(self._pictures) >= MAX_RANKS or blocks > MAX_BLOCKS:
            return None
        model = PoolModel(self.server.num_gpu_blocks, self.server.block_size)
        self._pictures[(stream_index, rank)] = PoolPicture(model, "", self.preview_text)
        self._relabel()
        return model

    def _relabel(self) -> None:
        ranks = [rank for _, rank in self._pictures]
        for (index, rank), picture in self._pictures.items():
            label = f"rank {rank}"
            if ranks.count(rank) > 1 and index >= 0:
                label += f" · {self.server.event_sources[index].label}"
            picture.label = label

    def of_stream(self, stream_index: int) -> list[PoolModel]:
        return [p.pool for (index, _), p in self._pictures.items() if index == stream_index]

    def clear_stream(self, stream_index: int) -> None:
        for pool in self.of_stream(stream_index):
            pool.clear()

    @property
    def num_known_blocks(self) -> int:
        return sum(p.pool.num_known_blocks for p in self._pictures.values())

    def views(self, step: int, sample: MetricsSample | None) -> tuple[PoolView, ...]:
        keys = sorted(self._pictures, key=lambda key: (key[1], key[0]))
        return tuple(self._pictures[key].view(step, self._usage(sample, key[1])) for key in keys)

    def _usage(self, sample: MetricsSample | None, rank: int) -> float | None:
        if sample is None:
            return None
        engine = sample.engine(str(rank))
        if engine is None and len(sample.engines) == 1 and len(self._pictures) == 1:
            engine = sample.engines[0]
        return engine.kv_usage if engine is not None else None

    def journals(self) -> list[tuple[str, Journal]]:
        keys = sorted(self._pictures, key=lambda key: (key[1], key[0]))
        return [(self._pictures[key].label, self._pictures[key].pool.take_journal()) for key in keys]


def _rank_of(engine: str) -> int:
    try:
        return int(engine)
    except ValueError:
        return 0
