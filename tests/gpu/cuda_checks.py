"""The GPU check's correctness parts, as plain functions: `make gpu-check` calls them and tabulates what they say;
tests/gpu/test_cuda.py runs them under pytest where a GPU is. Each returns an Outcome (passed, one line).

- the compiled Triton kernels (decode and prefill, plain and with window, softcap and sinks) against the torch
  oracle, fp32 and bf16, two block sizes;
- greedy tokens of the engine on cuda against transformers' own generate on the same weights (fp32, chunked
  prefill), with how many different tokens came out (a model that repeats one token would prove nothing);
- the KV pool sized from --gpu-memory-utilization: it grows by the memory the utilisation adds.
"""

from __future__ import annotations

import gc
import os
import random
import sys
from dataclasses import dataclass

import torch

from kvscope.app.bench.accuracy import transformers_greedy
from kvscope.engine import EngineConfig, LLMEngine, SamplingParams
from kvscope.kernels.testing import TOLERANCE, make_query, random_layout

CHUNK = 64      # the exactness run's step budget: long prompts prefill in chunks, as under load


@dataclass(frozen=True)
class Outcome:
    passed: bool
    text: str


def kernels_against_oracle() -> Outcome:
    """Decode and prefill through kvscope's entry points on cuda, which compile the Triton kernels, against the
    torch reference on the same tensors: plain, and with a sliding window, a logit softcap and attention sinks
    together; the largest absolute error per dtype, within kernels.testing's bounds (doubled: the oracle here is
    the torch reference in the kernel's dtype, not float64)."""
    if os.environ.get("TRITON_INTERPRET"):
        return Outcome(False, "TRITON_INTERPRET is set: the kernels would be interpreted, not compiled")
    from kvscope.kernels import dispatch, reference

    errors = {torch.float32: 0.0, torch.bfloat16: 0.0}
    cases = 0
    for dtype in errors:
        for block_size in (16, 32):
            gen = torch.Generator().manual_seed(block_size)
            lens = [1, 17, 64, 300]
            layout = random_layout(lens, block_size, 2, 64, dtype, gen, poison_unused=False)
            kv, tables = layout.kv_layer.cuda(), layout.block_tables.cuda()
            context = layout.context_lens.cuda()
            cu_seqlens = torch.tensor([0, 1, 9, 49, 149], dtype=torch.int32, device="cuda")
            query = make_query(len(lens), 8, 64, dtype, gen).cuda()
            prefill_query = make_query(149, 8, 64, dtype, gen).cuda()
            sinks = (torch.randn(8, generator=gen) * 4).cuda()
            for variant in ({}, {"sliding_window": 24, "softcap": 20.0, "sinks": sinks}):
                decode = (query, kv, tables, context, 0.125)
                prefill = (prefill_query, kv, tables, cu_seqlens, context, 0.125, 100)
                for out, expected in (
                        (dispatch.paged_decode_attention(*decode, **variant),
                         reference.paged_decode_attention(*decode, **variant)),
                        (dispatch.paged_prefill_attention(*prefill, **variant),
                         reference.paged_prefill_attention(*prefill, **variant))):
                    error = (out.double() - expected.double()).abs().max().item()
                    errors[dtype] = max(errors[dtype], error if error == error else float("inf"))   # NaN fails
                    cases += 1
    compiled = "kvscope.kernels.triton_ops" in sys.modules
    passed = compiled and all(errors[d] < 2 * TOLERANCE[d] for d in errors)
    return Outcome(passed, f"{cases} cases (decode, prefill; plain and window+softcap+sinks)"
                           f"{'' if compiled else ' (Triton not used!)'}: max |error| fp32 "
                           f"{errors[torch.float32]:.1e}, bf16 {errors[torch.bfloat16]:.1e}")


def exact_tokens(model, tokenizer, requests: int = 8, tokens: int = 16, seed: int = 0) -> Outcome:
    """``model`` (fp32, on its device: cuda, or the CPU for the check's dry run): the engine's greedy tokens for
    ``requests`` prompts in one batch against transformers' generate of each alone."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randint(3, 200))] for _ in range(requests)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    expected = [transformers_greedy(model, prompt, tokens, pad) for prompt in prompts]
    engine = LLMEngine(EngineConfig(device=model.device.type, dtype="float32", num_blocks=requests * 16,
                                    max_model_len=256,
                                    max_num_batched_tokens=CHUNK), model=model, tokenizer=tokenizer)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                                                      detokenize=False))
    equal = sum(1 for output, reference in zip(outputs, expected) if list(output.token_ids) == reference)
    distinct = len({token for reference in expected for token in reference})
    del engine
    free_gpu_memory()
    return Outcome(equal == requests and distinct > tokens // 2,
                   f"{equal}/{requests} requests token-identical over {tokens} tokens (fp32, steps of {CHUNK} "
                   f"tokens); {distinct} different tokens")


def pool_sizing(model, tokenizer, utilisations: tuple[float, float] = (0.3, 0.6)) -> Outcome:
    """Engines at two --gpu-memory-utilization values: the larger's pool holds what the extra share of the GPU's
    memory holds, within 1% of the GPU (the forward's profiled peak is the same for both)."""
    total = torch.cuda.get_device_properties(0).total_memory
    pools = []
    for utilisation in utilisations:
        engine = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", gpu_memory_utilization=utilisation,
                                        max_model_len=2048), model=model, tokenizer=tokenizer)
        pools.append((engine.info.num_device_blocks, engine.info.kv_cache_bytes))
        del engine      # its pool goes before the next one is sized
        free_gpu_memory()
    (low_blocks, low_bytes), (high_blocks, high_bytes) = pools
    expected_growth = (utilisations[1] - utilisations[0]) * total
    passed = 0 < low_blocks < high_blocks and abs((high_bytes - low_bytes) - expected_growth) < 0.01 * total
    gib = 2 ** 30
    return Outcome(passed, f"{utilisations[0]}: {low_blocks:,} blocks ({low_bytes / gib:.1f} GiB), "
                           f"{utilisations[1]}: {high_blocks:,} ({high_bytes / gib:.1f} GiB); the difference "
                           f"{(high_bytes - low_bytes) / gib:.1f} GiB, expected {expected_growth / gib:.1f}")


def free_gpu_memory() -> None:
    """Return what unreferenced engines and models held to the GPU, so the next part sizes from it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
