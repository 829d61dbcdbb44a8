"""How many KV blocks fit: from --num-blocks, --kv-cache-memory (CPU) or a profiled forward (CUDA)."""

from __future__ import annotations

import psutil
import torch

from kvscope.engine.kv_cache_groups import blocks_per_sequence
from kvscope.engine.model.loader import ModelError

MIB = 1024 * 1024
# With no --kv-cache-memory, a CPU pool takes 10% of physical RAM, at most 2 GiB:
# room for ~46k tokens of SmolLM2 in fp32 while leaving the machine usable.
CPU_DEFAULT_FRACTION = 0.10
CPU_DEFAULT_CAP = 2 * 1024 * MIB


def default_cpu_kv_cache_memory() -> int:
    return int(min(CPU_DEFAULT_CAP, psutil.virtual_memory().total * CPU_DEFAULT_FRACTION))


def size_pool(runner) -> tuple[int, int]:
    """(device blocks, host blocks) for this runner's model and config."""
    config = runner.config
    per_block = runner.bytes_per_block
    host = (config.swap_space or 0) // per_block if config.preemption_mode == "swap" else 0
    if config.num_blocks is not None:
        return config.num_blocks, host
    # One request of max_model_len must fit, holding in each group what that group holds of it.
    min_blocks = blocks_per_sequence(runner.kv_cache_groups, runner.max_model_len, runner.block_size,
                                     config.max_num_batched_tokens)
    if runner.device.type == "cuda" and config.kv_cache_memory is None:
        device_blocks = _cuda_blocks(runner)
        where = (f"gpu_memory_utilization {config.gpu_memory_utilization:.2f} of "
                 f"{torch.cuda.get_device_properties(runner.device).total_memory / MIB:,.0f} MiB")
        fix = "raise --gpu-memory-utilization, lower --max-model-len, or pick a smaller model"
    else:
        # A budget given on a GPU is the pool's, as vLLM's kv_cache_memory_bytes: gpu_memory_utilization is unused.
        budget = config.kv_cache_memory or default_cpu_kv_cache_memory()
        if runner.device.type != "cuda":
            _check_host_fits(runner, budget)
        device_blocks = budget // per_block
        where = f"kv_cache_memory {budget / MIB:,.0f} MiB"
        fix = "raise --kv-cache-memory or lower --max-model-len"
    if device_blocks < min_blocks:
        raise ModelError(f"{where} holds {max(device_blocks, 0)} KV blocks but one request of max_model_len "
                         f"{runner.max_model_len} needs {min_blocks}; {fix}")
    return device_blocks, host


def _check_host_fits(runner, pool_bytes: int) -> None:
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    available = psutil.virtual_memory().available
    if pool_bytes > available:
        raise ModelError(f"a KV cache of {pool_bytes / MIB:,.0f} MiB does not fit beside the "
                         f"{weights / MIB:,.0f} MiB of weights in the {available / MIB:,.0f} MiB of free RAM; "
                         "lower --kv-cache-memory")


def _cuda_blocks(runner) -> int:
    """Profile one forward of max_num_batched_tokens tokens and give the rest of the budget to the pool."""
    free, total = torch.cuda.mem_get_info(runner.device)
    used_by_others = total - free - torch.cuda.memory_reserved(runner.device)
    peak = runner.profile_forward_peak_bytes()
    budget = total * runner.config.gpu_memory_utilization - used_by_others - peak
    return int(budget // runner.bytes_per_block)
