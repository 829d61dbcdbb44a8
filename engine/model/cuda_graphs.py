"""Decode steps replayed from CUDA graphs, one per batch-size bucket, as vLLM does.

Why: on the first GPU run (docs/performance.md, "On a GPU"), a SmolLM2 decode step launched 1,288 kernels one by
one from Python and the GPU was busy 7-26% of the step: the host launching the forward was the bottleneck, not
the GPU. A graph launches the whole forward at once.

How: the forward is captured once per bucket (1, 2, 4, then every 8 up to max_num_seqs) over persistent device
buffers: token ids, positions, slot mapping, context lengths and a block table as wide as max_model_len needs.
A decode step copies its inputs (built as for an eager step, engine/model/step_inputs.py) into the first rows
of the smallest bucket that holds it, and replays that bucket's graph. Padded rows write nowhere: their slot is
-1, which the store kernel skips, and their context is 0, which the decode kernel leaves alone (both tested
compiled by the GPU check). Their logits are never read. Prefill and mixed steps, and models with several
KV-cache groups, stay eager. `--enforce-eager` is vLLM's name for the switch.

What ran where: this was written in a session whose GPU loan was paused before the graphs could run on it, so
they have run only as stand-ins on the CPU (tests/support/graph_stand_in.py: the buffers, the buckets, padded rows
and the tokens, against transformers). A real capture and replay have not run yet, so graphs stay off by default
(`enforce_eager` is on) until `make gpu-check`, whose rows "exact tokens, decode from CUDA graphs" and "decode
step ..., graphs" exercise them, has passed on a GPU.

The graph's decode attention sees the full-width block table, so the split-KV rule (kernels/triton_decode.py)
decides by max_model_len rather than by the step's longest context: the tokens are the same in fp32, and in bf16
they can differ from an eager step's by the split's rounding.
"""

from __future__ import annotations

import time

import torch

from kvscope.engine.model.attention import AttentionContext

PAD_SLOT = -1


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, then multiples of 8, up to the first that holds max_num_seqs."""
    sizes = [1, 2, 4, *range(8, max_num_seqs + 8, 8)]
    return sizes[:next(index for index, size in enumerate(sizes) if size >= max_num_seqs) + 1]


class DecodeGraphs:
    """The captured graphs of one model over one KV pool, and the buffers they read."""

    def __init__(self, model, kv_cache: torch.Tensor, layer_windows: tuple[int | None, ...], max_num_seqs: int,
                 max_model_len: int, block_size: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.layer_windows = layer_windows
        self.sizes = bucket_sizes(max_num_seqs)
        device, most = kv_cache.device, self.sizes[-1]
        self.width = -(-max_model_len // block_size)
        self.input_ids = torch.zeros((1, most), dtype=torch.int64, device=device)
        self.positions = torch.zeros((1, most), dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((most,), PAD_SLOT, dtype=torch.int64, device=device)
        self.context_lens = torch.zeros((most,), dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((most, self.width), dtype=torch.int32, device=device)
        self.logit_rows = torch.arange(most, dtype=torch.int64, device=device)
        # One logits buffer for every graph (only the graph replayed last has valid logits): a graph's own output
        # would hold its memory for good, about 2 GiB over a 1B Llama's 35 buckets.
        self.logits: torch.Tensor | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_s = 0.0

    def capture(self) -> None:
        """Every bucket's graph, largest first, all in one memory pool (a smaller graph reuses the larger's
        memory). Each forward runs once before its capture, so Triton compiles outside the graph."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.kv_cache.device)
        for size in reversed(self.sizes):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                warm = self._forward(size)
            torch.cuda.current_stream().wait_stream(side)
            if self.logits is None:     # the largest bucket comes first
                self.logits = torch.empty((size, warm.shape[1]), dtype=warm.dtype, device=warm.device)
            del warm
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[:size].copy_(self._forward(size))
            self.graphs[size] = graph
        torch.cuda.synchronize(self.kv_cache.device)
        self.capture_s = time.perf_counter() - start

    def _forward(self, size: int) -> torch.Tensor:
        ctx = AttentionContext(
            kv_cache=self.kv_cache, slot_mapping=self.slot_mapping[:size], num_prefill_tokens=0,
            prefill_block_tables=None, prefill_cu_seqlens=None, prefill_context_lens=None, prefill_max_query_len=0,
            decode_block_tables=self.block_tables[:size], decode_context_lens=self.context_lens[:size],
            layer_windows=self.layer_windows)
        return self.model(input_ids=self.input_ids[:, :size], position_ids=self.positions[:, :size],
                          logits_to_keep=self.logit_rows[:size], kvscope_ctx=ctx, use_cache=False).logits[0]

    def takes(self, ctx: AttentionContext, input_ids: torch.Tensor, logit_rows: torch.Tensor) -> bool:
        """Whether a step with these inputs can be replayed: decodes only, one KV-cache group, the graphs' pool,
        at most the largest bucket, every row sampled, and tables no wider than the buffer."""
        count = input_ids.shape[1]
        return (ctx.num_prefill_tokens == 0 and ctx.layer_contexts is None and ctx.kv_cache is self.kv_cache
                and 0 < count <= self.sizes[-1] and logit_rows.shape[0] == count
                and ctx.decode_block_tables.shape[1] <= self.width)

    def replay(self, ctx: AttentionContext, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The logits [rows, vocab] of a step ``takes`` accepted; valid until the next replay."""
        count = input_ids.shape[1]
        size = next(size for size in self.sizes if size >= count)
        self.input_ids[:, :count].copy_(input_ids)
        self.positions[:, :count].copy_(positions)
        self.slot_mapping[:count].copy_(ctx.slot_mapping)
        self.context_lens[:count].copy_(ctx.decode_context_lens)
        self.block_tables[:count, :ctx.decode_block_tables.shape[1]].copy_(ctx.decode_block_tables)
        if count < size:    # a padded row keeps whatever ids and table it had: with context 0 none is read
            self.slot_mapping[count:size].fill_(PAD_SLOT)
            self.context_lens[count:size].zero_()
        self.graphs[size].replay()
        return self.logits[:count]

    def note(self) -> str:
        return (f"Decode CUDA graphs: {len(self.graphs)} batch sizes ({self.sizes[0]}-{self.sizes[-1]}) captured in "
                f"{self.capture_s:.1f} s")
