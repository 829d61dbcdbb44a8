"""bf16 generation stays closer to fp32 than transformers' own bf16 does, by a margin.

bf16 cannot be token-identical to fp32 (nor is transformers' own bf16): greedy picks may differ wherever fp32's
two best logits are nearly tied. kvscope keeps in fp32 what transformers' bf16 rounds (the residual stream,
rotary, the activation, attention's softmax and sums, the logits: engine/model/precision.py), so, checked on SmolLM2
with the logits kvscope sampled from, each against fp32 transformers on the same tokens (teacher forcing on
kvscope's own output):

- the root-mean-square logit error is at most ``RMS_RATIO`` times that of transformers' bf16 forward on the same
  tokens (measured 0.40-0.73 per prompt, 0.5 overall; before precision.py, 1.0-1.5);
- no logit is off by more than transformers' bf16 worst one (logits here are 10-20 in magnitude; measured 0.31
  against 0.78; before precision.py, up to 2.1);
- a greedy pick differs from fp32's only where fp32's two best logits are within ``NEAR_TIE`` of each other.
"""

from __future__ import annotations

import random

import torch
from models import load_smollm2

from kvscope.engine import EngineConfig, LLMEngine, SamplingParams

RMS_RATIO = 0.75
NEAR_TIE = 0.5
NUM_TOKENS = 10


def sampled_logits(engine: LLMEngine, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens for ``prompt`` and the logits each was drawn from, [NUM_TOKENS, vocab] in fp32."""
    captured = []
    sample = engine.runner.sampler.sample_rows

    def spy(logits, rows, contexts):
        captured.append(logits.float().cpu().clone())
        return sample(logits, rows, contexts)

    engine.runner.sampler.sample_rows = spy
    [output] = engine.generate([prompt], SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True))
    engine.runner.sampler.sample_rows = sample
    return list(output.token_ids), torch.cat(captured)


def forward_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The model's logits at the positions that predicted ``tokens``, given them as inputs (teacher forcing)."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    return logits.float()


def rms(error: torch.Tensor) -> float:
    return error.pow(2).mean().sqrt().item()


def test_bf16_logits_stay_as_close_to_fp32_as_transformers_bf16():
    fp32, tok = load_smollm2(torch.float32)
    bf16, _ = load_smollm2(torch.bfloat16)
    engine = LLMEngine(EngineConfig(dtype="bfloat16", num_blocks=64, max_model_len=256),
                       model=load_smollm2(torch.float32)[0], tokenizer=tok)
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(5, 60))] for _ in range(3)]
    ours, theirs = [], []
    for prompt in prompts:
        tokens, logits = sampled_logits(engine, prompt)
        reference = forward_logits(fp32, prompt, tokens)
        ours.append(logits - reference)
        theirs.append(forward_logits(bf16, prompt, tokens) - reference)
        best_two = reference.topk(2).values
        flipped = torch.tensor(tokens) != reference.argmax(-1)
        margins = (best_two[:, 0] - best_two[:, 1])[flipped]
        assert (margins < NEAR_TIE).all(), f"a greedy pick differs from fp32's at margins {margins.tolist()}"
    ours, theirs = torch.cat(ours), torch.cat(theirs)
    assert rms(ours) <= RMS_RATIO * rms(theirs), (rms(ours), rms(theirs))
    assert ours.abs().max().item() <= theirs.abs().max().item()
