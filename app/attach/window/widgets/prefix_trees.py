"""The prefix panel: each prefix tree's root (as text when the tokenizer is at hand), size, depth and reuse."""

from __future__ import annotations

from textual.events import Resize

from kvscope.app.attach.feed.frame import AttachFrame
from kvscope.app.attach.feed.pool_view import PrefixTree
from kvscope.app.safe_text import escape, one_line
from kvscope.app.widgets.line_panel import LinePanel
from kvscope.themes.palette import NUM_OWNER_COLOURS, owner_variable

MAX_ROWS = 12
NAME_WIDTH = 13
COLUMNS_WIDTH = 41      # the columns before the root's text
NARROW_COLUMNS_WIDTH = 21
NARROW = 56             # below this width, depth, branches and reuse make way for the root's text
MIN_PREVIEW_CHARS = 12
HEADER = "[b $primary]tree          blocks depth branch reuse  root[/]"
NARROW_HEADER = "[b $primary]tree          blocks root[/]"
FOOTNOTE = ("[dim]reuse: store events since attach that show a request reusing the prefix (a new branch, or "
            "blocks announced again). vLLM publishes no per-prefix hit counts, and a request that reuses a "
            "prefix without filling a block of its own sends no event.[/]")


def preview_of(tree: PrefixTree, chars: int) -> str:
    """The root's text (token ids without a tokenizer) on one line of at most ``chars``. The text is what
    the server's tokens decode to: it is cleaned and escaped like anything from outside."""
    text = tree.preview or " ".join(map(str, tree.preview_token_ids))
    return escape(one_line(("…" if tree.partial else "") + one_line(text), chars))


def tree_row(tree: PrefixTree, rank: str, chars: int, narrow: bool = False) -> str:
    colour = "$" + owner_variable(tree.tree_id % NUM_OWNER_COLOURS)
    name = f"{rank}{tree.name}"
    name = name if len(name) <= NAME_WIDTH else "…" + name[-NAME_WIDTH + 1:]
    if narrow:
        return f"[b {colour}]{name:<{NAME_WIDTH}}[/] {tree.num_blocks:>6} {preview_of(tree, chars)}"
    return (f"[b {colour}]{name:<{NAME_WIDTH}}[/] {tree.num_blocks:>6} {tree.depth:>5} {tree.num_branches:>6} "
            f"{tree.num_reuses:>5}  {preview_of(tree, chars)}")


def describe_prefixes(frame: AttachFrame, width: int = 100) -> str:
    if not frame.has_events:
        return "No prefix trees without KV-cache events.\n" + escape(one_line(frame.server.events_note))
    several, narrow = len(frame.pools) > 1, width < NARROW
    rows = []
    for pool in frame.pools:
        rank = pool.label.split(" ·")[0].replace("rank ", "r") + ":" if several else ""
        columns = NARROW_COLUMNS_WIDTH if narrow else COLUMNS_WIDTH
        chars = max(width - columns - len(rank), MIN_PREVIEW_CHARS)
        rows.extend(tree_row(tree, rank, chars, narrow) for tree in pool.trees)
    total = sum(pool.num_trees for pool in frame.pools)
    if not rows:
        return "No prefix cached yet: a tree appears when vLLM announces a full block.\n" + FOOTNOTE
    more = f"\n[dim]… {total - MAX_ROWS} smaller trees not listed[/]" if total > MAX_ROWS else ""
    note = f"\n[dim]{escape(one_line(frame.preview_note))}[/]" if frame.preview_note else ""
    return "\n".join([NARROW_HEADER if narrow else HEADER, *rows[:MAX_ROWS]]) + more + note + "\n" + FOOTNOTE


class PrefixTrees(LinePanel):
    PLACEHOLDER = "waiting for the server…"
    frame: AttachFrame | None = None

    def show_frame(self, frame: AttachFrame) -> None:
        self.frame = frame
        total = sum(pool.num_trees for pool in frame.pools)
        self.border_title = f"Prefix trees · {total}"
        self.show(describe_prefixes(frame, self.content_size.width or 100))

    def on_resize(self, event: Resize) -> None:
        # The rows are cut to the width: a new width needs them cut again.
        if self.frame is not None:
            self.show(describe_prefixes(self.frame, self.content_size.width))
        super().on_resize(event)
