"""The top lines: the run state, then model, device, dtype, block size, the pool, max concurrency, allocator."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static

from kvscope.app.messages import EngineInfo, RunState
from kvscope.app.widgets.formatting import mebibytes


def prefix_caching_on(info: EngineInfo) -> bool:
    """The contiguous baseline shares no blocks, so it cannot use the prefix cache whatever the flag says."""
    return info.config.enable_prefix_caching and info.config.allocator != "contiguous"


def describe_engine_compact(info: EngineInfo) -> list[str]:
    """For narrow windows: the same facts in a third of the width, as pieces that lines break between."""
    config, runner = info.config, info.runner
    caching = "prefix✓" if prefix_caching_on(info) else "prefix✗"
    size = f" {mebibytes(runner.kv_cache_bytes)}" if runner.kv_cache_bytes else ""
    return ["[b]$model[/b]", f"{runner.device} {runner.dtype}",
            f"{runner.num_device_blocks:,}×{runner.block_size} tok{size}",
            f"{info.max_concurrency:.1f}x@{runner.max_model_len:,}",
            f"[b]{config.allocator}[/b] {config.preemption_mode} {caching}"]


def fill_lines(pieces: list[tuple[str, str]], width: int, **values) -> Content:
    """(separator, markup) pieces on as few lines as ``width`` allows, each line broken only between pieces, so
    no figure is ever split by the wrap ("2,048" on one line, "MiB" on the next)."""
    lines: list[str] = []
    for separator, piece in pieces:
        if lines:
            joined = lines[-1] + separator + piece
            if Content.from_markup(joined, **values).cell_length <= width:
                lines[-1] = joined
                continue
        lines.append(piece)
    return Content.from_markup("\n".join(lines), **values)


def describe_engine(info: EngineInfo) -> str:
    """Two lines: what runs and how big the pool is; then what the pool allows and the policies."""
    config, runner = info.config, info.runner
    pool = f"pool {runner.num_device_blocks:,} blocks = {info.num_tokens:,} tokens"
    if runner.kv_cache_bytes:
        pool += f" ({mebibytes(runner.kv_cache_bytes)})"
    caching = "prefix cache on" if prefix_caching_on(info) else \
        "prefix cache off" if config.allocator == "paged" else "no prefix cache (contiguous)"
    return (f"[b]$model[/b] · {runner.device} · {runner.dtype} · block {runner.block_size} · {pool}\n"
            f"max concurrency {info.max_concurrency:.1f}x at {runner.max_model_len:,} tokens · "
            f"[b]{config.allocator}[/b] allocator · preempt: {config.preemption_mode} · {caching}")


def describe_state(state: RunState) -> str:
    cap = f" · cap {state.steps_per_s_cap:g} steps/s" if state.steps_per_s_cap else ""
    return ("[b $warning]■ paused[/]" if state.paused else "[b $success]▶ running[/]") + cap


class EngineHeader(Static):
    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__("kvscope · starting the engine…", id=id, classes=classes)
        self.info: EngineInfo | None = None
        self.state: RunState | None = None
        self.starting: str | None = None
        self.stopped: str | None = None     # why no engine runs, when none does
        self.serving: str | None = None     # the OpenAI API's address, while kvscope --serve serves

    def show_serving(self, url: str | None) -> None:
        self.serving = url
        self._redraw()

    def show_starting(self, model: str) -> None:
        self.starting = model
        self._redraw()

    def show_engine(self, info: EngineInfo) -> None:
        self.info, self.starting, self.stopped = info, None, None
        self._redraw()

    def show_stopped(self, error: str) -> None:
        self.starting, self.stopped = None, error
        self._redraw()

    def show_state(self, state: RunState) -> None:
        self.state = state
        self._redraw()

    def on_resize(self) -> None:
        self._redraw()

    def _redraw(self) -> None:
        # The run state comes first: paused or running is what a class watching needs to see.
        parts = ["[b $accent]kvscope[/]"]
        if self.state is not None:
            parts.append(describe_state(self.state))
        if self.serving:
            parts.append("[b]serving[/] $serving/v1")
        model = self.starting if self.starting is not None else (self.info.runner.model_name if self.info else "")
        if self.stopped is not None:    # the run state means nothing without an engine
            self.update(Content.from_markup(f"{parts[0]} │ [b $error]no engine running[/]: $stopped",
                                            stopped=self.stopped))
            return
        values = {"model": model, "serving": self.serving or ""}
        width = self.size.width
        if self.starting is not None:
            parts.append("loading $model…")
        elif self.info is not None:
            full = Content.from_markup(" │ ".join([*parts, describe_engine(self.info)]), **values)
            # The two full lines when each fits the width, else the same facts in a third of the width.
            if not width or all(line.cell_length <= width for line in full.split("\n")):
                self.update(full)
                return
            pieces = [(" │ ", part) for part in parts] + [(" │ " if index == 0 else " · ", piece) for index, piece
                                                           in enumerate(describe_engine_compact(self.info))]
            self.update(fill_lines(pieces, width, **values))
            return
        self.update(Content.from_markup(" │ ".join(parts), **values))
