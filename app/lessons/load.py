"""The teaching pool and the requests lessons send.

``--teach`` and every lesson run on a pool small enough that the map shows one
cell per block, even in an 80-column window, so every shared block's ref-count
digit is visible, with a max_model_len the pool holds four times over.

Lesson requests decode greedily and ignore end-of-sequence, so a lesson runs
the same steps every time on the same model: its output lengths are what the
script says. Prompts are cut to a token count with the running engine's own
tokenizer, on the engine thread.
"""

from __future__ import annotations

import dataclasses

from kvscope.app.load.presets import PlannedRequest, PresetContext, fit_text, prompt_file, prompt_lines
from kvscope.engine.config import EngineConfig, SamplingParams

TEACH_POOL = {"block_size": 16, "num_blocks": 64, "max_model_len": 256, "swap_space": "16MiB"}


def teach_config(config: EngineConfig, **changes) -> EngineConfig:
    """``config`` on the teaching pool, with a lesson's own ``changes`` on top."""
    return dataclasses.replace(config, **{**TEACH_POOL, **changes})


def params(max_tokens: int, n: int = 1) -> SamplingParams:
    # n > 1 samples must differ to show copy-on-write: they sample (seeded), the rest is greedy.
    temperature = 1.0 if n > 1 else 0.0
    return SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, seed=7, ignore_eos=True)


def question(index: int) -> str:
    questions = prompt_lines("chat_questions.txt")
    return questions[index % len(questions)]


def ask(name: str, text: str, max_tokens: int, *, delay: int = 0, n: int = 1,
        system: str | None = None) -> PlannedRequest:
    """A chat turn named ``name``, added ``delay`` steps after the beat starts."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return PlannedRequest(messages, params(max_tokens, n), delay_steps=delay, name=name)


def passage(ctx: PresetContext, num_tokens: int, offset: int = 0) -> str:
    """Running text of the long document, ``offset`` words in, as close to ``num_tokens`` tokens as whole words
    allow without going over (one line: a heading or a paragraph break would not cut it short)."""
    words = prompt_file("long_document.txt").split()
    words = words[offset % len(words):] + words[:offset % len(words)]
    taken: list[str] = []
    for word in words * (1 + num_tokens // max(len(words), 1)):
        if ctx.count_tokens(" ".join([*taken, word])) > num_tokens:
            break
        taken.append(word)
    return " ".join(taken)


def read(name: str, ctx: PresetContext, num_tokens: int, max_tokens: int, *, delay: int = 0,
         offset: int = 0, n: int = 1) -> PlannedRequest:
    """A plain-text prompt of about ``num_tokens`` tokens, for lessons that need a prompt of a given size."""
    return PlannedRequest(passage(ctx, num_tokens, offset), params(max_tokens, n), delay_steps=delay, name=name)


def system_prompt(ctx: PresetContext, num_tokens: int) -> str:
    return fit_text(prompt_file("system_prompt.txt"), num_tokens, ctx)
