"""kvscope: watch a real paged-attention LLM engine work, live in your terminal.

The repository root is this package. pyproject.toml maps it with setuptools'
``package-dir``, so the folders beside this file install as ``kvscope.app``,
``kvscope.engine``, ``kvscope.kernels`` and ``kvscope.themes``, and ``kvscope``
is the only name kvscope puts into site-packages. Generic top-level names such
as ``kernels`` would collide with users' code and with Hugging Face's
``kernels`` package, which transformers probes for.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvscope")
except PackageNotFoundError:    # imported from a checkout that was never installed
    __version__ = "0+unknown"
