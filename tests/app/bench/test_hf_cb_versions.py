"""hf-cb builds transformers' continuous-batching config under the field names of the installed transformers:
the GPU check runs it on a GPU machine's own transformers, which may predate the lock's."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from models import tiny_model

from kvscope.app.bench import hf_cb
from kvscope.app.bench.workloads import BenchRequest, Workload, warm_up_request


@dataclass
class ConfigOf5_17:
    """transformers 5.17's ContinuousBatchingConfig, the fields hf-cb sets: the page was a block, and flash
    attention was never switched on by itself."""

    block_size: int = 256
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    max_requests_per_batch: int | None = None
    seed: int | None = None


class Built(Exception):
    """Stops the run once the manager would be built: the config is what this test is about."""


def test_on_transformers_5_17_the_page_size_is_given_as_its_block_size(monkeypatch):
    model, tok = tiny_model("llama")
    built = []

    def init_continuous_batching(generation_config=None, continuous_batching_config=None):
        built.append(continuous_batching_config)
        raise Built

    monkeypatch.setattr(hf_cb, "ContinuousBatchingConfig", ConfigOf5_17)
    monkeypatch.setattr(model, "init_continuous_batching", init_continuous_batching)
    settings = hf_cb.ContinuousSettings(page_size=16, max_batch_tokens=64, max_requests_per_batch=4)
    workload = Workload("tiny", (BenchRequest((2000, 2001, 2002), 2),), max_model_len=64, kv_cache_tokens=512)
    with pytest.raises(Built):
        hf_cb.ContinuousBatchRun(model, tok.pad_token_id, settings).run(workload, warm_up_request())
    assert built == [ConfigOf5_17(block_size=16, num_blocks=32, max_batch_tokens=64, max_requests_per_batch=4,
                                  seed=0)]
