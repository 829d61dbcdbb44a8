"""Incremental detokenization for streaming, with stop strings.

Decoding one token at a time is wrong for byte-level and SentencePiece
tokenizers: a multi-byte character can span tokens, and a token's leading space
depends on the token before it. So each new token is decoded together with a
short window of the tokens before it, and text is released only when the window
no longer ends in a replacement character (a character still being assembled).

Stop strings: text that could still be the start of a stop string is held back,
so a stop string is never streamed and then retracted. When one matches, it and
everything after it are cut.
"""

from __future__ import annotations

# Prompt tokens decoded along with the first output token, so its leading space is right.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids, stop=()) -> None:
        self.tokenizer = tokenizer
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.token_ids = context
        # token_ids[prefix_offset:read_offset] is the window already turned into text.
        self.prefix_offset = 0
        self.read_offset = len(context)
        self._prefix_text = self._decode(context)
        self.stop = tuple(stop)
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self.text = ""          # decoded output text, cut at a stop string
        self.released = 0       # text[:released] has been handed out
        self._taken = 0         # text[:_taken] has been returned by take_delta

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def add_token(self, token_id: int) -> bool:
        """Decode one more token. True when a stop string matched (the text is cut before it)."""
        self.token_ids.append(token_id)
        window_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(_REPLACEMENT_CHAR):
            return False    # nothing printable yet, or a character still being assembled
        new_text = window_text[len(self._prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self._prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        return self._append_text(new_text)

    def _append_text(self, new_text: str) -> bool:
        search_from = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += new_text
        if not self.stop:
            self.released = len(self.text)
            return False
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
        """The sample is done: release everything, including an unfinished character."""
        if not stopped_by_string and self.read_offset < len(self.token_ids):
            rest = self._decode(self.token_ids[self.prefix_offset:])[len(self._prefix_text):]
            self.read_offset = len(self.token_ids)
            if self._append_text(rest):
                return
        self.released = len(self.text)

    @property
    def output_text(self) -> str:
        text = self.text
        return text if self.released == len(text) else text[:self.released]

    def take_delta(self) -> str:
        """Text released since the last call."""
        delta = self.text[self._taken:self.released]
        self._taken = self.released
        return delta
