"""Incremental detokenization for streaming, with stop strings.

Decoding one token at a time is wrong for byte-level and SentencePiece
tokenizers: a multi-byte character can span tokens, and a token's leading space
depends on the token before it. A fast (Rust) tokenizer has its own streaming
decoder for this, tokenizers' DecodeStream, which is used when present: one call
per token. Other tokenizers get the same behaviour from a window: each new token
is decoded together with a few tokens before it, and text is released only when
the window no longer ends in a replacement character (a character still being
assembled).

Stop strings: text that could still be the start of a stop string is held back,
so a stop string is never streamed and then retracted. When one matches, it and
everything after it are cut.

A sample that ends in the middle of a character (max_tokens cut it between the
bytes of an emoji) leaves that character out of its text, as vLLM does: its
tokens stay in the output's token ids, but the text never ends in U+FFFD, on
screen or in the run log.
"""

from __future__ import annotations

import functools

# Prompt tokens decoded along with the first output token, so its leading space is right.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class _DecodeStreamText:
    """New text per token from tokenizers' DecodeStream. ``step`` is DecodeStream's own, bound to the tokenizer (no
    Python frame of its own: it runs for every token of every request); None for a token it holds back."""

    def __init__(self, backend, prompt_token_ids) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = backend
        self.step = functools.partial(
            DecodeStream(ids=list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]), skip_special_tokens=True).step, backend)

    def flush(self, held: list[int]) -> str:
        """What the held tokens decode to on their own, less the unfinished character they end in."""
        return _complete(self._backend.decode(held, skip_special_tokens=True)) if held else ""


class _WindowText:
    """New text per token for any tokenizer with ``decode``: two decodes of a short window."""

    def __init__(self, tokenizer, prompt_token_ids) -> None:
        self._tokenizer = tokenizer
        self._token_ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # _token_ids[_prefix_offset:_read_offset] is the window already turned into text.
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._prefix_text = self._decode(self._token_ids)

    def _decode(self, ids) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def step(self, token_id: int) -> str:
        """The new text, "" while there is none (this stream keeps its own window of the tokens it holds)."""
        self._token_ids.append(token_id)
        window_text = self._decode(self._token_ids[self._prefix_offset:])
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(_REPLACEMENT_CHAR):
            return ""    # nothing printable yet, or a character still being assembled
        new_text = window_text[len(self._prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._prefix_text = self._decode(self._token_ids[self._prefix_offset:self._read_offset])
        return new_text

    def flush(self, held: list[int]) -> str:
        if self._read_offset == len(self._token_ids):
            return ""
        rest = self._decode(self._token_ids[self._prefix_offset:])[len(self._prefix_text):]
        self._read_offset = len(self._token_ids)
        return _complete(rest)


def _complete(text: str) -> str:
    """``text`` without the replacement characters it ends in: the bytes of a character cut short."""
    return text.rstrip(_REPLACEMENT_CHAR)


def _text_stream(tokenizer, prompt_token_ids):
    from_rust = getattr(tokenizer, "_tokenizer", None)    # transformers' fast tokenizers wrap one
    if type(from_rust).__module__.startswith("tokenizers"):
        return _DecodeStreamText(from_rust, prompt_token_ids)
    return _WindowText(tokenizer, prompt_token_ids)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids, stop=(), min_tokens: int = 0) -> None:
        self._stream = _text_stream(tokenizer, prompt_token_ids)
        self._step = self._stream.step
        self._held: list[int] = []      # tokens since the last one that gave text
        self.stop = tuple(stop)
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self.text = ""          # decoded output text, cut at a stop string
        self.released = 0       # text[:released] has been handed out
        self.taken = 0          # text[:taken] has been returned by take (or Request.output)
        self._tokens_before_stops = min_tokens     # stop strings count from the min_tokens-th token on (vLLM's rule)

    def add_token(self, token_id: int) -> bool:
        """Decode one more token. True when a stop string matched (the text is cut before it)."""
        new_text = self._step(token_id)
        if new_text is None:    # held back: it ends in a character still being assembled
            self._held.append(token_id)
            new_text = ""
        elif self._held:
            self._held.clear()
        if self._tokens_before_stops > 0:
            self._tokens_before_stops -= 1
            if self._tokens_before_stops > 0:    # no match yet, but what may start one is still held back
                self.text += new_text
                self.released = len(self.text) - (self._stop_prefix_len() if self.stop else 0)
                return False
        if not new_text:
            return False
        if not self.stop:   # _append_text's first case, inline: the usual one, for every token of every request
            text = self.text = self.text + new_text
            self.released = len(text)
            return False
        return self._append_text(new_text)

    def _append_text(self, new_text: str) -> bool:
        if not self.stop:
            self.text += new_text
            self.released = len(self.text)
            return False
        search_from = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += new_text
        cut = min((i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            self.released = len(self.text)
            return True
        self.released = len(self.text) - self._stop_prefix_len()
        return False

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that some stop string starts with."""
        text = self.text
        for length in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            tail = text[-length:]
            if any(s.startswith(tail) for s in self.stop):
                return length
        return 0

    def finish(self, stopped_by_string: bool = False) -> None:
        """The sample is done: release everything but an unfinished character at the end."""
        if not stopped_by_string:
            rest = self._stream.flush(self._held)
            self._held = []
            if rest and self._append_text(rest):
                return
        self.released = len(self.text)

    @property
    def output_text(self) -> str:
        text = self.text
        return text if self.released == len(text) else text[:self.released]

    def take_delta(self) -> str:
        """Text released since the last call (of this or take)."""
        return self.take()[0]

    def take(self) -> tuple[str, str]:
        """(take_delta(), output_text) in one call: an output after every step wants both."""
        text, released = self.text, self.released
        delta = text[self.taken:released]
        self.taken = released
        return delta, text if released == len(text) else text[:released]
