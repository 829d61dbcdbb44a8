"""`kvscope bench logprobs` on a tiny random model: every side gives the same tokens, the prompt
log-probabilities equal transformers' log-softmax over the same weights, and the table says both."""

from __future__ import annotations

import torch
from models import tiny_model

from kvscope.app.bench.logprobs_bench import random_prompts, run_logprobs_bench
from kvscope.engine import EngineConfig, LLMEngine


def test_the_bench_times_three_sides_and_checks_the_prompt_log_probabilities_against_transformers():
    model, tok = tiny_model("llama", seed=3)
    reference_model, _ = tiny_model("llama", seed=3)      # the engine patches its own model's attention
    engine = LLMEngine(EngineConfig(dtype="float32", num_blocks=64, enable_prefix_caching=False), model=model,
                       tokenizer=tok)
    prompts = random_prompts(3, 40, len(tok), seed=1)
    asked = []

    def reference(prompt_ids):
        asked.append(prompt_ids)
        with torch.inference_mode():
            return torch.log_softmax(reference_model(torch.tensor([prompt_ids])).logits[0].float(), dim=-1).tolist()

    result = run_logprobs_bench(engine, prompts, 4, dtype="float32", reference=reference, progress=lambda _: None)
    assert asked == [prompts[0]]
    assert [side.name for side in result.sides] == ["none", "sampled", "prompt"]
    assert all(side.same_tokens and side.output_tokens == 2 * 3 * 4 for side in result.sides)
    assert all(len(side.first_token_s) == 2 * 3 for side in result.sides)
    assert result.prompt_max_abs_diff is not None and result.prompt_max_abs_diff < 1e-4
    lines = result.text().splitlines()
    assert "3 greedy requests of 40 prompt tokens, 4 out" in lines[0]
    assert [line.split()[0] for line in lines[2:5]] == ["none", "sampled", "prompt"]
    assert "against transformers' log-softmax" in lines[-1]
    assert not engine.has_unfinished_requests() and engine.step().stats.num_free_blocks == engine.num_blocks
