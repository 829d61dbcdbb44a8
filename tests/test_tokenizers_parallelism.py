"""kvscope turns Hugging Face tokenizers' thread pool off unless the user set it (kvscope/__init__.py says why:
with it on, a served request could hang for good after a tokenizer had been used on another thread)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest


@pytest.mark.parametrize(("given", "expected"), [(None, "false"), ("true", "true")])
def test_importing_kvscope_turns_the_pool_off_unless_the_user_chose(given, expected):
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    if given is not None:
        env["TOKENIZERS_PARALLELISM"] = given
    done = subprocess.run([sys.executable, "-c", "import os, kvscope; print(os.environ['TOKENIZERS_PARALLELISM'])"],
                          env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected
