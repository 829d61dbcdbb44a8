"""CPU, RAM and this process's RSS (psutil); GPU use and memory (NVML) only when an NVIDIA GPU is there."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import psutil

from kvscope.app.widgets.formatting import bar, mebibytes
from kvscope.app.widgets.line_panel import LinePanel

REFRESH_S = 1.0


@dataclass(frozen=True)
class SystemSample:
    cpu_percent: float
    ram_used: int
    ram_total: int
    process_rss: int
    gpus: tuple[tuple[str, float, int, int], ...]   # (name, utilisation %, memory used, memory total)
    gpu_note: str | None = None                     # why there are no GPU figures


class SystemSampler:
    """Reads the machine's figures; NVML is opened once and only if an NVIDIA driver answers."""

    def __init__(self) -> None:
        self._process = psutil.Process(os.getpid())
        self._process.cpu_percent(None)
        psutil.cpu_percent(None)
        self._nvml = None
        self._gpu_note = "no NVIDIA GPU: GPU figures off"
        try:
            import pynvml

            pynvml.nvmlInit()
            if pynvml.nvmlDeviceGetCount():
                self._nvml = pynvml
        except Exception:  # no driver, no library, no device: all mean "no GPU figures"
            self._nvml = None

    def sample(self) -> SystemSample:
        memory = psutil.virtual_memory()
        return SystemSample(psutil.cpu_percent(None), memory.total - memory.available, memory.total,
                            self._process.memory_info().rss, self._gpus(),
                            None if self._nvml else self._gpu_note)

    def _gpus(self) -> tuple:
        if self._nvml is None:
            return ()
        nvml = self._nvml
        found = []
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                name = nvml.nvmlDeviceGetName(handle)
                utilisation = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                found.append((name if isinstance(name, str) else name.decode(), float(utilisation),
                              int(memory.used), int(memory.total)))
        except Exception:
            return ()
        return tuple(found)


def describe_sample(sample: SystemSample) -> str:
    lines = [
        f"CPU  {sample.cpu_percent:5.1f}% [$accent]{bar(sample.cpu_percent / 100, 10)}[/]",
        f"RAM  {mebibytes(sample.ram_used)} / {mebibytes(sample.ram_total)}",
        f"RSS  {mebibytes(sample.process_rss)} [dim](kvscope)[/]",
    ]
    for name, utilisation, used, total in sample.gpus:
        lines.append(f"GPU  {utilisation:5.1f}% [$accent]{bar(utilisation / 100, 10)}[/] "
                     f"{mebibytes(used)} / {mebibytes(total)} [dim]{name}[/]")
    if sample.gpu_note:
        lines.append(f"[dim]{sample.gpu_note}[/]")
    return "\n".join(lines)


class SystemPanel(LinePanel):
    """Sampled once a second. The live view calls ``refresh_if_due`` from its frame timer, so the new
    figures are drawn in the same repaint pass as a frame rather than in one of their own."""

    def __init__(self, sampler: SystemSampler | None = None, *, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__("", id=id, classes=classes)
        self.sampler = sampler or SystemSampler()
        self._sampled_at = float("-inf")

    def on_mount(self) -> None:
        self.refresh_if_due(time.monotonic())

    def refresh_if_due(self, now: float, max_age: float = REFRESH_S) -> None:
        if now - self._sampled_at >= max_age:
            self._sampled_at = now
            self.show(describe_sample(self.sampler.sample()))
