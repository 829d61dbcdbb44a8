"""Incremental detokenizer: no split characters across deltas, stop strings cut and never streamed."""

from __future__ import annotations

import pytest

from kvscope.engine.detokenizer import IncrementalDetokenizer
from kvscope.engine.fake_runner import FakeTokenizer

TOKENIZER = FakeTokenizer()     # byte-level: multi-byte characters span several tokens


def stream(text: str, stop=(), prompt="Q: ", min_tokens: int = 0):
    """Feed ``text`` byte by byte; returns (deltas, stopped, final text)."""
    detok = IncrementalDetokenizer(TOKENIZER, TOKENIZER.encode(prompt), stop, min_tokens)
    deltas = []
    stopped = False
    for token in TOKENIZER.encode(text):
        stopped = detok.add_token(token)
        deltas.append(detok.take_delta())
        if stopped:
            break
    detok.finish(stopped)
    deltas.append(detok.take_delta())
    return deltas, stopped, detok.output_text


@pytest.mark.parametrize("text", ["héllo wörld", "日本語のテキスト", "emoji 🎉🚀 end", "mixed ß→∑ ok"])
def test_multibyte_characters_are_never_split(text):
    deltas, stopped, final = stream(text)
    assert not stopped
    assert "".join(deltas) == text == final
    assert all("\ufffd" not in delta for delta in deltas)
    # A 4-byte emoji arrives whole: its first three tokens release nothing.
    if "🎉" in text:
        assert "🎉" in deltas


def test_text_is_released_as_soon_as_a_character_completes():
    deltas, _, _ = stream("aé")
    assert deltas[:3] == ["a", "", "é"]


def test_stop_string_is_cut_with_everything_after_it():
    deltas, stopped, final = stream("hello STOP and more", stop=["STOP"])
    assert stopped
    assert final == "hello "
    assert "".join(deltas) == "hello "


def test_stop_strings_count_only_from_min_tokens_on():
    """vLLM's rule: a stop string ends the sample only at or after the min_tokens-th token (one completed by
    that token counts); one completed earlier is text like any other."""
    assert stream("STOPx STOP end", stop=["STOP"], min_tokens=5)[1:] == (True, "STOPx ")
    assert stream("STOP STOP end", stop=["STOP"], min_tokens=4)[1:] == (True, "")
    assert stream("STOP STOP end", stop=["STOP"], min_tokens=20)[1:] == (False, "STOP STOP end")


def test_partial_stop_string_is_held_back_then_released():
    # "ST" could start "STOP", so it is held until the text shows it is not the stop string.
    detok = IncrementalDetokenizer(TOKENIZER, [65], ["STOP"])
    released = []
    for token in TOKENIZER.encode("a STx"):
        assert not detok.add_token(token)
        released.append(detok.take_delta())
    assert released == ["a", " ", "", "", "STx"]


def test_held_back_text_is_released_when_the_sample_finishes():
    deltas, stopped, final = stream("ends with ST", stop=["STOP"])
    assert not stopped
    assert final == "ends with ST" == "".join(deltas)


def test_earliest_of_several_stop_strings_wins():
    _, stopped, final = stream("one two three", stop=["three", "two"])
    assert stopped and final == "one "


def test_stop_string_spanning_a_multibyte_character():
    _, stopped, final = stream("café au lait", stop=["é a"])
    assert stopped and final == "caf"


def test_special_tokens_are_skipped():
    detok = IncrementalDetokenizer(TOKENIZER, [], ())
    for token in [*TOKENIZER.encode("hi"), TOKENIZER.eos_token_id]:
        detok.add_token(token)
    detok.finish()
    assert detok.output_text == "hi"


