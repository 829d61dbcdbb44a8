"""Building the app's engines: the first one (checked before the window opens), and each rebuild,
which keeps the weights when only the cache settings change; and what the header shows of one."""

from __future__ import annotations

from collections.abc import Callable

from kvscope.app.messages import EngineInfo
from kvscope.engine.config import EngineConfig


def build_engine(config: EngineConfig, previous=None):
    """A new LLMEngine; reuses the previous engine's weights when only the cache settings changed."""
    from kvscope.engine import LLMEngine

    model = getattr(getattr(previous, "runner", None), "model", None)
    if model is not None and previous.config.model == config.model and previous.config.dtype == config.dtype:
        return LLMEngine(config, model=model, tokenizer=previous.tokenizer)
    return LLMEngine(config)


def first_engine_then_build(engine) -> Callable:
    """An engine factory that hands out ``engine`` (built before the window opened) for the first
    build, and builds every later one with build_engine."""
    unused = [engine]

    def factory(config: EngineConfig, previous=None):
        if unused and previous is None and config == unused[0].config:
            return unused.pop()
        return build_engine(config, previous)

    return factory


def engine_info(engine) -> EngineInfo:
    """Header facts, from the runner's RunnerInfo."""
    info = engine.info
    return EngineInfo(model_name=info.model_name, device=info.device, dtype=info.dtype,
                      block_size=info.block_size, num_blocks=info.num_device_blocks,
                      num_host_blocks=info.num_host_blocks, max_model_len=info.max_model_len,
                      kv_cache_bytes=info.kv_cache_bytes, config=engine.config,
                      sampling_defaults=info.sampling_defaults, kv_layout=info.kv_layout)
