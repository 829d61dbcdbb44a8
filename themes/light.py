"""kvscope-light: paper white for projectors; requests in deep hues that stay readable on white."""

from textual.theme import Theme

from kvscope.themes.palette import owner_variable

_OWNERS = ("#0277bd", "#e65100", "#2e7d32", "#c2185b", "#7b1fa2", "#9e7c00",
           "#00796b", "#c62828", "#4527a0", "#558b2f", "#1565c0", "#bf360c")

KVSCOPE_LIGHT = Theme(
    name="kvscope-light",
    primary="#2f5f8a",
    secondary="#5a7fa8",
    accent="#8a4f9e",
    warning="#b7791f",
    error="#b3261e",
    success="#2e7d32",
    foreground="#1f2430",
    background="#f7f7f4",
    surface="#eeeeea",
    panel="#e2e4e8",
    dark=False,
    variables={
        "block-free": "#b9bec7",
        "block-cached": "#4f8a89",
        "block-shared-text": "#ffffff",
        "block-swapped": "#a0522d",
        "block-chat": "#f0d9ff",
        "block-cursor": "#1f2430",
        "block-marked": "#f2a900",
        **{owner_variable(i): colour for i, colour in enumerate(_OWNERS)},
        "footer-key-foreground": "#2f5f8a",
    },
)
