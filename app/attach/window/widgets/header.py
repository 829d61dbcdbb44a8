"""The attached window's top lines: which server, what it runs, how big its pool is, and the connection."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static

from kvscope.app.attach.feed.frame import CONNECTED, DISCONNECTED, AttachFrame


def describe_connection(frame: AttachFrame) -> str:
    connection = frame.connection
    if connection.state == CONNECTED:
        return "[b $success]● connected[/]"
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
    return (f"vLLM {server.version} · [b]$model[/b] · {pools}{server.num_gpu_blocks:,} blocks × "
            f"{server.block_size} tokens = {server.num_gpu_blocks * server.block_size:,} tokens"
            f"{context} · {caching}")


class AttachHeader(Static):
    def __init__(self, url: str, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(f"kvscope · attaching to {url}…", id=id, classes=classes)

    def show_frame(self, frame: AttachFrame) -> None:
        first = f"[b $accent]kvscope[/] attached to [b]$url[/] │ {describe_connection(frame)}"
        text = f"{first}\n{describe_server(frame)}"
        self.update(Content.from_markup(text, url=frame.server.url, model=frame.server.model,
                                        detail=frame.connection.detail))
