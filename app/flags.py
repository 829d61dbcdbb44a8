"""The engine's command-line flags, made from EngineConfig's fields and named as vLLM names them.

Every subcommand that starts an engine takes them from here, so a new config
field is a new flag everywhere and the command line cannot drift from the config;
and builds its engine with first_engine, so a bad --model is one line everywhere.
The sampling knobs a person chats with (the window's chat pane and `kvscope chat`)
are registered here too, once, and checked by SamplingParams' own rules.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Iterable
from types import UnionType
from typing import TYPE_CHECKING, Literal, Union

from kvscope.engine.config import ConfigError, EngineConfig, RequestError, config_fields, model_sampling

if TYPE_CHECKING:
    from kvscope.engine import LLMEngine


def add_engine_flags(parser: argparse.ArgumentParser, names: Iterable[str] | None = None) -> None:
    """One flag per EngineConfig field (or per field named), as vLLM names it: block_size is --block-size.

    Defaults, types and choices come from the dataclass and the help text from each field's metadata, so
    the command line cannot drift from the config; EngineConfig itself checks the values.
    """
    group = parser.add_argument_group("engine")
    for spec in dataclasses.fields(EngineConfig):
        if names is not None and spec.name not in names:
            continue
        group.add_argument(f"--{spec.name.replace('_', '-')}", default=spec.default,
                           help=spec.metadata["help"].replace("%", "%%"), metavar=spec.metadata["metavar"],
                           **_flag_kind(config_fields()[spec.name]))


def _flag_kind(hint) -> dict:
    """argparse's type, choices or action for a field's type; a size that takes units stays a string."""
    options = set(typing.get_args(hint)) - {type(None)} if typing.get_origin(hint) in (Union, UnionType) else {hint}
    if options == {bool}:
        return {"action": argparse.BooleanOptionalAction}
    if len(options) == 1 and typing.get_origin(hint) is Literal:
        return {"choices": typing.get_args(hint)}
    if options == {int}:
        return {"type": int}
    if options == {float}:
        return {"type": float}
    return {"type": str}


def add_log_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", default=None, help="run log SQLite file (default: in the user data dir)")
    parser.add_argument("--no-log", action="store_true", help="do not log this run")


# The SamplingParams fields a chat takes from the command line, with their help. Unset, each comes from the
# model's generation_config (greedy for SmolLM2), as vLLM and transformers' generate take it.
SAMPLING_FLAGS: dict[str, tuple[type, str]] = {
    "temperature": (float, "0 for greedy"),
    "top_p": (float, "keep the most likely tokens up to this much probability (1: off)"),
    "top_k": (int, "keep the k most likely tokens (-1: off)"),
    "min_p": (float, "drop tokens under this share of the most likely one's probability (0: off)"),
    "repetition_penalty": (float, "transformers' penalty on tokens already in the prompt or reply (1: off)"),
    "presence_penalty": (float, "OpenAI's: subtracted once from a token already in the reply (0: off)"),
    "frequency_penalty": (float, "OpenAI's: subtracted per time a token is already in the reply (0: off)"),
}   # no seed: the engine's own --seed already seeds every request that brings none


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (default: the model's generation_config; greedy for SmolLM2)")
    for name, (kind, text) in SAMPLING_FLAGS.items():
        group.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help=text)


def sampling_from_args(args: argparse.Namespace) -> tuple[tuple[str, float | int], ...]:
    """The knobs typed, as (field, value) pairs over the model's defaults; ConfigError naming the flag for a bad
    one, raised before any model loads."""
    chosen = tuple((name, getattr(args, name)) for name in SAMPLING_FLAGS if getattr(args, name, None) is not None)
    try:
        model_sampling(**dict(chosen)).validate()
    except RequestError as exc:
        raise ConfigError(f"--{(exc.param or 'sampling').replace('_', '-')}: {exc}") from None
    return chosen


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{name: getattr(args, name) for name in config_fields()})


def first_engine(config: EngineConfig) -> LLMEngine | None:
    """Build the engine before a window opens or a server listens, as `kvscope chat` does: a bad --model or a
    pool that cannot be made fails here, in one line and exit status 2 (main catches USER_ERRORS), instead of
    in a full-screen window that can only show it."""
    from kvscope.engine import LLMEngine

    print(f"kvscope: loading {config.model} …", file=sys.stderr, flush=True)
    try:
        return LLMEngine(config)
    except (RuntimeError, MemoryError) as exc:   # torch cannot allocate the pool (a huge --num-blocks)
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        print(f"kvscope: error: cannot build the engine: {reason}", file=sys.stderr)
        return None
