"""The theme variables kvscope adds to Textual's: block-state colours and the request palette.

Every theme sets all of them; ``BLOCK_VARIABLE_DEFAULTS`` is only the fallback
Textual needs for a theme that does not (a built-in one picked from the palette).
"""

from __future__ import annotations

NUM_OWNER_COLOURS = 12

BLOCK_STATE_VARIABLES = (
    "block-free",         # glyph of a free block
    "block-cached",       # free, but still holds a reusable prefix hash
    "block-shared-text",  # the ref-count digit drawn on a shared block
    "block-swapped",      # a request's blocks that sit in the host pool
    "block-chat",         # background of the running chat reply's blocks
    "block-cursor",       # background of the cell under the cursor
    "block-marked",       # background of blocks a lesson points at
)


def owner_variable(index: int) -> str:
    return f"block-owner-{index}"


BLOCK_VARIABLE_DEFAULTS: dict[str, str] = {
    "block-free": "#4c566a",
    "block-cached": "#8fbcbb",
    "block-shared-text": "#101318",
    "block-swapped": "#d08770",
    "block-chat": "#553a63",
    "block-cursor": "#e5e9f0",
    "block-marked": "#ebcb8b",
    **{owner_variable(i): colour for i, colour in enumerate((
        "#4fc3f7", "#ffb74d", "#81c784", "#f06292", "#ba68c8", "#fff176",
        "#4db6ac", "#e57373", "#9575cd", "#aed581", "#64b5f6", "#ff8a65",
    ))},
}
