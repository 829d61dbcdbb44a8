"""kvscope: watch a real paged-attention LLM engine work, live in your terminal.

The repository root is this package. pyproject.toml maps it with setuptools'
``package-dir``, so the folders beside this file install as ``kvscope.app``,
``kvscope.engine``, ``kvscope.kernels`` and ``kvscope.themes``, and ``kvscope``
is the only name kvscope puts into site-packages. Generic top-level names such
as ``kernels`` would collide with users' code and with Hugging Face's
``kernels`` package, which transformers probes for.
"""

import os
from importlib.metadata import PackageNotFoundError, version

# Hugging Face tokenizers' Rust thread pool: once a tokenizer has used it, a tokenizer used from the engine's
# thread and the server's threads can deadlock, and a served request never gets its reply (a 60 s hang of
# tests/app/serve/test_serve_window.py after a test had loaded a tokenizer). tokenizers reads this when it is
# imported, so it is set here, before anything of kvscope imports it; kvscope encodes one prompt at a time, which
# the pool does not speed up. A user's own setting stands.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    __version__ = version("kvscope")
except PackageNotFoundError:    # imported from a checkout that was never installed
    __version__ = "0+unknown"
