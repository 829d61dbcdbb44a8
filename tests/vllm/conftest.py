"""The live tests' server: one real vLLM CPU server for the whole run (it takes minutes to start).

``make test-vllm`` builds .venv-vllm and sets KVSCOPE_VLLM_PYTHON to its python; without that
variable these tests are not collected at all (tests/conftest.py), so ``make test`` never waits on one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from server import VllmServer  # noqa: E402

from kvscope.engine.model.loader import fetch_default_model  # noqa: E402


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    python = os.environ["KVSCOPE_VLLM_PYTHON"]
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with VllmServer(python, str(fetch_default_model()), log) as server:
        yield server
