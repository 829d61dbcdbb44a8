"""CUDA graphs' stand-in where no GPU is (engine/model/cuda_graphs.py): a "graph" whose replay runs the captured
forward again, into the output buffer a capture would have left. What the graphs' buffers feed that forward is
what a real graph would read, so the buffers' plumbing is tested on the CPU; the capture itself only on a GPU
(tests/gpu/)."""

from __future__ import annotations

import torch

from kvscope.engine.model.cuda_graphs import DecodeGraphs


class RerunGraph:
    def __init__(self, graphs: DecodeGraphs, size: int) -> None:
        self.graphs, self.size = graphs, size
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.graphs.logits[:self.size].copy_(self.graphs._forward(self.size))


def capture_on_cpu(graphs: DecodeGraphs) -> None:
    """Stand-ins for every bucket and the shared logits buffer, as a capture leaves them (nothing run: on the CPU
    a padded row's slot -1 has no store kernel to skip it, see ``skip_padded_slots``)."""
    graphs.logits = torch.empty((graphs.sizes[-1], graphs.model.get_output_embeddings().weight.shape[0]))
    for size in graphs.sizes:
        graphs.graphs[size] = RerunGraph(graphs, size)


def graphs_on_cpu(monkeypatch) -> list[DecodeGraphs]:
    """Every ModelRunner built from now on captures stand-ins on the CPU; the DecodeGraphs are listed here."""
    captured = []

    def capture(self):
        capture_on_cpu(self)
        captured.append(self)

    monkeypatch.setattr(DecodeGraphs, "capture", capture)
    monkeypatch.setattr("kvscope.engine.model.model_runner.ModelRunner._graphs_wanted", lambda self: True)
    return captured


def skip_padded_slots(monkeypatch) -> None:
    """The CPU's store (the torch reference's) made to skip slot -1 as the Triton kernel does, so padded rows can
    run on the CPU."""
    from kvscope.kernels import cpu

    stock = cpu.store_kv

    def store_kv(key, value, kv_layer, slot_mapping):
        kept = slot_mapping >= 0
        stock(key[kept], value[kept], kv_layer, slot_mapping[kept])

    monkeypatch.setattr(cpu, "store_kv", store_kv)
