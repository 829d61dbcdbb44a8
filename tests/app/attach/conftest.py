"""Fixtures the attach tests share: a ZeroMQ context, destroyed without lingering after each test."""

from __future__ import annotations

import pytest
import zmq


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)
