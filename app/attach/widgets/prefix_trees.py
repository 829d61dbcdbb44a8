"""The prefix panel: each prefix tree's root (as text when the tokenizer is at hand), size, depth and reuse."""

from __future__ import annotations

from textual.markup import escape

from kvscope.app.attach.frame import AttachFrame
from kvscope.app.attach.pool_view import PrefixTree
from kvscope.app.widgets.line_panel import LinePanel
from kvscope.themes.palette import NUM_OWNER_COLOURS, owner_variable

MAX_ROWS = 12
COLUMNS_WIDTH = 37      # the columns before the root's text
MIN_PREVIEW_CHARS = 12
HEADER = "[b $primary]tree        blocks depth branch reuse  root[/]"
FOOTNOTE = ("[dim]reuse: store events since attach that show a request reusing the prefix (a new branch, or "
            "blocks announced again). vLLM publishes no per-prefix hit counts, and a request that reuses a "
            "prefix without filling a block of its own sends no event.[/]")


def preview_of(tree: PrefixTree, chars: int) -> str:
    """The root's text (token ids without a tokenizer) on one line of at most ``chars``."""
    text = tree.preview or " ".join(map(str, tree.preview_token_ids))
    text = ("…" if tree.partial else "") + " ".join(text.split())
    return escape(text if len(text) <= chars else text[:chars - 1] + "…")


def tree_row(tree: PrefixTree, rank: str, chars: int) -> str:
    colour = "$" + owner_variable(tree.tree_id % NUM_OWNER_COLOURS)
    name = f"{rank}{tree.name}"
    return (f"[b {colour}]{name:<11}[/] {tree.num_blocks:>6} {tree.depth:>5} {tree.num_branches:>6} "
            f"{tree.num_reuses:>5}  {preview_of(tree, chars)}")


def describe_prefixes(frame: AttachFrame, width: int = 100) -> str:
    if not frame.has_events:
        return ("No prefix trees: this server publishes no KV-cache events.\n" + escape(frame.server.events_note))
    several = len(frame.pools) > 1
    rows = []
    for pool in frame.pools:
        rank = pool.label.split(" ·")[0].replace("rank ", "r") + ":" if several else ""
        chars = max(width - COLUMNS_WIDTH - len(rank), MIN_PREVIEW_CHARS)
        rows.extend(tree_row(tree, rank, chars) for tree in pool.trees)
    total = sum(pool.num_trees for pool in frame.pools)
    if not rows:
        return "No prefix cached yet: a tree appears when vLLM announces a full block.\n" + FOOTNOTE
    more = f"\n[dim]… {total - MAX_ROWS} smaller trees not listed[/]" if total > MAX_ROWS else ""
    note = f"\n[dim]{escape(frame.preview_note)}[/]" if frame.preview_note else ""
    return "\n".join([HEADER, *rows[:MAX_ROWS]]) + more + note + "\n" + FOOTNOTE


class PrefixTrees(LinePanel):
    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__("waiting for the server…", id=id, classes=classes)

    def show_frame(self, frame: AttachFrame) -> None:
        total = sum(pool.num_trees for pool in frame.pools)
        self.border_title = f"Prefix trees · {total}"
        self.show(describe_prefixes(frame, self.size.width or 100))
