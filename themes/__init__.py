"""kvscope's Textual themes. Each theme is a Theme object plus a .tcss file next to it."""

from pathlib import Path

from kvscope.themes.dark import KVSCOPE_DARK
from kvscope.themes.light import KVSCOPE_LIGHT
from kvscope.themes.palette import BLOCK_STATE_VARIABLES, BLOCK_VARIABLE_DEFAULTS, NUM_OWNER_COLOURS, owner_variable

THEMES = (KVSCOPE_DARK, KVSCOPE_LIGHT)
DEFAULT_THEME = KVSCOPE_DARK.name
THEME_CSS_PATHS = tuple(Path(__file__).with_name(f"{name}.tcss") for name in ("dark", "light"))

__all__ = ["BLOCK_STATE_VARIABLES", "BLOCK_VARIABLE_DEFAULTS", "DEFAULT_THEME", "KVSCOPE_DARK",
           "KVSCOPE_LIGHT", "NUM_OWNER_COLOURS", "THEMES", "THEME_CSS_PATHS", "owner_variable"]
