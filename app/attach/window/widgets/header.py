"""The attached window's top lines: which server, what it runs, how big its pool is, and the connection.

Every string here came from the server (its URL as given, /version, the model
id, why a request failed): each goes into the markup as a variable, never as
markup, cleaned of control characters.
"""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static

from kvscope.app.attach.feed.frame import CONNECTED, DISCONNECTED, AttachFrame
from kvscope.app.safe_text import one_line
from kvscope.app.widgets.header import fill_lines

MAX_DETAIL = 120


def describe_connection(frame: AttachFrame) -> str:
    connection = frame.connection
    bad = frame.bad_samples
    if connection.state == CONNECTED:
        if bad.in_a_row:
            return f"[b $warning]● connected, its last {bad.in_a_row:,} /metrics pages were bad[/] [dim]($bad)[/]"
        return "[b $success]● connected[/]" + (f" [dim]· {bad.count:,} bad pages skipped[/]" if bad.count else "")
    if connection.state == DISCONNECTED:
        retry = f" in {connection.retry_in_s:g} s" if connection.retry_in_s else ""
        return f"[b $error]○ disconnected, retrying{retry}[/] [dim]($detail)[/]"
    return "[b $warning]◌ connecting[/]"


def describe_server(frame: AttachFrame) -> str:
    server = frame.server
    ranks = len(frame.pools)
    pools = f"{ranks} ranks × " if ranks > 1 else ""
    context = f" · max_model_len {server.max_model_len:,}" if server.max_model_len else ""
    caching = "prefix cache on" if server.prefix_caching else "prefix cache off"
    return (f"$version · [b]$model[/b] · {pools}{server.num_gpu_blocks:,} blocks × "
            f"{server.block_size} tokens = {server.num_gpu_blocks * server.block_size:,} tokens"
            f"{context} · {caching}")


class AttachHeader(Static):
    def __init__(self, url: str, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(Content(f"kvscope · attaching to {one_line(url)}…"), id=id, classes=classes)
        self._frame: AttachFrame | None = None     # the last drawn, drawn again at a new width

    def on_resize(self) -> None:
        if self._frame is not None:
            self.show_frame(self._frame)

    def show_frame(self, frame: AttachFrame) -> None:
        self._frame = frame
        first = f"[b $accent]kvscope[/] attached to [b]$url[/] │ {describe_connection(frame)}"
        server = frame.server
        values = dict(url=one_line(server.url), model=one_line(server.model), version=one_line(server.version_label),
                      detail=one_line(frame.connection.detail, MAX_DETAIL),
                      bad=one_line(frame.bad_samples.last_reason, MAX_DETAIL))
        # The server's facts break between themselves, never inside one ("prefix cache" / "on").
        facts = [(" · ", fact) for fact in describe_server(frame).split(" · ")]
        width = self.content_region.width or 10_000
        self.update(Content.assemble(Content.from_markup(first, **values), "\n",
                                     fill_lines(facts, width, **values)))
