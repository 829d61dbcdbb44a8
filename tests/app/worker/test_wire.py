"""What crosses the engine process's pipe (app/worker/wire.py): every step rebuilt as the engine made it.

Real engines on the checked FakeRunner, with pools small enough to preempt (recompute and swap), batched and
thinned exactly as the engine thread batches them for the window; each decoded step is compared with the step
the engine returned: block arrays, views (block tables included), stats, events and outputs.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvscope.app.messages import (
    EngineReady,
    EngineStepped,
    QueueChanged,
    RunState,
    RunStateChanged,
    StepBatch,
    StepsReady,
)
from kvscope.app.worker.factory import engine_info
from kvscope.app.worker.step_posting import WHOLE_STEPS, slimmed, thinned
from kvscope.app.worker.wire import MessageDecoder, MessageEncoder, WireError
from kvscope.engine.block_changes import KEYFRAME_VERSIONS
from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.fake_runner import fake_engine


def busy_engine(seed: int, preemption_mode: str):
    engine = fake_engine(EngineConfig(num_blocks=32, block_size=4, max_model_len=96, max_num_seqs=6,
                                      preemption_mode=preemption_mode, seed=seed))
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(12)]
    for _ in range(8):
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(256) for _ in range(rng.randrange(1, 20))]
        engine.add_request(prompt, SamplingParams(max_tokens=rng.randrange(1, 24), temperature=0.0,
                                                  ignore_eos=True, n=rng.choice((1, 1, 2))))
    return engine


def assert_same_step(decoded, original, whole: bool) -> None:
    for got, want in zip(decoded.snapshot.blocks.arrays(), original.snapshot.blocks.arrays(), strict=True):
        np.testing.assert_array_equal(got, want)
    assert decoded.snapshot.step == original.snapshot.step
    assert decoded.snapshot.requests == (original.snapshot.requests if whole else ())
    assert decoded.stats == original.stats
    assert decoded.events == original.events and decoded.kv_events == original.kv_events
    assert decoded.outputs == original.outputs


@pytest.mark.parametrize("encoded_at_join", [False, True], ids=["thinned", "encoded as thinned"])
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("seed", range(3))
def test_every_step_crosses_as_the_engine_made_it(seed, preemption_mode, encoded_at_join):
    """Steps thinned as the window's own thread thins them, or encoded as they are thinned, as an engine
    process does (MessageEncoder.thin_step)."""
    engine = busy_engine(seed, preemption_mode)
    encoder, decoder = MessageEncoder(), MessageDecoder()
    thin = (lambda older: encoder.thin_step(slimmed(older, set()))) if encoded_at_join else \
        (lambda older: thinned(older, set()))
    rng = random.Random(seed)
    steps = 0
    while engine.has_unfinished_requests():
        batch, originals = StepBatch(), []
        for _ in range(rng.randrange(1, 8)):
            if not engine.has_unfinished_requests():
                break
            result = slimmed(engine.step(), set())
            originals.append(result)
            batch.add(EngineStepped(result))
            batch.thin(WHOLE_STEPS, thin)
        received = decoder.decode(encoder.encode(StepsReady(batch))).batch.take()
        assert len(received) == len(originals)
        for index, (got, want) in enumerate(zip(received, originals, strict=True)):
            assert_same_step(got.result, want, whole=index >= len(originals) - WHOLE_STEPS)
        steps += len(originals)
        if rng.random() < 0.2:      # a look between steps, as a paused engine's QueueChanged sends it
            peek = engine.snapshot()
            got = decoder.decode(encoder.encode(QueueChanged(peek))).snapshot
            assert got.requests == peek.requests
            for a, b in zip(got.blocks.arrays(), peek.blocks.arrays(), strict=True):
                np.testing.assert_array_equal(a, b)
    assert steps > 20


def test_a_step_encoded_as_it_was_thinned_can_be_given_its_views_again():
    """A post the engine process did not foresee: its newest step was thinned (encoded) as it joined, and is sent
    with the views of the engine between steps, which are that step's."""
    engine = busy_engine(1, "recompute")
    encoder, decoder = MessageEncoder(), MessageDecoder()
    for _ in range(12):
        batch = StepBatch()
        result = engine.step()
        batch.add(EngineStepped(result))
        batch.thin(0, encoder.thin_step)
        batch.restore_newest(lambda step: encoder.restore_views(step, engine.snapshot()))
        got = decoder.decode(encoder.encode(StepsReady(batch))).batch.take()[0].result
        assert_same_step(got, result, whole=True)


