"""Run one flattened, unpadded forward per step through a transformers model.

The model's own classes do all the math. What kvscope changes on the model (attention routed to the paged
pool, packed linears, fused norms, precision) is listed once, in engine/model/patches.py; this module builds
each step's inputs (engine/model/attention.py's AttentionContext), runs the forward and samples.
"""

from __future__ import annotations

import atexit
import gc
import threading

import torch

from kvscope.engine.batch import BatchItem, ScheduledBatch
from kvscope.engine.config import ConfigError, EngineConfig, SamplingParams
from kvscope.engine.kv_cache_groups import KVCacheGroup, group_layers, layers_per_block
from kvscope.engine.model import patches, threads
from kvscope.engine.model.cuda_graphs import DecodeGraphs
from kvscope.engine.model.layer_kinds import layer_attention_kinds
from kvscope.engine.model.loader import load_model
from kvscope.engine.model.logits_processing import ContextRow, prompt_logprobs
from kvscope.engine.model.memory import size_pool
from kvscope.engine.model.sampler import Sampler, SampleRow
from kvscope.engine.model.step_inputs import StepInputs
from kvscope.engine.outputs import KVLayout
from kvscope.engine.runner import ItemLogprobs, RunnerInfo, RunnerOutput, SampledWithLogprobs, format_banner
from kvscope.kernels import dispatch as kernels

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device cuda was asked for but torch sees no CUDA GPU; use --device cpu, "
                          "or install a CUDA build of torch (see the README)")
    resolved = torch.device(device)
    if resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ConfigError(f"device {device} does not exist: torch sees {torch.cuda.device_count()} CUDA GPU(s), "
                          "numbered from 0")
    return resolved


