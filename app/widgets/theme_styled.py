"""What a widget that caches styles built from the theme's variables does when the theme changes.

The block map, the queues and the throughput panel draw their strips from Rich styles made once per theme
(a style per block state, queue, series), not per frame. When the theme is switched, or the widget's CSS
changes, those styles and the strips drawn with them must go: this mixin holds that rule once, and each
widget says what it caches in ``_forget_styles``.
"""

from __future__ import annotations


class ThemeStyled:
    """Mix in before the Widget class; implement ``_forget_styles``."""

    def on_mount(self) -> None:
        self.app.theme_changed_signal.subscribe(self, lambda _theme: self._restyle())

    def _restyle(self) -> None:
        self._forget_styles()
        self.refresh()

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._forget_styles()

    def _forget_styles(self) -> None:
        raise NotImplementedError
