"""Log-probabilities as the two endpoints write them: /v1/completions' columns (OpenAI's legacy shape: tokens,
token_logprobs, top_logprobs, text_offset) and /v1/chat/completions' list of tokens, and vLLM's prompt_logprobs.

The engine gives token ids (engine.outputs.TokenLogprob); a token's text is the tokenizer's decoding of that one
token, as vLLM writes it, decoded once per response.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel

from kvscope.engine.outputs import TokenLogprob


class TokenText:
    """Each token id's text, decoded once per response."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.decode([token_id])
        return text

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids) if self._tokenizer is not None else " ".join(map(str, token_ids))


class CompletionLogprobs(BaseModel):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


def completion_logprobs(entries: Sequence[TokenLogprob | None], token_ids: Sequence[int], text: TokenText,
                        offset: int) -> CompletionLogprobs:
    """The columns for ``token_ids`` (``entries`` their log-probabilities; None for a prompt's first token), the
    text offsets counted from ``offset``. A token's top entries include the token itself, as vLLM's do."""
    columns = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
    for token_id, entry in zip(token_ids, entries):
        token = text(token_id)
        columns.tokens.append(token)
        columns.text_offset.append(offset)
        offset += len(token)
        if entry is None:
            columns.token_logprobs.append(None)
            columns.top_logprobs.append(None)
            continue
        columns.token_logprobs.append(entry.logprob)
        columns.top_logprobs.append({text(t): lp for t, lp in (*entry.top, (entry.token_id, entry.logprob))})
    return columns


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


def _top(token_id: int, logprob: float, text: TokenText) -> dict:
    token = text(token_id)
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", errors="replace"))}


def chat_logprobs(entries: Sequence[TokenLogprob], text: TokenText) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ChatTokenLogprob(**_top(entry.token_id, entry.logprob, text),
                         top_logprobs=[TopLogprob(**_top(t, lp, text)) for t, lp in entry.top])
        for entry in entries])


class PromptLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: str


def prompt_logprobs(entries: Sequence[TokenLogprob | None] | None, text: TokenText
                    ) -> list[dict[int, PromptLogprob] | None] | None:
    """vLLM's prompt_logprobs: per prompt token, None for the first, else its own and the top entries by id."""
    if entries is None:
        return None
    found: list[dict[int, PromptLogprob] | None] = []
    for entry in entries:
        if entry is None:
            found.append(None)
            continue
        ranked = {token_id: (logprob, rank) for rank, (token_id, logprob) in enumerate(entry.top, start=1)}
        ranked[entry.token_id] = (entry.logprob, entry.rank)
        found.append({token_id: PromptLogprob(logprob=logprob, rank=rank, decoded_token=text(token_id))
                      for token_id, (logprob, rank) in ranked.items()})
    return found