def test_the_window_side_keeps_its_chain_short():
    """Past KEYFRAME_VERSIONS changes in a row, the decoded version is made whole, as the engine's own are."""
    engine = fake_engine(EngineConfig(num_blocks=128, block_size=4, max_model_len=4 * KEYFRAME_VERSIONS))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=KEYFRAME_VERSIONS + 10, temperature=0, ignore_eos=True))
    encoder, decoder = MessageEncoder(), MessageDecoder()
    longest = 0
    for _ in range(KEYFRAME_VERSIONS + 5):
        batch = StepBatch()
        batch.add(EngineStepped(engine.step()))
        got = decoder.decode(encoder.encode(StepsReady(batch))).batch.take()[0].result.snapshot.blocks
        chain, node = 0, got
        while node._arrays is None:
            chain, node = chain + 1, node._previous
        longest = max(longest, chain)
    assert longest <= KEYFRAME_VERSIONS


def test_a_step_missing_from_the_chain_is_an_error_not_a_wrong_picture():
    engine = busy_engine(0, "recompute")
    encoder, decoder = MessageEncoder(), MessageDecoder()
    sent = []
    for _ in range(3):
        batch = StepBatch()
        batch.add(EngineStepped(engine.step()))
        sent.append(encoder.encode(StepsReady(batch)))
    decoder.decode(sent[0])
    with pytest.raises(WireError):
        decoder.decode(sent[2])


def test_other_messages_cross_whole():
    encoder, decoder = MessageEncoder(), MessageDecoder()
    message = decoder.decode(encoder.encode(RunStateChanged(RunState(True, 2.5))))
    assert isinstance(message, RunStateChanged) and message.state == RunState(True, 2.5)


def one_step(encoder, decoder, engine):
    batch = StepBatch()
    batch.add(EngineStepped(engine.step()))
    data = encoder.encode(StepsReady(batch))
    return data, decoder.decode(data).batch.take()[0].result


def test_a_new_engine_with_the_same_request_ids_starts_its_tables_afresh():
    """A lesson rebuilds its engine and adds the same requests again, at the same arrival indices: the window must
    not read the new tables as grown from the old engine's."""
    encoder, decoder = MessageEncoder(), MessageDecoder()
    for seed, prompt in ((0, list(range(3, 30))), (1, list(range(40, 75)))):
        engine = fake_engine(EngineConfig(num_blocks=32, block_size=4, max_model_len=96, seed=seed))
        engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), request_id="r0")
        decoder.decode(encoder.encode(EngineReady(engine_info(engine), engine.banner, None)))
        for _ in range(6):
            _, got = one_step(encoder, decoder, engine)
            assert got.snapshot.requests == engine.snapshot().requests


def test_a_prompt_preview_crosses_once():
    engine = fake_engine(EngineConfig(num_blocks=64, block_size=4, max_model_len=128))
    engine.add_request("a long prompt whose preview must not cross the pipe every step", SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True), request_id="r0")
    encoder, decoder = MessageEncoder(), MessageDecoder()
    sent = [one_step(encoder, decoder, engine) for _ in range(4)]
    preview = sent[0][1].snapshot.requests[0].prompt_preview
    assert preview and all(got.snapshot.requests[0].prompt_preview == preview for _, got in sent)
    assert [preview.encode() in data for data, _ in sent] == [True, False, False, False]
