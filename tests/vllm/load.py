"""The load the live tests and the recorder send a vLLM server, through the OpenAI client.

Two phases. "shared": chat requests that share a long system prompt, a few at
a time, so prefix caching has something to hit. "overload": more long, distinct
prompts at once than a 96-block pool holds, so requests wait, get preempted,
and cached blocks are evicted.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from openai import OpenAI

PROMPTS = Path(__file__).resolve().parents[2] / "app" / "load" / "prompts"
SYSTEM_WORDS = 420      # about 560 tokens of the support prompt: 17 full blocks of 32
MODEL = "smollm2"


def system_prompt() -> str:
    return " ".join((PROMPTS / "system_prompt.txt").read_text().split()[:SYSTEM_WORDS])


def questions() -> list[str]:
    return [line.strip() for line in (PROMPTS / "chat_questions.txt").read_text().splitlines() if line.strip()]


def long_prompts(count: int, words: int = 520) -> list[str]:
    """Distinct long prompts: the same document cut at different places, so no two share a first block."""
    document = (PROMPTS / "long_document.txt").read_text().split()
    prompts = []
    for index in range(count):
        start = (index * 37) % max(len(document) - words, 1)
        prompts.append(f"Summarise part {index}: " + " ".join(document[start:start + words]))
    return prompts


def client_for(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0)


def chat(client: OpenAI, question: str, max_tokens: int) -> str:
    reply = client.chat.completions.create(
        model=MODEL, max_tokens=max_tokens, temperature=0.0,
        messages=[{"role": "system", "content": system_prompt()}, {"role": "user", "content": question}])
    return reply.choices[0].message.content or ""


def complete(client: OpenAI, prompt: str | list[int], max_tokens: int):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0)


def shared_phase(client: OpenAI, count: int = 6, concurrency: int = 3, max_tokens: int = 40) -> None:
    chat(client, questions()[0], max_tokens)      # the first caches the system prompt for the others
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda q: chat(client, q, max_tokens), questions()[1:count]))


def overload_phase(client: OpenAI, count: int = 6, max_tokens: int = 48) -> None:
    with ThreadPoolExecutor(count) as pool:
        list(pool.map(lambda p: complete(client, p, max_tokens), long_prompts(count)))
