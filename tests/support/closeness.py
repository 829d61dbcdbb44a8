"""How close an engine's bf16 logits are to fp32's: the logits of its own greedy run, step by step, each against
an fp32 forward on the same tokens, beside transformers' bf16 forward on those tokens.

Leading agreement with fp32's greedy tokens (app/bench/accuracy.py) is what a user sees, but it is decided by a
handful of near ties and swings by a question's worth of tokens when one of them flips. These figures weigh every
position: the root-mean-square logit error, and how many greedy decisions differ from fp32's argmax on the same
prefix. They say whether one bf16 is closer to fp32 than another with a margin, not by luck.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscope.engine import SamplingParams


@dataclass(frozen=True)
class Closeness:
    rms: float          # root-mean-square logit error against fp32
    flips: int          # greedy decisions that differ from fp32's argmax on the same prefix
    positions: int

    def text(self) -> str:
        return f"rms {self.rms:.4f}, {self.flips}/{self.positions} decisions unlike fp32's"


def greedy_with_logits(engine, prompts: list[list[int]], tokens: int):
    """The engine's greedy tokens for ``prompts`` in one batch (EOS ignored) and, per prompt, the fp32 logits
    each token was picked from (``[tokens, vocab]``). Each request carries its index as its seed, which greedy
    decoding never uses, so the sampler's rows can be told apart."""
    params = [SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, seed=i) for i in range(len(prompts))]
    captured: list[dict[int, torch.Tensor]] = [{} for _ in prompts]
    sample = engine.runner.sampler.sample_rows

    def spy(logits, rows, contexts):
        for logit, row in zip(logits, rows, strict=True):
            captured[row.params.seed][row.position] = logit.float().cpu()
        return sample(logits, rows, contexts)

    engine.runner.sampler.sample_rows = spy
    try:
        outputs = engine.generate(prompts, params)
    finally:
        engine.runner.sampler.sample_rows = sample
    return outputs, [torch.stack([steps[p] for p in sorted(steps)]) for steps in captured]


def forward_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The model's logits at the positions that predicted ``tokens``, given them as inputs (teacher forcing)."""
    with torch.inference_mode():
        return model(torch.tensor([list(prompt) + list(tokens[:-1])])).logits[0, len(prompt) - 1:].float()


def closeness(prompts, outputs, logits, fp32_model, bf16_model) -> tuple[Closeness, Closeness]:
    """(the engine's, transformers' bf16) closeness to fp32 on the engine's own tokens."""
    ours, theirs, exact = [], [], []
    for prompt, output, mine in zip(prompts, outputs, logits, strict=True):
        tokens = list(output.token_ids)
        exact.append(forward_logits(fp32_model, prompt, tokens))
        ours.append(mine)
        theirs.append(forward_logits(bf16_model, prompt, tokens))
    exact_all = torch.cat(exact)
    return _closeness(torch.cat(ours), exact_all), _closeness(torch.cat(theirs), exact_all)


def _closeness(logits: torch.Tensor, exact: torch.Tensor) -> Closeness:
    error = logits - exact
    flips = int((logits.argmax(-1) != exact.argmax(-1)).sum())
    return Closeness(error.pow(2).mean().sqrt().item(), flips, exact.shape[0])
