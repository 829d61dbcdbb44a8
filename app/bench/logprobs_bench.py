"""`kvscope bench logprobs`: what log-probabilities cost, beside how close they are to transformers'.

A sampled token's log-probabilities come from logits the sampler already holds; prompt log-probabilities
run the LM head over every prompt token instead of the last one, and such a prompt skips the prefix cache.
The same greedy requests run three ways on one engine, in the order none, sampled, prompt, prompt, sampled,
none per repeat, so drift in the machine's load falls on every side; the prefix cache is off for all three,
so that only the log-probabilities differ. Accuracy of the same run: each side's tokens against the side
without log-probabilities, and the first request's prompt log-probabilities against transformers' own
log-softmax over the same weights.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter

from kvscope.app.bench.metrics import percentile
from kvscope.app.bench.report import titled_table
from kvscope.engine import SamplingParams

TOP = 5     # log-probabilities asked per position, as lm-evaluation-harness and most clients ask for a few
SIDES = {"none": {}, "sampled": {"logprobs": TOP}, "prompt": {"prompt_logprobs": TOP, "logprobs": TOP}}
ORDER = ("none", "sampled", "prompt", "prompt", "sampled", "none")


@dataclass
class Side:
    name: str
    seconds: float = 0.0
    output_tokens: int = 0
    first_token_s: list[float] = dataclasses.field(default_factory=list)
    same_tokens: bool = True


@dataclass
class LogprobsResult:
    requests: int
    input_len: int
    output_len: int
    dtype: str
    sides: list[Side]
    prompt_max_abs_diff: float | None     # against transformers; None when no reference ran

    def as_json(self) -> dict:
        return {"bench": "logprobs", **dataclasses.asdict(self)}

    def text(self) -> str:
        base = self.sides[0]
        header = ["log-probabilities", "out tok/s", "vs none", "TTFT p50", "tokens = none's"]
        rows = []
        for side in self.sides:
            rate = side.output_tokens / side.seconds
            rows.append([side.name, f"{rate:.1f}", f"{rate / (base.output_tokens / base.seconds):.2f}x",
                         f"{percentile(side.first_token_s, 50) * 1000:.0f} ms", "yes" if side.same_tokens else "NO"])
        accuracy = ("not checked" if self.prompt_max_abs_diff is None
                    else f"max |Δ| {self.prompt_max_abs_diff:.2e} against transformers' log-softmax")
        title = [f"logprobs · {self.requests} greedy requests of {self.input_len} prompt tokens, {self.output_len} "
                 f"out · {self.dtype} · top {TOP} · order none/sampled/prompt/prompt/sampled/none"]
        return titled_table(title, header, rows, f"prompt log-probabilities of the first request: {accuracy}")


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


def run_logprobs_bench(engine, prompts: list[list[int]], output_len: int, *, dtype: str, repeats: int = 1,
                       reference: Callable[[list[int]], list[list[float]]] | None = None,
                       progress: Callable[[str], None] = print) -> LogprobsResult:
    """``engine`` runs every side (its prefix cache off); ``reference(prompt_ids)`` gives transformers'
    log-softmax row per prompt position, to compare the first prompt's log-probabilities with."""
    sides = {name: Side(name) for name in SIDES}
    tokens_without = None       # the first run's, which asks for none
    first_prompt_logprobs = None
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0.0))     # warm-up
    for _ in range(repeats):
        for name in ORDER:
            outputs, seconds, first_token_s = _timed(engine, prompts, output_len, SIDES[name])
            side = sides[name]
            side.seconds += seconds
            side.output_tokens += sum(len(o.token_ids) for o in outputs)
            side.first_token_s += first_token_s
            ids = [tuple(o.token_ids) for o in outputs]
            tokens_without = tokens_without or ids
            side.same_tokens &= ids == tokens_without
            if name == "prompt":
                first_prompt_logprobs = outputs[0].prompt_logprobs
            progress(f"  {name:<8} {len(outputs) * output_len / seconds:.1f} output tok/s")
    diff = None
    if reference is not None and first_prompt_logprobs is not None:
        rows = reference(prompts[0])
        diff = max(abs(entry.logprob - rows[position - 1][entry.token_id])
                   for position, entry in enumerate(first_prompt_logprobs) if entry is not None)
    return LogprobsResult(requests=len(prompts), input_len=len(prompts[0]), output_len=output_len, dtype=dtype,
                          sides=list(sides.values()), prompt_max_abs_diff=diff)


def _timed(engine, prompts, output_len: int, asked: dict):
    """Every prompt added at once and stepped to the end: (outputs in prompt order, seconds, time to each
    request's first token)."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, detokenize=False, **asked)
    start = perf_counter()
    ids = [engine.add_request(list(prompt), params) for prompt in prompts]
    finished, first_token = {}, {}
    while engine.has_unfinished_requests():
        result = engine.step()
        now = perf_counter() - start
        for output in result.outputs:
            if output.new_token_ids:
                first_token.setdefault(output.request_id, now)
            if output.finished:
                finished[output.request_id] = output
    return [finished[i] for i in ids], perf_counter() - start, list(first_token.values())