def test_a_character_cut_short_at_the_end_is_left_out_not_shown_as_a_replacement_character():
    """Issue 25 defect 7: a reply cut by max_tokens inside a character ended in U+FFFD."""
    detok = IncrementalDetokenizer(TOKENIZER, [], ())
    for token in [*TOKENIZER.encode("ok "), 0xE6, 0x97]:   # two of 日's three bytes, then the cut
        detok.add_token(token)
    detok.finish()
    assert detok.output_text == "ok " == detok.take_delta()


def test_invalid_bytes_inside_the_text_are_kept():
    """Only a character cut short at the end goes: a byte that is no character, followed by more text, shows."""
    detok = IncrementalDetokenizer(TOKENIZER, [], ())
    for token in [0x61, 0xFF, 0x62]:
        detok.add_token(token)
    detok.finish()
    assert detok.output_text == "a\ufffdb"


# The same behaviour through a real fast tokenizer, where tokenizers' own DecodeStream does the decoding.
TEXTS = ["héllo wörld", "日本語のテキスト", "emoji 🎉🚀 end", "mixed ß→∑ ok", " leading space", "a\n\nb  c"]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from models import tokenizer

    return tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_fast_tokenizer_streams_what_a_whole_decode_gives(smollm2_tokenizer, text):
    tok = smollm2_tokenizer
    prompt_ids = tok.encode("Question: say it.", add_special_tokens=False)
    output_ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids)
    deltas = []
    for token in output_ids:
        detok.add_token(token)
        deltas.append(detok.take_delta())
    detok.finish()
    deltas.append(detok.take_delta())
    whole = tok.decode(prompt_ids + output_ids, skip_special_tokens=True)
    expected = whole[len(tok.decode(prompt_ids, skip_special_tokens=True)):]
    assert "".join(deltas) == expected == detok.output_text
    assert all("\ufffd" not in delta for delta in deltas)


def test_fast_tokenizer_stop_string_and_special_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    detok = IncrementalDetokenizer(tok, tok.encode("Hi", add_special_tokens=False), ["STOP"])
    stopped = False
    for token in [*tok.encode("one two STOP three", add_special_tokens=False), tok.eos_token_id]:
        stopped = detok.add_token(token)
        if stopped:
            break
    assert stopped
    detok.finish(stopped)
    assert detok.output_text == "one two "


def test_fast_tokenizer_leaves_out_an_unfinished_character(smollm2_tokenizer):
    tok = smollm2_tokenizer
    emoji_ids = tok.encode("🎉", add_special_tokens=False)
    assert len(emoji_ids) > 1, "the emoji must span tokens for this test to mean anything"
    detok = IncrementalDetokenizer(tok, [], ())
    for token in [*tok.encode("Party", add_special_tokens=False), emoji_ids[0]]:
        detok.add_token(token)
    detok.finish()
    assert detok.output_text == "Party" and "\ufffd" not in detok.take_delta()


def test_a_reply_cut_inside_a_character_has_no_replacement_character_in_its_output_or_the_run_log(
        monkeypatch, tmp_path):
    from kvscope.app.runlog import RunLogReader, record_run
    from kvscope.engine.config import EngineConfig, SamplingParams
    from kvscope.engine.fake_runner import FakeRunner, fake_engine

    reply = iter(TOKENIZER.encode("ok 日本"))     # max_tokens 4 cuts after the first byte of 日
    monkeypatch.setattr(FakeRunner, "_next_token", lambda self, *args: next(reply))
    engine = fake_engine(EngineConfig(num_blocks=16, max_model_len=64))
    streamed = []
    with record_run(engine, db_path=tmp_path / "runs.db") as log:
        engine.add_request("hi", SamplingParams(max_tokens=4, temperature=0.0))
        while engine.has_unfinished_requests():
            (output,) = engine.step().outputs
            streamed.append(output.text_delta)
    assert output.finish_reason == "length" and len(output.token_ids) == 4
    assert output.text == "".join(streamed) == "ok "        # what the chat pane streams and shows
    (row,) = RunLogReader(tmp_path / "runs.db").rows("requests", log.run_id)
    assert row["output_text"] == "ok "
