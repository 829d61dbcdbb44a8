"""The GPU check's correctness parts, as plain functions: `make gpu-check` calls them and tabulates what they say;
tests/gpu/test_cuda.py runs them under pytest where a GPU is. Each returns an Outcome (passed, one line).

- the compiled Triton kernels (decode split and unsplit and with a padded row, and prefill; plain and with
  window, softcap and sinks) against the torch oracle, fp32 and bf16, two block sizes;
- greedy tokens of the engine on cuda against transformers' own generate on the same weights (fp32, chunked
  prefill), with how many different tokens came out (a model that repeats one token would prove nothing);
- greedy tokens with decode replayed from CUDA graphs (engine/model/cuda_graphs.py) against transformers', as the
  batch shrinks through padded bucket sizes, and how often the graphs served;
- the KV pool sized from --gpu-memory-utilization: it grows by the memory the utilisation adds;
- the sampler on the device (issue 34's part 3): greedy is the first maximum, a seeded row draws the same token
  in a batch of 256 as alone, and what a call costs at batch 256 over SmolLM2's vocabulary.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from kvscope.app.bench.accuracy import transformers_greedy
from kvscope.engine import EngineConfig, LLMEngine, SamplingParams
from kvscope.engine.model import patches
from kvscope.kernels.testing import TOLERANCE, make_query, random_layout

CHUNK = 64      # the exactness run's step budget: long prompts prefill in chunks, as under load


@dataclass(frozen=True)
class Outcome:
    passed: bool
    text: str


def kernels_against_oracle() -> Outcome:
    """Decode and prefill through kvscope's entry points on cuda, which compile the Triton kernels, against the
    torch reference on the same tensors: plain, and with a sliding window, a logit softcap and attention sinks
    together; decode both split (what the rule picks for this small batch) and unsplit, and with a padded row
    (context 0) whose output row must stay as it was. The largest absolute error per dtype, within
    kernels.testing's bounds (doubled: the oracle here is the torch reference in the kernel's dtype, not
    float64)."""
    if os.environ.get("TRITON_INTERPRET"):
        return Outcome(False, "TRITON_INTERPRET is set: the kernels would be interpreted, not compiled")
    from kvscope.kernels import dispatch, reference, triton_decode

    errors = {torch.float32: 0.0, torch.bfloat16: 0.0}
    cases = 0
    splits = set()
    padded_untouched = True
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
            splits.add(triton_decode.split_partition_size(len(lens), 2, tables.shape[1] * block_size, block_size,
                                                          query.device))
            for variant in ({}, {"sliding_window": 24, "softcap": 20.0, "sinks": sinks}):
                decode = (query, kv, tables, context, 0.125)
                expected_decode = reference.paged_decode_attention(*decode, **variant)
                prefill = (prefill_query, kv, tables, cu_seqlens, context, 0.125, 100)
                pairs = [(dispatch.paged_decode_attention(*decode, **variant), expected_decode),
                         (triton_decode.paged_decode_attention(*decode, **variant, partition_size=0), expected_decode),
                         (dispatch.paged_prefill_attention(*prefill, **variant),
                          reference.paged_prefill_attention(*prefill, **variant))]
                for partition in (0, 2 * block_size):
                    padded = _decode_with_a_padded_row(decode, variant, partition)
                    padded_untouched &= bool((padded[-1] == 7.0).all())
                    pairs.append((padded[:-1], expected_decode))
                for out, expected in pairs:
                    error = (out.double() - expected.double()).abs().max().item()
                    errors[dtype] = max(errors[dtype], error if error == error else float("inf"))   # NaN fails
                    cases += 1
    compiled = "kvscope.kernels.triton_ops" in sys.modules
    split_by_rule = 0 not in splits
    passed = compiled and split_by_rule and padded_untouched and all(errors[d] < 2 * TOLERANCE[d] for d in errors)
    return Outcome(passed, f"{cases} cases (decode split by the rule{'' if split_by_rule else ' (NOT split!)'}, "
                           f"unsplit, padded{'' if padded_untouched else ' (padded row WRITTEN!)'}; prefill; plain "
                           f"and window+softcap+sinks){'' if compiled else ' (Triton not used!)'}: max |error| fp32 "
                           f"{errors[torch.float32]:.1e}, bf16 {errors[torch.bfloat16]:.1e}")


def _decode_with_a_padded_row(decode: tuple, variant: dict, partition: int) -> torch.Tensor:
    """The decode batch plus one padded row (context 0, block-table row of zeros, as a captured graph's padding
    holds), into an output buffer of 7s: the padded row of what comes back must still be 7s."""
    from kvscope.kernels import triton_decode

    query, kv, tables, context, scale = decode
    query = torch.cat((query, torch.zeros_like(query[:1])))
    tables = torch.cat((tables, torch.zeros_like(tables[:1])))
    context = torch.cat((context, torch.zeros_like(context[:1])))
    out = torch.full_like(query, 7.0)
    return triton_decode.paged_decode_attention(query, kv, tables, context, scale, **variant, out=out,
                                                partition_size=partition)


def exact_tokens(model, tokenizer, requests: int = 8, tokens: int = 16, seed: int = 0) -> Outcome:
    """``model`` (fp32, on its device: cuda, or the CPU for the check's dry run): the engine's greedy tokens for
    ``requests`` prompts in one batch against transformers' generate of each alone, every step eager
    (``graphs_exact_tokens`` checks the graphs)."""
    lengths = [tokens] * requests
    prompts, expected = _references(model, tokenizer, lengths, longest_prompt=200, seed=seed)
    engine = LLMEngine(EngineConfig(device=model.device.type, dtype="float32", num_blocks=requests * 16,
                                    max_model_len=256, max_num_batched_tokens=CHUNK, enforce_eager=True),
                       model=model, tokenizer=tokenizer)
    equal, distinct = _compare(engine, prompts, lengths, expected)
    del engine
    free_gpu_memory()
    return Outcome(equal == requests and distinct > tokens // 2,
                   f"{equal}/{requests} requests token-identical over {tokens} tokens (fp32, steps of {CHUNK} "
                   f"tokens); {distinct} different tokens")


def graphs_exact_tokens(model, tokenizer, requests: int = 7, seed: int = 1) -> Outcome:
    """``model`` (fp32, on cuda): ``requests`` prompts whose max_tokens all differ, so the decode batch shrinks
    one request at a time through sizes that pad their bucket (7 in 8, 6 in 8, 3 in 4); the engine's tokens
    against transformers' generate of each alone, and the decode steps the graphs replayed."""
    lengths = [6 + 3 * index for index in range(requests)]
    prompts, expected = _references(model, tokenizer, lengths, longest_prompt=120, seed=seed)
    engine = LLMEngine(EngineConfig(device=model.device.type, dtype="float32", num_blocks=requests * 16,
                                    max_model_len=256, max_num_seqs=requests, max_num_batched_tokens=CHUNK,
                                    enforce_eager=False), model=model, tokenizer=tokenizer)
    graphs = engine.runner.graphs
    if graphs is None:
        del engine
        free_gpu_memory()
        return Outcome(False, "no CUDA graphs were captured (the banner says why)")
    served = {"steps": 0, "padded": 0}
    replay, sizes = graphs.replay, graphs.sizes

    def counted(ctx, input_ids, positions):
        served["steps"] += 1
        served["padded"] += input_ids.shape[1] not in sizes
        return replay(ctx, input_ids, positions)

    graphs.replay = counted
    equal, distinct = _compare(engine, prompts, lengths, expected)
    note = graphs.note()
    del engine, graphs
    free_gpu_memory()
    passed = equal == requests and distinct > lengths[0] // 2 and served["padded"] > 0
    return Outcome(passed, f"{equal}/{requests} requests token-identical (fp32, max_tokens {lengths[0]}-"
                           f"{lengths[-1]}); {distinct} different tokens; {served['steps']} decode steps replayed, "
                           f"{served['padded']} of them padded; {note}")


def _references(model, tokenizer, lengths: list[int], longest_prompt: int, seed: int):
    """Random prompts, one per entry of ``lengths``, and transformers' greedy tokens for each alone (``lengths``
    of them), from the stock model whatever engine had it before."""
    patches.restore(model)
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randint(3, longest_prompt))] for _ in lengths]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return prompts, [transformers_greedy(model, prompt, tokens, pad) for prompt, tokens in zip(prompts, lengths)]


