"""Driving an App without a terminal: what the screenshots, the lessons' player, the benches and the tests share.

Textual's ``run_test`` gives a pilot; these helpers let the real app run
under it until something a user would see has happened.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def wait_until(pilot, condition: Callable[[], bool], timeout: float = 30.0, poll: float = 0.05) -> bool:
    """Let the app run until ``condition()`` holds; False when ``timeout`` passes first.

    Sleeps rather than ``pilot.pause()``: a pause visits every widget, work a real terminal never does.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(poll)
    return True
