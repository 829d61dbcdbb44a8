"""The parts of a request's sampling knobs that need the model's tokenizer or vocabulary: checked and resolved
once, when the request is added, so the sampler only ever sees token ids."""

from __future__ import annotations

from kvscope.engine.config import RequestError, SamplingParams


def check_vocabulary(params: SamplingParams, vocab_size: int) -> None:
    """RequestError naming the knob whose token id the model does not have."""
    for token in params.logit_bias or ():
        if token >= vocab_size:
            raise RequestError(f"logit_bias: token id {token} is out of the vocabulary (0 .. {vocab_size - 1})",
                               "logit_bias")


def bad_word_token_ids(tokenizer, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Each bad word as the token sequences that spell it, as vLLM tokenizes it: alone, and after a space (the
    form it takes inside a sentence); the sampler forbids a sequence's last token after the rest of it."""
    if words and tokenizer is None:
        raise RequestError("bad_words needs a tokenizer, and this engine has none", "bad_words")
    found: list[tuple[int, ...]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in found:
                found.append(ids)
    return tuple(found)
