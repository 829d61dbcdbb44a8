"""The lesson panel cues "more below" whenever its text reaches past its bottom, also when the text grows without
a new beat or a resize."""

from __future__ import annotations

import pytest
from textual.app import App

from kvscope.app.widgets.lesson_panel import MORE, LessonPanel


class PanelApp(App):
    CSS = "LessonPanel { height: 8; }"

    def compose(self):
        yield LessonPanel()


@pytest.mark.anyio
async def test_text_that_grows_past_the_bottom_without_a_resize_is_cued_and_cleared_when_it_shrinks():
    app = PanelApp()
    async with app.run_test(size=(40, 12)) as pilot:
        panel = app.query_one(LessonPanel)
        panel.show_beat(1, 2, "Short", "fits")
        await pilot.pause()
        assert panel.max_scroll_y == 0 and panel.border_subtitle == ""
        panel.show("\n".join(f"line {i}" for i in range(20)))    # no beat, no resize: only the text grew
        await pilot.pause()
        assert panel.max_scroll_y > 0 and panel.border_subtitle == MORE
        panel.show("one line")
        await pilot.pause()
        assert panel.max_scroll_y == 0 and panel.border_subtitle == ""
