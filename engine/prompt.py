"""Turning a prompt (text, chat messages or token ids) into the token ids a request is made of.

Kept apart from the engine's lock: a server tokenizes here on a thread of its own, so a long prompt never holds
up the steps, and a prompt whose length alone shows that it cannot fit is refused before any tokenizing.
"""

from __future__ import annotations

import functools
import numbers
from typing import NamedTuple

from kvscope.engine.config import RequestError

PREVIEW_CHARS = 80
UNBOUNDED_TOKEN_CHARS = 1 << 20     # for a tokenizer that does not list its vocabulary


class TokenizedPrompt(NamedTuple):
    """A prompt as ``PromptTokenizer.tokenize`` made it: add_request takes one as is, without tokenizing again."""

    token_ids: tuple[int, ...]
    preview: str    # one line, for the queues
    text: str       # the prompt as text, for the observers (chat messages one per line)


class PromptTokenizer:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def tokenize(self, prompt) -> TokenizedPrompt:
        if isinstance(prompt, TokenizedPrompt):
            return prompt
        self._check_length_bound(prompt)
        preview = None
        if isinstance(prompt, str):
            token_ids, preview = self._encode(prompt), prompt
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            token_ids, preview = self._apply_chat_template(list(prompt)), prompt[-1]["content"]
        elif isinstance(prompt, (list, tuple)) and all(_is_token_id(t) for t in prompt):
            token_ids = [int(t) for t in prompt]
        else:
            raise RequestError("prompt must be a string, a list of token ids or a list of chat messages "
                               "(dicts with a 'role' and a 'content')", "prompt")
        if not token_ids:
            raise RequestError("prompt is empty", "prompt")
        self._check_vocabulary(token_ids)
        if preview is None:     # decoded only now: the tokenizer may overflow on ids outside its vocabulary
            preview = self.tokenizer.decode(token_ids[:PREVIEW_CHARS]) if self.tokenizer is not None else ""
        return TokenizedPrompt(tuple(token_ids), " ".join(preview.split())[:PREVIEW_CHARS],
                               self._prompt_text(prompt, token_ids))

    def _check_length_bound(self, prompt) -> None:
        """Refuse a prompt whose length alone shows it cannot fit: no token stands for more characters than the
        tokenizer's longest vocabulary entry, so a text longer than max_model_len times that has more than
        max_model_len tokens."""
        if isinstance(prompt, str):
            num_chars = len(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt):
            num_chars = sum(len(m["content"]) for m in prompt if isinstance(m.get("content"), str))
        else:
            if isinstance(prompt, (list, tuple)) and len(prompt) > self.max_model_len:
                raise RequestError(f"the prompt is {len(prompt):,} tokens, which exceeds max_model_len "
                                   f"({self.max_model_len})", "prompt")
            return
        limit = self.max_model_len * self._max_token_chars
        if num_chars > limit:
            raise RequestError(f"the prompt is {num_chars:,} characters, so its tokens exceed max_model_len "
                               f"({self.max_model_len}): with this tokenizer that many tokens hold at most "
                               f"{limit:,} characters", "prompt")

    @functools.cached_property
    def _max_token_chars(self) -> int:
        vocab = getattr(self.tokenizer, "get_vocab", None)
        try:
            return max(max(len(piece) for piece in vocab()), 1) if callable(vocab) else UNBOUNDED_TOKEN_CHARS
        except Exception:  # a tokenizer without a readable vocabulary: no bound but the request body's
            return UNBOUNDED_TOKEN_CHARS

    def _prompt_text(self, prompt, token_ids) -> str:
        if isinstance(prompt, str):
            return prompt
        if prompt and isinstance(prompt[0], dict):
            return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)
        return self.tokenizer.decode(list(token_ids)) if self.tokenizer is not None else f"<{len(token_ids)} token ids>"

    def _encode(self, text: str) -> list[int]:
        if not text:
            raise RequestError("prompt is empty", "prompt")
        try:
            return list(self._need_tokenizer("a text prompt").encode(text))
        except (UnicodeError, TypeError, ValueError) as exc:
            raise RequestError(f"the tokenizer cannot encode this prompt: {exc}", "prompt") from exc

    def _check_vocabulary(self, token_ids: list[int]) -> None:
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"prompt token ids must be in [0, vocab_size={self.vocab_size}); got {bad}", "prompt")

    def _apply_chat_template(self, messages: list[dict]) -> list[int]:
        for message in messages:
            if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
                raise RequestError("each chat message needs a 'role' and a 'content' that are strings, got "
                                   f"{message!r}", "prompt")
        tokenizer = self._need_tokenizer("chat messages")
        try:
            encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # jinja raises its own errors, and a template may refuse a conversation
            raise RequestError(f"the chat template refused these messages: {type(exc).__name__}: {exc}",
                               "prompt") from exc
        if hasattr(encoded, "keys"):    # transformers 5 returns a BatchEncoding by default
            encoded = encoded["input_ids"]
        return list(encoded)

    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise RequestError(f"{what} needs a tokenizer; pass token ids instead", "prompt")
        return self.tokenizer


def _is_token_id(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
