"""The kernels' entry points: each picks C++ for CPU, Triton for CUDA, with a torch reference under both.

``kernels/`` is a namespace portion, not a regular package: it has no ``__init__.py``, so a process started in
the checkout, where the working directory is on ``sys.path``, never takes this folder for Hugging Face's
``kernels`` distribution (which transformers imports when installed). A regular package in site-packages wins
over a folder without ``__init__.py``; ``kvscope.kernels`` is still reached through the ``kvscope`` package.

Each public function dispatches on where its tensors live: Triton when they are on CUDA and triton is
installed; on CPU, ``kernels.cpu``, whose C++ kernels are built on first use and which falls back to the torch
reference (``kernels.reference``) without a compiler or for dtypes they do not cover. ``kernels.triton_ops`` is
imported only on the CUDA path, so CPU users never pay for (or depend on) importing triton. This package imports
neither ``engine`` nor ``app``.

The torch reference (``kernels/reference.py``) is the contract: its functions carry the typed signatures and
say what each argument holds; every backend, and the entry points here, take the same arguments in the same order.

``swap_blocks`` moves blocks between the device pool and the host pool, which no GPU kernel can do; both paths
use the same gather → one bus transfer → scatter in torch.
"""

from __future__ import annotations

import functools
import importlib.util
from types import ModuleType

import torch

from kvscope.kernels import cpu
from kvscope.kernels.reference import BlockIds, clear_workspace, swap_blocks

__all__ = [
    "clear_workspace",
    "copy_blocks",
    "kv_pool_zeros",
    "paged_decode_attention",
    "paged_prefill_attention",
    "store_kv",
    "swap_blocks",
    "triton_available",
]


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _backend(tensor: torch.Tensor) -> ModuleType:
    if tensor.is_cuda and triton_available():
        from kvscope.kernels import triton_ops

        return triton_ops
    return cpu


def store_kv(key, value, kv_layer, slot_mapping) -> None:
    _backend(kv_layer).store_kv(key, value, kv_layer, slot_mapping)


def paged_decode_attention(query, kv_layer, block_tables, context_lens, scale, sliding_window: int | None = None,
                           softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    return _backend(query).paged_decode_attention(query, kv_layer, block_tables, context_lens, scale,
                                                  sliding_window, softcap, sinks)


def paged_prefill_attention(query, kv_layer, block_tables, cu_seqlens_q, context_lens, scale,
                            max_query_len: int | None = None, sliding_window: int | None = None,
                            softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    return _backend(query).paged_prefill_attention(query, kv_layer, block_tables, cu_seqlens_q, context_lens,
                                                   scale, max_query_len, sliding_window, softcap, sinks)


def copy_blocks(kv_cache: torch.Tensor, src: BlockIds, dst: BlockIds) -> None:
    _backend(kv_cache).copy_blocks(kv_cache, src, dst)


def kv_pool_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV pool; on CPU backed by huge pages where the OS allows (see ``cpu.huge_page_zeros``)."""
    if torch.device(device).type == "cpu":
        return cpu.huge_page_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)
