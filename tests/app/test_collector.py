"""The collector's policy for an engine loop (app/collector.py): decode steps of a big batch stop setting off a
young collection each, and every `kvscope` command runs under it."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from runlog_faults import make_log

from kvscope.app import cli
from kvscope.app.collector import YOUNG_THRESHOLD, tune_for_engine_loop
from kvscope.app.messages import EngineReady
from kvscope.app.worker.process import EngineProcess
from kvscope.engine.config import EngineConfig, SamplingParams
from kvscope.engine.fake_runner import FakeRunner, build_fake_engine
from kvscope.engine.llm_engine import LLMEngine

BATCH = 256
STEPS = 30


@pytest.fixture
def default_thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)     # CPython's own
    yield
    gc.set_threshold(*saved)


def decoding_batch() -> LLMEngine:
    config = EngineConfig(block_size=16, num_blocks=8_192, max_num_seqs=BATCH, max_num_batched_tokens=8_192)
    engine = LLMEngine(config, runner=FakeRunner(config, max_model_len=512, verify=False))
    params = SamplingParams(max_tokens=2 * STEPS + 8, temperature=0.0, ignore_eos=True)
    for index in range(BATCH):
        engine.add_request([index % 200 + 1] * 20, params)
    while engine.step().stats.num_prefill_tokens:
        pass
    return engine


def young_collections(engine: LLMEngine, steps: int) -> int:
    started = []

    def count(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 0:
            started.append(1)

    gc.callbacks.append(count)
    try:
        for _ in range(steps):
            assert engine.step().stats.num_decode_tokens == BATCH
    finally:
        gc.callbacks.remove(count)
    return len(started)


def test_decode_steps_of_a_big_batch_set_off_a_tenth_of_the_young_collections(default_thresholds):
    engine = decoding_batch()
    by_default = young_collections(engine, STEPS)
    tune_for_engine_loop()
    tuned = young_collections(engine, STEPS)
    assert by_default >= STEPS // 2     # about one a step (29-41 in 30 steps here): what the policy is for
    assert tuned <= by_default // 10
    assert gc.get_threshold()[1:] == (10, 10)     # the older generations keep their ratios


def test_every_command_runs_under_the_policy(default_thresholds, tmp_path, capsys):
    make_log(tmp_path / "runs.db")
    assert cli.main(["--db", str(tmp_path / "runs.db"), "runs"]) == 0
    assert gc.get_threshold()[0] == YOUNG_THRESHOLD


class ThresholdReporting:
    """An engine factory for an engine process that writes the collector's thresholds there to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, config, previous=None):
        Path(self.path).write_text(" ".join(map(str, gc.get_threshold())))
        return build_fake_engine(config, previous)


def test_the_engine_process_runs_under_the_policy_too(default_thresholds, tmp_path):
    """A process of its own starts a fresh interpreter, with CPython's thresholds: the command line's setting
    stayed in the window's process, and the engine ran a tenth slower for it."""
    report = tmp_path / "thresholds"
    process = EngineProcess(None, EngineConfig(num_blocks=32, block_size=4, max_model_len=64),
                            engine_factory=ThresholdReporting(str(report)))
    try:
        assert isinstance(process.wait_until_built(120), EngineReady)
    finally:
        process.close()
    assert report.read_text().split()[0] == str(YOUNG_THRESHOLD)
