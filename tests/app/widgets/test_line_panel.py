"""LinePanel keeps every changed line, also when one of them now wraps onto more rows."""

from __future__ import annotations

import pytest
from textual.app import App

from kvscope.app.widgets.line_panel import LinePanel


class PanelApp(App):
    def compose(self):
        yield LinePanel("short\nsecond\nthird", id="panel")


@pytest.mark.anyio
async def test_lines_after_one_that_rewraps_are_updated_too():
    app = PanelApp()
    async with app.run_test(size=(20, 10)) as pilot:
        panel = app.query_one(LinePanel)
        await pilot.pause()
        panel.show("a line long enough to wrap twice over\nsecond, changed\nthird, changed")
        await pilot.pause()
        assert panel.render().plain.split("\n") == ["a line long enough to wrap twice over", "second, changed",
                                                    "third, changed"]
        assert "third, changed" in "".join(panel.render_line(y).text for y in range(panel.size.height))