def cpu_has_native_bf16() -> bool:
    """AMX or AVX512-BF16 make bf16 matmuls about twice as fast as fp32 on CPU."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(dtype: str, device: torch.device, model=None) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    if model is not None:
        return model.dtype
    if device.type == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


class ModelRunner:
    """A runner (engine.runner.Runner) over a transformers model whose attention is ours."""

    def __init__(self, config: EngineConfig, model=None, tokenizer=None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        # Checked here, so a core this process may not use is refused at start-up; pinned at the first step.
        self._cores = threads.chosen_cores(config.cpu_threads_bind) if self.device.type == "cpu" else []
        self.dtype = resolve_dtype(config.dtype, self.device, model)
        if model is None:
            model, tokenizer = load_model(config.model, self.dtype, self.device)
        elif tokenizer is None:
            raise ConfigError("a model passed in needs its tokenizer too: LLMEngine(config, model=m, tokenizer=t)")
        self.bound_cores: list[int] = []       # pinned by the stepping thread, at its first step
        self._stepping_thread: int | None = None
        self.model_name = _display_name(config.model, model)
        self.model = patches.apply(model, self.device, self.dtype)
        self.tokenizer = tokenizer
        text_config = self.model.config.get_text_config()
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.eos_token_ids = _eos_ids(self.model, tokenizer)
        self.block_size = config.block_size
        self.max_model_len = self._resolve_max_model_len(text_config)
        self.layer_windows = tuple(layer_attention_kinds(text_config))
        self.num_layers = text_config.num_hidden_layers
        self.kv_cache_groups = model_kv_cache_groups(self.layer_windows, self.max_model_len, config.allocator)
        self.inputs = StepInputs(self.block_size, self.max_model_len, self.device, self.layer_windows,
                                 self.kv_cache_groups)
        self.num_kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        self.head_dim = (getattr(text_config, "head_dim", None)
                         or text_config.hidden_size // text_config.num_attention_heads)
        element = torch.empty((), dtype=self.dtype).element_size()
        # What one token slot of a block holds: every layer's K/V, or with groups, one group's layers'.
        self.kv_layout = KVLayout(layers_per_block(self.kv_cache_groups, self.num_layers), self.num_kv_heads,
                                  self.head_dim, element)
        self.bytes_per_block = self.kv_layout.bytes_per_token * self.block_size
        self.sampler = Sampler(config.seed)
        self.graphs: DecodeGraphs | None = None     # captured once the pool exists
        self.num_device_blocks, self.num_host_blocks = size_pool(self)
        self.kv_cache = self._allocate_cache(self.num_device_blocks)
        self.host_cache = self._allocate_host_cache()
        self.kv_cache_bytes = self.num_device_blocks * self.bytes_per_block
        self.banner = format_banner(self.num_device_blocks, self.block_size, self.kv_cache_bytes,
                                    self.max_model_len, str(self.device), self.kv_cache_groups,
                                    config.max_num_batched_tokens)
        self.graphs, graphs_note = self._capture_graphs()
        if graphs_note:
            self.banner += "\n" + graphs_note
        self.info = RunnerInfo(
            model_name=self.model_name, device=str(self.device), dtype=str(self.dtype).removeprefix("torch."),
            block_size=self.block_size, num_device_blocks=self.num_device_blocks,
            num_host_blocks=self.num_host_blocks, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids, kv_cache_bytes=self.kv_cache_bytes, banner=self.banner,
            sampling_defaults=sampling_defaults(self.model.generation_config), kv_layout=self.kv_layout,
            kv_cache_groups=self.kv_cache_groups, max_num_batched_tokens=config.max_num_batched_tokens)
        _freeze_heap()

    @torch.inference_mode()
    def _capture_graphs(self) -> tuple[DecodeGraphs | None, str]:
        """Decode's CUDA graphs (engine/model/cuda_graphs.py), on CUDA for a model with one KV-cache group, and a
        line for the banner. A model whose forward cannot be captured still runs, eagerly, and the line says why."""
        if not self._graphs_wanted():
            return None, ""
        graphs = DecodeGraphs(self.model, self.kv_cache, self.layer_windows, self.config.max_num_seqs,
                              self.max_model_len, self.block_size)
        try:
            graphs.capture()
        except RuntimeError as exc:     # torch ends the capture on the way out; the graphs taken are dropped
            reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            return None, f"Decode CUDA graphs could not be captured, so decode runs eagerly: {reason}"
        return graphs, graphs.note()

    def _graphs_wanted(self) -> bool:
        return self.device.type == "cuda" and not self.config.enforce_eager and len(self.kv_cache_groups) <= 1

    def _resolve_max_model_len(self, text_config) -> int:
        limit = getattr(text_config, "max_position_embeddings", None) or 2048
        asked = self.config.max_model_len
        if asked is not None and asked > limit:
            raise ConfigError(f"max_model_len {asked} exceeds the model's limit of {limit} positions; "
                              f"use --max-model-len {limit} or less")
        return asked or limit

    def _allocate_cache(self, num_blocks: int) -> torch.Tensor:
        shape = (self.kv_layout.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return kernels.kv_pool_zeros(shape, self.dtype, self.device)

    def _allocate_host_cache(self) -> torch.Tensor | None:
        if not self.num_host_blocks:
            return None
        shape = (self.kv_layout.num_layers, 2, self.num_host_blocks, self.block_size, self.num_kv_heads,
                 self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, pin_memory=self.device.type == "cuda")

    def profile_forward_peak_bytes(self) -> int:
        """Peak CUDA memory of one forward over max_num_batched_tokens tokens, weights included."""
        num_tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        num_blocks = -(-num_tokens // self.block_size)
        probe = BatchItem(seq_id=-1, request_id="profile", token_ids=(0,) * num_tokens, start_pos=0,
                          block_table=tuple(range(num_blocks)), sample_indices=(0,),
                          params=SamplingParams(temperature=0.0),
                          # Every group in the same scratch blocks: what is measured is memory, not values.
                          group_tables=(tuple(range(num_blocks)),) * len(self.kv_cache_groups))
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._run(ScheduledBatch(items=(probe,)), self._allocate_cache(num_blocks))  # a scratch pool, dropped here
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        return peak

    @classmethod
    def built_apart(cls, config: EngineConfig, model=None, tokenizer=None) -> ModelRunner:
        """A runner built on a thread that ends with the build, so that the thread stepping it is the only one
        holding an OpenMP team (engine/model/threads.py)."""
        return threads.built_apart(lambda: cls(config, model=model, tokenizer=tokenizer))

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        if self._stepping_thread != threading.get_ident():
            self._stepping_thread = threading.get_ident()
            self.bound_cores = threads.pin(self._cores)
        self._move_blocks(batch)
        return self._run(batch, self.kv_cache)

    @torch.inference_mode()
    def _run(self, batch: ScheduledBatch, kv_cache: torch.Tensor) -> RunnerOutput:
        """The forward and the sampling, over ``kv_cache``: the pool, or profiling's scratch pool."""
        if not batch.items:
            return []
        prefill = [i for i, item in enumerate(batch.items) if len(item.token_ids) > 1]
        decode = [i for i, item in enumerate(batch.items) if len(item.token_ids) == 1]
        order = prefill + decode
        items = [batch.items[i] for i in order]
        ctx, input_ids, positions, logit_rows = self._prepare(items, len(prefill), kv_cache)
        num_sampled_rows = logit_rows.shape[0]
        prompt_spans = _prompt_logprob_spans(items[:len(prefill)])
        if prompt_spans:    # the LM head over those prompts too, only because they asked
            logit_rows = torch.cat([logit_rows, torch.cat([torch.arange(start, start + len(item.token_ids))
                                                           for _, start, item in prompt_spans]).to(self.device)])
        if self.graphs is not None and not prompt_spans and self.graphs.takes(ctx, input_ids, logit_rows):
            hidden_logits = self.graphs.replay(ctx, input_ids, positions)
        else:
            hidden_logits = self.model(input_ids=input_ids, position_ids=positions, logits_to_keep=logit_rows,
                                       kvscope_ctx=ctx, use_cache=False).logits[0]
        logprobs: dict[int, ItemLogprobs] = {}
        if prompt_spans:
            logprobs = self._prompt_logprobs(hidden_logits[num_sampled_rows:], prompt_spans)
            hidden_logits = hidden_logits[:num_sampled_rows]
        per_item = self._sample(items, hidden_logits, logprobs)
        results: list[list[int] | None] = [None] * len(order)
        for slot, index in enumerate(order):
            results[index] = per_item[slot]
        if not logprobs:
            return results
        return SampledWithLogprobs(results, {order[slot]: found for slot, found in logprobs.items()})

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, spans) -> dict[int, ItemLogprobs]:
        found = {}
        offset = 0
        for slot, _, item in spans:
            rows = logits[offset:offset + len(item.token_ids)]
            offset += len(item.token_ids)
            start, entries = prompt_logprobs(rows, item.token_ids, item.start_pos, item.sampling,
                                             item.params.prompt_logprobs)
            found[slot] = ItemLogprobs(prompt_start=start, prompt=entries)
        return found

    def _move_blocks(self, batch: ScheduledBatch) -> None:
        if batch.blocks_to_swap_out:
            src, dst = zip(*batch.blocks_to_swap_out)
            kernels.swap_blocks(self.kv_cache, self.host_cache, self._ids(src), self._ids(dst, "cpu"))
        if batch.blocks_to_swap_in:
            src, dst = zip(*batch.blocks_to_swap_in)
            kernels.swap_blocks(self.host_cache, self.kv_cache, self._ids(src, "cpu"), self._ids(dst))
        if batch.blocks_to_copy:
            src, dst = zip(*batch.blocks_to_copy)
            kernels.copy_blocks(self.kv_cache, self._ids(src), self._ids(dst))

    def _ids(self, values, device=None) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device or self.device)

    def _prepare(self, items: list[BatchItem], num_prefill: int, kv_cache: torch.Tensor):
        return self.inputs.prepare(items, num_prefill, kv_cache)

    def _sample(self, items: list[BatchItem], logits: torch.Tensor,
                logprobs: dict[int, ItemLogprobs]) -> list[list[int] | None]:
        """A token per sample index of each item; the log-probabilities of the sampled tokens of the items that
        ask go into ``logprobs`` (by item slot)."""
        rows, owners, contexts = [], [], []
        for slot, item in enumerate(i for i in items if i.sample_indices):
            for sample_index in item.sample_indices:
                if item.sampling is not None:
                    contexts.append(ContextRow(len(rows), item.sampling, sample_index))
                rows.append(SampleRow(item.params, sample_index, item.context_len - 1))
                owners.append(slot)
        if len(owners) > logits.shape[0]:   # an n > 1 prompt completed: its samples draw from one row
            logits = logits[torch.tensor(owners, dtype=torch.int64, device=logits.device)]
        tokens, sampled_logprobs = self.sampler.sample_rows(logits, rows, contexts) if rows else ([], {})
        grouped: list[list[int] | None] = []
        cursor = 0
        for slot, item in enumerate(items):
            drawn = tokens[cursor:cursor + len(item.sample_indices)]
            if sampled_logprobs and item.sample_indices and cursor in sampled_logprobs:
                found = tuple(sampled_logprobs[row] for row in range(cursor, cursor + len(drawn)))
                logprobs[slot] = logprobs.get(slot, ItemLogprobs())._replace(sampled=found)
            cursor += len(item.sample_indices)
            grouped.append(None if any(t is None for t in drawn) else list(drawn))
        return grouped


