"""What both kvscope windows share: the engine's (app/app.py) and the attached server's (app/attach/window/app.py).

They show the same map in the same colours, so the themes, the block-state colour defaults, the
breakpoints, the theme toggle, the "?" keys panel and the SVG screenshot live here once.
"""

from __future__ import annotations

from pathlib import Path

from textual.app import App

from kvscope.app.widgets.keys_panel import toggle_keys_panel
from kvscope.themes import BLOCK_VARIABLE_DEFAULTS, DEFAULT_THEME, KVSCOPE_DARK, KVSCOPE_LIGHT, THEMES

APP_CSS = Path(__file__).with_name("kvscope.tcss")


class ThemedApp(App):
    """A subclass sets ``screenshot_dir`` (where F10/Ctrl+S screenshots go) in its ``__init__``."""

    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    screenshot_dir: Path

    def __init__(self) -> None:
        super().__init__()
        for theme in THEMES:
            self.register_theme(theme)
        self.theme = DEFAULT_THEME

    def get_theme_variable_defaults(self) -> dict[str, str]:
        return BLOCK_VARIABLE_DEFAULTS

    def action_toggle_theme(self) -> None:
        self.theme = KVSCOPE_LIGHT.name if self.theme == KVSCOPE_DARK.name else KVSCOPE_DARK.name

    def action_show_keys(self) -> None:
        toggle_keys_panel(self)

    def action_screenshot_svg(self) -> None:
        self.screenshot_dir.mkdir(parents=True, exist_ok=True)
        path = self.save_screenshot(path=str(self.screenshot_dir))
        self.notify(f"saved {path}", title="Screenshot", timeout=6)
