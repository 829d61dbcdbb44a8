"""Per-thread scratch buffers and per-step plans of the torch reference kernels.

On CPU attention is bound by moving K/V, and a fresh multi-megabyte allocation per layer costs more in page
faults than the copy itself; and what follows from the block tables alone is the same for every layer of a
step. So scratch tensors are grow-only and reused, and a plan is rebuilt only when its inputs change.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch


class _Workspace(threading.local):
    """Grow-only scratch buffers, one per (name, device, dtype) and per thread, reused across layers and steps."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.device, torch.dtype, bool], torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        # Tensors made under inference_mode cannot be written outside it (and the engine runs inside it while
        # tests and callers may not), so each mode keeps its own buffer.
        key = (name, device, dtype, torch.is_inference_mode_enabled())
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self.buffers[key] = buffer
        return buffer[:numel].view(shape)


class _Plans(threading.local):
    """This thread's last decode and last prefill plan, each with the inputs it was built from."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[tuple, tuple[torch.Tensor, ...], object]] = {}

    def get(self, kind: str, key: tuple, inputs: tuple[torch.Tensor, ...], build: Callable[[], object]):
        entry = self.entries.get(kind)
        if entry is not None and entry[0] == key and all(map(_same, entry[1], inputs)):
            return entry[2]
        plan = build()
        self.entries[kind] = (key, tuple(tensor.clone() for tensor in inputs), plan)
        return plan


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)


_workspace = _Workspace()
_plans = _Plans()