def _prompt_logprob_spans(prefill: list[BatchItem]) -> list[tuple[int, int, BatchItem]]:
    """(slot, first flattened token, item) of the prefill chunks whose request asks for prompt log-probabilities."""
    spans, start = [], 0
    for slot, item in enumerate(prefill):
        if item.sampling is not None and item.params.prompt_logprobs is not None:
            spans.append((slot, start, item))
        start += len(item.token_ids)
    return spans


def _freeze_heap() -> None:
    """Keep the cyclic garbage collector off the objects that live as long as the model.

    With torch, transformers and a model loaded the heap holds several hundred thousand objects, and a
    full collection walks them all holding the GIL: measured at 0.1-0.4 s here, a stall of every step
    it lands in (and of the window drawing it). So once the model is in place, one last full collection
    frees what an earlier runner left in cycles (unfreeze first, so that can happen), and the survivors
    are frozen: later collections walk only what was made since. vLLM does the same after loading.
    The heap is unfrozen at exit, so that interpreter shutdown still finalises everything (extension
    modules such as triton's report frozen objects as leaks).
    """
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)


def model_kv_cache_groups(layer_windows, max_model_len: int, allocator: str) -> tuple[KVCacheGroup, ...]:
    """The model's layers grouped by attention kind (engine/kv_cache_groups.py), from each layer's window
    (engine/model/layer_kinds.py). A window of max_model_len or more sees the whole of any context, so its
    layer keeps every block, as a full one; the contiguous allocator, the pre-paging baseline, keeps one
    group whatever the layers are."""
    if allocator != "paged":
        return ()
    return group_layers([window if window is not None and window < max_model_len else None
                         for window in layer_windows])


def sampling_defaults(generation_config) -> tuple[tuple[str, float | int], ...]:
    """The sampling a model's generation_config asks for: nothing (greedy) unless it sets do_sample, else its
    temperature, top_p and top_k wherever it sets them."""
    if generation_config is None or not getattr(generation_config, "do_sample", False):
        return ()
    found = []
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(generation_config, name, None)
        if value is not None:
            found.append((name, value if name != "top_k" else int(value) or -1))
    return tuple(found)


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids = set()
    for source in (model.generation_config.eos_token_id if model.generation_config else None,
                   model.config.eos_token_id, tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return frozenset(ids)


def _display_name(requested: str, model) -> str:
    if requested == "default":
        return "SmolLM2-135M-Instruct"
    return str(getattr(model.config, "_name_or_path", "") or requested).rstrip("/").split("/")[-1] or requested
