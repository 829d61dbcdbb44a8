"""The runner interface: both runners satisfy it, the engine and the app read nothing else, and sizing the
pool leaves the runner's own cache alone."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from invariants import run_checked

from kvscope.app.worker.factory import engine_info
from kvscope.engine import EngineConfig, LLMEngine, SamplingParams
from kvscope.engine.fake_runner import FakeRunner
from kvscope.engine.runner import Runner, RunnerInfo


def real_runner(**config):
    from models import tiny_model

    from kvscope.engine.model.model_runner import ModelRunner

    model, tokenizer = tiny_model()
    return ModelRunner(EngineConfig(dtype="float32", num_blocks=8, max_model_len=64, **config), model=model,
                       tokenizer=tokenizer)


class OnlyTheInterface:
    """A runner with nothing but what the Runner protocol names."""

    __slots__ = ("info", "tokenizer", "execute")

    def __init__(self, runner) -> None:
        self.info, self.tokenizer, self.execute = runner.info, runner.tokenizer, runner.execute


def test_both_runners_satisfy_the_protocol_with_a_frozen_info():
    runners = [FakeRunner(EngineConfig(block_size=4), num_blocks=8), real_runner()]
    for runner in runners:
        assert isinstance(runner, Runner) and isinstance(runner.info, RunnerInfo)
        assert list(inspect.signature(runner.execute).parameters) == ["batch"]
        with pytest.raises(dataclasses.FrozenInstanceError):
            runner.info.num_device_blocks = 1
    real = runners[1].info
    assert (real.device, real.dtype, real.block_size, real.num_device_blocks, real.num_host_blocks,
            real.max_model_len) == ("cpu", "float32", 16, 8, 0, 64)
    assert real.vocab_size == runners[1].model.get_output_embeddings().weight.shape[0]
    assert real.kv_cache_bytes == 8 * runners[1].bytes_per_block and "(8 blocks x " in real.banner
    assert runners[1].tokenizer.eos_token_id in real.eos_token_ids
    assert not isinstance(object(), Runner)


@pytest.mark.parametrize("which", ["fake", "real"])
def test_the_engine_and_the_app_need_nothing_but_the_interface(which):
    runner = FakeRunner(EngineConfig(block_size=4), num_blocks=16, max_model_len=64) if which == "fake" \
        else real_runner()
    config = EngineConfig(block_size=runner.info.block_size)
    engine = LLMEngine(config, runner=OnlyTheInterface(runner))
    assert engine.info is runner.info and engine.num_blocks == runner.info.num_device_blocks
    engine.add_request("hello there", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    engine.add_request([{"role": "user", "content": "hi"}], SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    finals = [o for o in run_checked(engine) if o.finished]
    assert sorted(len(o.token_ids) for o in finals) == [3, 5]
    info = engine_info(engine)
    assert info.runner is runner.info and info.config is engine.config


def test_profiling_the_forward_leaves_the_runner_s_cache_alone(monkeypatch):
    """Pool sizing on CUDA profiles one forward; it must not install or delete the runner's kv_cache.
    The CUDA calls are stood in for, so the profiled forward itself runs here on the CPU."""
    runner = real_runner()
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args: 12345)
    cache = runner.kv_cache
    before = cache.clone()
    assert runner.profile_forward_peak_bytes() == 12345
    assert runner.kv_cache is cache and torch.equal(cache, before)
    assert set(vars(runner)) >= {"kv_cache", "info"}


@pytest.mark.parametrize("token_ids, start_pos, table", [((1, 2, 3), 0, (8,)), ((5,), 16, (0, 9)), ((5,), 0, (-1,))])
def test_a_block_id_outside_the_pool_is_refused_before_any_kernel_reads_it(token_ids, start_pos, table):
    """Only an engine bug could send one; the C++ kernels would read and write outside the pool."""
    from kvscope.engine.batch import BatchItem, ScheduledBatch

    runner = real_runner()
    before = runner.kv_cache.clone()
    item = BatchItem(0, "r", token_ids, start_pos, table, (0,), SamplingParams(max_tokens=4))
    with pytest.raises(IndexError, match="outside the pool of 8"):
        runner.execute(ScheduledBatch(items=(item,)))
    assert torch.equal(runner.kv_cache, before)
