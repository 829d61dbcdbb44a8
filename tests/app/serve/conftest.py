"""The fixtures most serve tests share: a tiny-model server for the module, and the official client on it. A
module that needs another server (the default model, limits of its own) defines its own ``server``."""

from __future__ import annotations

import pytest
from serve_helpers import client, running_server


@pytest.fixture(scope="module")
def server():
    with running_server() as running:
        yield running


@pytest.fixture(scope="module")
def api(server):
    with client(server) as openai_client:
        yield openai_client
