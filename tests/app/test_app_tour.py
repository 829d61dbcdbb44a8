"""What a newcomer's tour at 120x40, 80x24 and 200x60 tripped on: toasts under the footer, lines that wrapped
mid-figure, the served address only in a toast that times out."""

from __future__ import annotations

import pytest
from app_harness import FakeEngines, make_app, started, until
from textual.widgets._toast import Toast

from kvscope.app.widgets.header import EngineHeader

pytestmark = pytest.mark.anyio


class QuietServe:
    """What the App asks of kvscope --serve's HostedServe, serving nothing."""

    url = "http://127.0.0.1:8123"
    wake = None

    def network_warning(self) -> None:
        return None

    def engine_installed(self, engine) -> None:
        pass

    def run_pending(self) -> None:
        pass

    def close(self) -> None:
        pass


async def test_toasts_stand_above_the_status_line_and_the_address_stays_in_the_header():
    app = make_app(FakeEngines(), serve=QuietServe())
    async with app.run_test(size=(120, 40), notifications=True) as pilot:
        await started(pilot)
        await until(pilot, lambda: app.screen.query(Toast))
        await pilot.pause()
        status = app.main.query_one("#vllm-status")
        for toast in app.screen.query(Toast):
            assert toast.region.bottom <= status.region.y, "a toast is drawn over the status line"
        header = str(app.main.query_one(EngineHeader).render())
        assert "serving http://127.0.0.1:8123/v1" in header


@pytest.mark.parametrize("width", [80, 120, 200])
async def test_the_header_breaks_only_between_its_facts(width):
    app = make_app(FakeEngines(), serve=QuietServe())
    async with app.run_test(size=(width, 40)) as pilot:
        await started(pilot)
        header = app.main.query_one(EngineHeader)
        await pilot.pause()
        lines = str(header.render()).split("\n")
        assert len(lines) <= 3 and all(len(line) <= header.size.width for line in lines)
        for line in lines[1:]:
            assert not line.startswith(("MiB", "tok", "x@", "prefix")), lines    # no figure cut from its unit
