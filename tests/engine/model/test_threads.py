"""Which threads do the model's parallel work (engine/model/threads.py): the runner is built on a thread that ends
with the build, and the thread that steps it is the one pinned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
from models import tiny_model

from kvscope.engine import EngineConfig, LLMEngine, SamplingParams
from kvscope.engine.config import ConfigError
from kvscope.engine.model.threads import built_apart


def test_a_build_runs_on_a_thread_that_is_gone_once_it_returns():
    builders = []

    def build():
        builders.append(threading.current_thread())
        return "runner"

    assert built_apart(build) == "runner"
    [builder] = builders
    assert builder is not threading.current_thread() and not builder.is_alive()


def test_what_a_build_raises_reaches_the_caller_as_it_is():
    def build():
        raise ConfigError("model: no such directory")

    with pytest.raises(ConfigError, match="no such directory"):
        built_apart(build)


def test_a_core_this_process_may_not_use_is_refused_at_build_not_at_the_first_step():
    outside = max(os.sched_getaffinity(0)) + 1
    model, tokenizer = tiny_model()
    with pytest.raises(ConfigError, match=rf"core\(s\) \[{outside}\] are not available to this process"):
        LLMEngine(EngineConfig(cpu_threads_bind=str(outside), num_blocks=16), model=model, tokenizer=tokenizer)
    engine = LLMEngine(EngineConfig(num_blocks=16), model=model, tokenizer=tokenizer)    # the same model serves
    [output] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(output.token_ids) == 3


# The default model, built on the main thread's call and stepped from another thread, as `kvscope serve` and the
# window do; in a process of its own, since pinning changes the affinity of the threads that run it.
STEPPED_FROM_A_THREAD = """
import json, os, threading
import torch
from kvscope.engine import EngineConfig, LLMEngine, SamplingParams

engine = LLMEngine(EngineConfig(cpu_threads_bind="auto", max_model_len=256))
seen = {"caller_after_build": sorted(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads()}

def step():
    [output] = engine.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0.0))
    seen["tokens"] = len(output.token_ids)
    seen["stepper"] = sorted(os.sched_getaffinity(threading.get_native_id()))
    seen["bound"] = engine.runner.bound_cores

stepper = threading.Thread(target=step)
stepper.start()
stepper.join()
seen["caller_after_steps"] = sorted(os.sched_getaffinity(0))
seen["threads"] = [thread.name for thread in threading.enumerate()]
print(json.dumps(seen))
"""


def test_the_thread_that_steps_the_model_is_the_one_pinned(tmp_path):
    out = subprocess.run([sys.executable, "-c", STEPPED_FROM_A_THREAD], capture_output=True, text=True,
                         check=True, cwd=tmp_path).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    allowed = seen["caller_after_steps"]
    pinned = allowed[:seen["torch_threads"]]
    assert seen["tokens"] == 2
    assert seen["caller_after_build"] == allowed      # building pinned nobody
    assert seen["bound"] == pinned and seen["stepper"] == pinned[:1]     # the stepper is thread 0 of its team
    assert "kvscope-model-build" not in seen["threads"]
