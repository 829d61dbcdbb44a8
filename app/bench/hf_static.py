"""transformers' ``model.generate`` with static, left-padded batches: the pre-continuous-batching baseline.

Requests are cut into batches of ``batch_size`` in arrival order. A batch runs until
its longest member is done, so its rows keep computing after their own request
has all its tokens: only each request's own tokens count as useful output.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from time import perf_counter

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from kvscope.app.bench.metrics import RunRecord
from kvscope.app.bench.systems import HF_STATIC
from kvscope.app.bench.workloads import BenchRequest, Workload

SYSTEM = HF_STATIC


@dataclass(frozen=True)
class StaticSettings:
    # The fastest of 16, 32 and 64 on the mixed workload (bf16, 2-core CPU: 53.8, 65.3, 63.1 output tok/s).
    batch_size: int = 32


class _StepClock(StoppingCriteria):
    """Called by generate after every decoding step: records when each step's tokens exist."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def sampling_kwargs(temperature: float) -> dict:
    """GenerationConfig fields: greedy, or plain temperature sampling as kvscope does it (no top-k/p)."""
    if temperature <= 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


def static_batch_kv_slots(prompt_lens: list[int], output_lens: list[int], n: int = 1) -> tuple[int, int]:
    """(real tokens held, slots held) summed over the batch's steps, for one left-padded batch.

    At step s (0 = prefill) every row holds ``max(prompt) + s`` slots; a row's real
    tokens are its prompt plus the outputs it asked for, up to s of them.
    """
    longest_prompt, steps = max(prompt_lens), max(output_lens)
    reserved = n * len(prompt_lens) * sum(longest_prompt + s for s in range(steps))
    used = n * sum(p * steps + sum(min(s, o) for s in range(steps))
                   for p, o in zip(prompt_lens, output_lens, strict=True))
    return used, reserved


def useful_output_tokens(output_lens: list[int], n: int = 1) -> tuple[int, int]:
    """(tokens the requests asked for, tokens the batch generated)."""
    return n * sum(output_lens), n * len(output_lens) * max(output_lens)


class TransformersRun:
    """What the transformers peers share: the model, its pad token and the peer's settings; ``run()`` returns a
    workload's RunRecord."""

    def __init__(self, model, pad_token_id: int, settings) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.settings = settings

    def stock_attention(self) -> None:
        self.model.set_attn_implementation("sdpa")  # a kvscope engine may have switched it


class StaticBatchRun(TransformersRun):
    """One pass of a workload through ``model.generate``."""

    def run(self, workload: Workload, warm_up: BenchRequest) -> RunRecord:
        self.stock_attention()
        self._generate([warm_up], workload.temperature, _StepClock())
        size = self.settings.batch_size
        batches = [workload.requests[i:i + size] for i in range(0, len(workload.requests), size)]
        token_times: list[list[float]] = []
        outputs: list[tuple[int, ...]] = []
        batch_sizes: list[int] = []
        used = reserved = useful = generated = prefill = 0
        start = perf_counter()
        for batch in batches:
            clock = _StepClock()
            new_tokens = self._generate(batch, workload.temperature, clock)
            prompt_lens = [len(r.prompt_token_ids) for r in batch]
            output_lens = [r.max_tokens for r in batch]
            n = batch[0].n
            outputs.extend(tuple(new_tokens[row * n, :length].tolist()) for row, length in enumerate(output_lens))
            token_times.extend([t - start for t in clock.times[:o]] for o in output_lens)
            batch_sizes.extend([len(batch)] * len(clock.times))  # requests, as kvscope counts num_running
            held, slots = static_batch_kv_slots(prompt_lens, output_lens, n)
            asked, made = useful_output_tokens(output_lens, n)
            used, reserved = used + held, reserved + slots
            useful, generated = useful + asked, generated + made
            prefill += n * len(batch) * max(prompt_lens)
        wall = perf_counter() - start
        return RunRecord(
            system=SYSTEM, settings=asdict(self.settings) | {"padding": "left", "attention": "sdpa"},
            wall_s=wall, num_prompt_tokens=workload.num_prompt_tokens, num_output_tokens=useful,
            token_times=token_times, batch_sizes=batch_sizes, kv_used_slots=used, kv_reserved_slots=reserved,
            preemptions=0, prefill_tokens_computed=prefill, outputs=outputs,
            extra={"generated_tokens": generated, "wasted_token_fraction": 1.0 - useful / generated},
        )

    @torch.inference_mode()
    def _generate(self, batch, temperature: float, clock: _StepClock) -> torch.Tensor:
        """The batch's new tokens, ``[requests * n, steps]`` (sample j of request r in row r * n + j)."""
        if len({r.n for r in batch}) != 1:
            raise ValueError("a static batch needs one sample count for all its requests")
        longest = max(len(r.prompt_token_ids) for r in batch)
        input_ids = torch.full((len(batch), longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, request in enumerate(batch):
            length = len(request.prompt_token_ids)
            input_ids[row, longest - length:] = torch.tensor(request.prompt_token_ids)
            attention_mask[row, longest - length:] = 1
        steps = max(r.max_tokens for r in batch)
        config = GenerationConfig(
            max_new_tokens=steps, num_return_sequences=batch[0].n, pad_token_id=self.pad_token_id,
            **sampling_kwargs(temperature),
            eos_token_id=[],  # an explicit empty list: EOS never ends a row, so lengths are exact
        )
        device = self.model.device
        output = self.model.generate(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
            generation_config=config, stopping_criteria=StoppingCriteriaList([clock]))
        if output.shape[1] != longest + steps:
            raise RuntimeError(f"generate stopped after {output.shape[1] - longest} of {steps} steps")
        return output[:, longest:].cpu()
