"""How far a system's greedy tokens agree with transformers' fp32 ``generate``: the accuracy beside every speed.

A faster kernel or a lower precision can trade truth for speed unseen: a near tie between the two best logits
flips, and everything after it differs. So every bench row that produced greedy tokens says, on a fixed sample
of the workload's requests, for how many the first token equals the fp32 reference's (``first``) and how many
leading tokens agree on average (``lead``), over the first ``TOKENS`` tokens. transformers' own bf16
``generate`` on the same sample is the bar: a row below it is marked.

The reference runs one request at a time (no padding), EOS ignored, exactly as ``tests/test_truth.py`` does on
real chat prompts. It depends on the workload, not on the dtype under test, so it is made once per workload.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Requests sampled per workload, spread evenly over it, and tokens compared per request.
SAMPLE = 8
TOKENS = 32


@dataclass(frozen=True)
class Agreement:
    """Leading agreement of some outputs with the reference, request by request."""

    leading: tuple[int, ...]    # per request: how many leading tokens equal the reference's
    tokens: int                 # tokens compared per request

    @property
    def first_token_hits(self) -> int:
        return sum(1 for n in self.leading if n > 0)

    @property
    def mean_leading(self) -> float:
        return sum(self.leading) / len(self.leading) if self.leading else 0.0

    def at_least_as_good_as(self, other: Agreement) -> bool:
        """No fewer first tokens right, and a mean agreement no shorter."""
        return self.first_token_hits >= other.first_token_hits and self.mean_leading >= other.mean_leading

    def text(self) -> str:
        return f"first {self.first_token_hits}/{len(self.leading)}, lead {self.mean_leading:.1f}/{self.tokens}"


def leading_agreement(tokens, reference) -> int:
    """How many leading tokens of ``tokens`` equal ``reference``'s."""
    count = 0
    for mine, theirs in zip(tokens, reference):
        if mine != theirs:
            break
        count += 1
    return count


def agreement(outputs, references, tokens: int = TOKENS) -> Agreement:
    return Agreement(tuple(leading_agreement(list(o)[:tokens], list(r)[:tokens]) for o, r in zip(outputs, references)),
                     tokens)


def transformers_greedy(model, prompt_ids: list[int], max_new_tokens: int, pad_token_id: int | None) -> list[int]:
    """transformers' own greedy ``generate``, EOS ignored, one prompt at a time (no padding effects)."""
    with torch.inference_mode():
        prompt = torch.tensor([prompt_ids], device=model.device)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id)
    return out[0, len(prompt_ids):].tolist()


def sample_indices(num_requests: int, size: int = SAMPLE) -> list[int]:
    """``size`` request indices spread evenly over the workload (all of them when it is that small)."""
    if num_requests <= size:
        return list(range(num_requests))
    return [round(i * (num_requests - 1) / (size - 1)) for i in range(size)]


@dataclass(frozen=True)
class Reference:
    """The sample of one workload, transformers' fp32 tokens for it, and transformers' bf16 agreement."""

    indices: tuple[int, ...]
    fp32_tokens: tuple[tuple[int, ...], ...]
    bf16: Agreement
    tokens: int = TOKENS

    def score(self, outputs_by_request) -> Agreement | None:
        """Agreement of a run's outputs (sample 0 per request, in workload order); None without them."""
        if outputs_by_request is None:
            return None
        return agreement([outputs_by_request[i] for i in self.indices], self.fp32_tokens, self.tokens)


def build_reference(fp32_model, bf16_model, prompts: list[list[int]], pad_token_id: int | None,
                    tokens: int = TOKENS) -> Reference:
    """Greedy tokens of transformers in fp32 for ``prompts``' sample, and how well its bf16 agrees."""
    indices = sample_indices(len(prompts))
    fp32 = [transformers_greedy(fp32_model, prompts[i], tokens, pad_token_id) for i in indices]
    bf16 = [transformers_greedy(bf16_model, prompts[i], tokens, pad_token_id) for i in indices]
    return Reference(tuple(indices), tuple(map(tuple, fp32)), agreement(bf16, fp32, tokens), tokens)
