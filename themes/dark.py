"""kvscope-dark: a cool night palette; requests in bright, well separated hues."""

from textual.theme import Theme

from kvscope.themes.palette import BLOCK_VARIABLE_DEFAULTS

KVSCOPE_DARK = Theme(
    name="kvscope-dark",
    primary="#88c0d0",
    secondary="#81a1c1",
    accent="#b48ead",
    warning="#ebcb8b",
    error="#bf616a",
    success="#a3be8c",
    foreground="#d8dee9",
    background="#161a21",
    surface="#1d222b",
    panel="#262c37",
    dark=True,
    variables={**BLOCK_VARIABLE_DEFAULTS, "footer-key-foreground": "#88c0d0"},
)
