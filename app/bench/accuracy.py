"""How far a system's greedy tokens agree with transformers' fp32 ``generate``: the accuracy beside every speed.

A faster kernel or a lower precision can trade truth for speed unseen: a near tie between the two best logits
flips, and everything after it differs. So every bench row that produced greedy tokens says, on a fixed sample
of the workload's requests, for how many the first token equals the fp32 reference's (``first``) and how many
leading tokens agree on average (``lead``), over each request's first ``TOKENS`` tokens (fewer where it asks
for fewer). transformers' own bf16 ``generate`` on the same sample is the bar: a row below it is marked.

The reference runs one request at a time (no padding), EOS ignored, exactly as ``tests/test_truth.py`` does on
real chat prompts. It depends on the workload, not on the dtype under test, so it is made once per workload.

Beside it, ``= alone``: for how many of the sampled requests the system's tokens equal those it gives the same
request run alone (a fresh engine, or a batch of one). In fp32 that is all of them; in bf16 the rounding of a
matmul depends on how many rows it has, so tokens can depend on what shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Requests sampled per workload, spread evenly over it, and tokens compared per request.
SAMPLE = 8
TOKENS = 32
BELOW_BAR = "!"


@dataclass(frozen=True)
class Agreement:
    """Leading agreement of some outputs with the reference, request by request."""

    leading: tuple[int, ...]    # per request: how many leading tokens equal the reference's
    tokens: int                 # tokens compared per request (at most)

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


def transformers_greedy(model, prompt_ids, max_new_tokens: int, pad_token_id: int | None) -> list[int]:
    """transformers' own greedy ``generate``, EOS ignored, one prompt at a time (no padding effects)."""
    with torch.inference_mode():
        prompt = torch.tensor([list(prompt_ids)], device=model.device)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id)
    return out[0, prompt.shape[1]:].tolist()


def sample_indices(num_requests: int, size: int = SAMPLE) -> list[int]:
    """``size`` request indices spread evenly over the workload (all of them when it is that small)."""
    if num_requests <= size:
        return list(range(num_requests))
    return [round(i * (num_requests - 1) / (size - 1)) for i in range(size)]


@dataclass(frozen=True)
class Sample:
    """The requests a workload's accuracy is measured on, and how many tokens of each are compared."""

    indices: tuple[int, ...]
    tokens: tuple[int, ...]

    @classmethod
    def of(cls, workload) -> Sample:
        indices = tuple(sample_indices(len(workload.requests)))
        return cls(indices, tuple(min(TOKENS, workload.requests[i].max_tokens) for i in indices))

    def prompts(self, workload) -> list[tuple[int, ...]]:
        return [workload.requests[i].prompt_token_ids for i in self.indices]


@dataclass(frozen=True)
class Reference:
    """A workload's sample, transformers' fp32 tokens for it, and transformers' bf16 agreement (the bar)."""

    sample: Sample
    fp32_tokens: tuple[tuple[int, ...], ...]
    bf16: Agreement

    def score(self, outputs_by_request) -> Agreement | None:
        """Agreement of a run's outputs (sample 0 per request, in workload order); None without them."""
        if outputs_by_request is None:
            return None
        return agreement([outputs_by_request[i] for i in self.sample.indices], self.fp32_tokens, TOKENS)

    def row_fields(self, outputs_by_request, alone_by_index) -> dict:
        """The report row's accuracy fields (None where the system gave no tokens)."""
        scored = self.score(outputs_by_request)
        fields = {"accuracy_sample": len(self.sample.indices), "first_token_agreement": None,
                  "mean_leading_agreement": None, "below_transformers_bf16": None, "equal_alone": None}
        if scored is not None:
            fields |= {"first_token_agreement": scored.first_token_hits,
                       "mean_leading_agreement": scored.mean_leading,
                       "below_transformers_bf16": not scored.at_least_as_good_as(self.bf16)}
        if outputs_by_request is not None and alone_by_index is not None:
            fields["equal_alone"] = equal_alone(self.sample, outputs_by_request, alone_by_index)
        return fields


def equal_alone(sample: Sample, outputs_by_request, alone_by_index) -> int:
    """How many sampled requests got, in the batch, the tokens they get run alone (over the compared tokens)."""
    return sum(1 for i, n in zip(sample.indices, sample.tokens)
               if list(outputs_by_request[i])[:n] == list(alone_by_index[i])[:n])


def greedy_alone(model, sample: Sample, workload, pad_token_id: int | None) -> dict[int, list[int]]:
    """transformers' greedy tokens for each sampled request, one at a time: its systems' ``alone`` run."""
    return {i: transformers_greedy(model, workload.requests[i].prompt_token_ids, n, pad_token_id)
            for i, n in zip(sample.indices, sample.tokens)}


def build_reference(fp32_model, bf16_model, workload, pad_token_id: int | None) -> Reference:
    """transformers' fp32 greedy tokens for the workload's sample, and how well its bf16 agrees with them."""
    sample = Sample.of(workload)
    fp32 = greedy_alone(fp32_model, sample, workload, pad_token_id)
    bf16 = greedy_alone(bf16_model, sample, workload, pad_token_id)
    return Reference(sample, tuple(tuple(fp32[i]) for i in sample.indices),
                     agreement([bf16[i] for i in sample.indices], [fp32[i] for i in sample.indices], TOKENS))
