"""kvscope's engine: paged KV cache, continuous-batching scheduler and model runner.

Importing the package is light: torch and transformers load only when an
LLMEngine builds its model runner.
"""

from kvscope.engine.config import ConfigError, EngineConfig, RequestError, SamplingParams
from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.observer import EngineObserver
from kvscope.engine.outputs import CacheSnapshot, RequestOutput, StepResult, StepStats

__all__ = ["CacheSnapshot", "ConfigError", "EngineConfig", "EngineObserver", "LLMEngine", "RequestError",
           "RequestOutput", "SamplingParams", "StepResult", "StepStats"]
