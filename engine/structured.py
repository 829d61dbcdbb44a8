"""Structured output: a request's response format compiled to a grammar, and one matcher per sample that says
which tokens may come next.

The grammar engine is llguidance: a self-contained wheel (no torch or compiler pinned, a few MB), which reads
a Hugging Face fast tokenizer as it is, and builds its token masks lazily while decoding, so a new schema costs
next to nothing to compile on the engine's thread. A schema it cannot honour is refused when the request is
added, naming ``response_format``.
"""

from __future__ import annotations

import functools
import json

import numpy as np

from kvscope.engine.config import RequestError

PARAM = "response_format"


@functools.lru_cache(maxsize=4)
def _grammar_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of the tokenizer: about a second to build, so once per tokenizer."""
    import llguidance.hf
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)


class Grammar:
    """A compiled response format. ``matcher()`` gives a fresh matcher for one sample."""

    def __init__(self, tokenizer, vocab_size: int, grammar: str) -> None:
        self.ll_tokenizer = _grammar_tokenizer(tokenizer, vocab_size)
        self.grammar = grammar
        self.vocab_size = vocab_size

    def matcher(self) -> GrammarMatcher:
        import llguidance
        return GrammarMatcher(llguidance.LLMatcher(self.ll_tokenizer, self.grammar, log_level=0), self.vocab_size)


class GrammarMatcher:
    """Where one sample stands in its grammar: the tokens allowed next, and each token taken."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size

    def allowed(self) -> np.ndarray:
        """bool [vocab]: the tokens the grammar allows next (only the stop token once the value is complete)."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[:self._vocab_size].astype(bool)

    def take(self, token: int) -> None:
        self._matcher.consume_token(token)


def compile_grammar(tokenizer, vocab_size: int, spec: tuple[str, object]) -> Grammar:
    """The grammar of ("json_object", None), ("json_schema", schema dict) or ("regex", pattern); RequestError
    naming response_format when the grammar engine cannot compile it."""
    if tokenizer is None:
        raise RequestError("structured output needs a tokenizer, and this engine has none", PARAM)
    import llguidance
    kind, value = spec
    try:
        if kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(value)
        else:
            schema = {"type": "object"} if kind == "json_object" else value
            # Whitespace between tokens is free, as vLLM's default grammar allows: a model forced into compact JSON
            # writes worse values than it does in the layout it learned.
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults={"whitespace_flexible": True})
    except (ValueError, TypeError) as exc:
        raise RequestError(f"{PARAM}: the schema cannot be compiled: {exc}", PARAM) from None
    tokens = _grammar_tokenizer(tokenizer, vocab_size)
    error = llguidance.LLMatcher.validate_grammar(grammar, tokens)
    if error and not error.startswith("WARNING"):
        raise RequestError(f"{PARAM}: this schema is not supported: {error.strip()[:300]}", PARAM)
    return Grammar(tokenizer, vocab_size, grammar)