def _compare(engine, prompts, lengths: list[int], expected) -> tuple[int, int]:
    """(requests whose greedy tokens equal the reference, different tokens in the references): a model that
    repeats one token would prove nothing."""
    outputs = engine.generate(prompts, [SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                                                       detokenize=False) for tokens in lengths])
    equal = sum(1 for output, reference in zip(outputs, expected) if list(output.token_ids) == reference)
    return equal, len({token for reference in expected for token in reference})


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


SAMPLER_BATCH = 256
SAMPLER_VOCAB = 49_152      # SmolLM2's vocabulary
SAMPLER_KNOBS = {"greedy": SamplingParams(temperature=0.0),
                 "t0.7/p0.95": SamplingParams(temperature=0.7, top_p=0.95),
                 "t1.0": SamplingParams(temperature=1.0)}


def sampler_on_device(device: str = "cuda", batch: int = SAMPLER_BATCH, vocab: int = SAMPLER_VOCAB,
                      repeats: int = 20) -> Outcome:
    """The engine's Sampler over random fp32 logits on ``device``: greedy rows give each row's first maximum; seeded
    random rows draw in the whole batch what each draws alone (its uniforms are keyed by seed, not by the batch);
    the median wall time of a call, the returned ids on the host included (the step's one synchronisation)."""
    from kvscope.engine.model.sampler import Sampler, SampleRow

    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn((batch, vocab), generator=generator) * 3).to(device)
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1      # a tie: the first maximum wins
    times, ok = {}, True
    for name, params in SAMPLER_KNOBS.items():
        rows = [SampleRow(dataclasses.replace(params, seed=row).normalized(), 0, 100 + row) for row in range(batch)]
        sampler = Sampler(0)
        tokens = sampler.sample(logits, rows)
        if params.greedy:
            ok &= tokens == [7, *logits[1:].argmax(dim=-1).tolist()]
        else:
            alone = [sampler.sample(logits[row:row + 1], rows[row:row + 1])[0] for row in range(0, batch, 37)]
            ok &= alone == tokens[::37] and len(set(tokens)) > batch // 2
        spent = []
        for _ in range(repeats):
            start = time.perf_counter()
            sampler.sample(logits, rows)
            spent.append(time.perf_counter() - start)
        times[name] = statistics.median(spent) * 1000
    detail = ", ".join(f"{name} {ms:.2f} ms" for name, ms in times.items())
    return Outcome(ok, f"batch {batch} x {vocab:,} on {device}: greedy = first maxima, seeded rows equal alone and "
                       f"batched{'' if ok else ' (NOT!)'}; a call, ids on the host: {detail}")


def free_gpu_memory() -> None:
    """Return what unreferenced engines and models held to the GPU, so the next part sizes from it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
