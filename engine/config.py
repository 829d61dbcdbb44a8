"""Engine and sampling configuration: plain dataclasses, type-checked and validated on construction.

EngineConfig's fields are also the command line: app/cli.py makes one flag per field, named as vLLM
names it, with the help text kept here in each field's metadata, so a default or a check lives in
one place.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Union


class ConfigError(ValueError):
    """A configuration value the engine cannot run with. The message names the fix."""


class RequestError(ValueError):
    """A request the engine refuses. Raised by ``add_request``; the engine state is unchanged.

    ``param`` names what is refused: a SamplingParams field, "prompt" or "request_id" (None: the request as a
    whole), so a server can name the field of its own request without reading the message."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# Below this, sampling is greedy. Dividing logits by a smaller temperature overflows float32 (1e-38 gives
# inf, then NaN) and, well before that, already puts all the probability on the top token. vLLM uses the
# same threshold.
GREEDY_TEMPERATURE = 1e-5

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}


def parse_bytes(value: int | str | None, name: str, allow_zero: bool = False) -> int | None:
    """Accept 536870912, "512MiB", "0.5GiB" or "1G"; None passes through."""
    if value is None:
        return None
    if isinstance(value, int):
        size = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if not match or match.group(2).lower() not in _UNITS:
            raise ConfigError(f"{name}: cannot read {value!r} as a size; use bytes or e.g. '512MiB', '2GiB'")
        size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size < 0 or (size == 0 and not allow_zero):
        raise ConfigError(f"{name} must be {'0 or more' if allow_zero else 'positive'}, got {value!r}")
    return size


def _help(text: str, metavar: str | None = None) -> dict:
    return {"help": text, "metavar": metavar}


@dataclass
class EngineConfig:
    model: str = field(default="default", metadata=_help(
        "'default' (SmolLM2-135M-Instruct), a transformers model directory, a .gguf file, or a hub id "
        "when you have network"))
    device: str = field(default="auto", metadata=_help("auto, cpu, cuda or cuda:N"))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(default="auto", metadata=_help(
        "auto: bf16 on CUDA and on CPUs with native bf16 (AMX/AVX512-BF16), else fp32"))
    block_size: int = field(default=16, metadata=_help("tokens per KV block (power of two, 1-256)"))
    num_blocks: int | None = field(default=None, metadata=_help(
        "KV pool size in blocks; overrides --kv-cache-memory and --gpu-memory-utilization"))
    kv_cache_memory: int | str | None = field(default=None, metadata=_help(
        "KV pool size, e.g. 512MiB; on a GPU it replaces --gpu-memory-utilization's sizing, as vLLM's "
        "kv_cache_memory_bytes does (default: on a CPU 10% of RAM, at most 2GiB)", "SIZE"))
    gpu_memory_utilization: float = field(default=0.90, metadata=_help(
        "fraction of GPU memory for weights, activations and the KV pool"))
    swap_space: int | str = field(default="1GiB", metadata=_help(
        "host pool for swap-mode preemption, e.g. 1GiB; 0 for none (swap then falls back to recompute)",
        "SIZE"))
    max_model_len: int | None = field(default=None, metadata=_help(
        "longest prompt plus output, in tokens (default: the model's limit)"))
    max_num_seqs: int = field(default=256, metadata=_help("most requests running at once"))
    max_num_batched_tokens: int = field(default=2048, metadata=_help("token budget of one step"))
    enable_prefix_caching: bool = field(default=True, metadata=_help(
        "reuse KV blocks of identical prompt prefixes"))
    preemption_mode: Literal["recompute", "swap"] = field(default="recompute", metadata=_help(
        "what happens to a request pushed out when blocks run short"))
    allocator: Literal["paged", "contiguous"] = field(default="paged", metadata=_help(
        "contiguous reserves max_model_len per request: the pre-paging baseline"))
    seed: int = field(default=0, metadata=_help("seed of the sampler for requests without their own"))
    # On until a GPU run has checked the graphs (engine/model/cuda_graphs.py says what ran where); vLLM's default,
    # graphs on, is the one to come.
    enforce_eager: bool = field(default=True, metadata=_help(
        "CUDA: run decode steps eagerly; --no-enforce-eager replays them from CUDA graphs captured at start-up "
        "(not yet run on a GPU, so off by default)"))
    cpu_threads_bind: str = field(default="none", metadata=_help(
        "CPU: pin the compute threads, one per core, as vLLM does: none (the OS places them), auto (torch's "
        "thread count on the first cores, if there are enough), or cores like 0-1", "CORES"))

    def __post_init__(self) -> None:
        for name, hint in config_fields().items():
            setattr(self, name, _checked(name, getattr(self, name), hint, ConfigError))
        bs = self.block_size
        if bs < 1 or bs > 256 or bs & (bs - 1):
            raise ConfigError(f"block_size must be a power of two between 1 and 256, got {bs!r}")
        self.kv_cache_memory = parse_bytes(self.kv_cache_memory, "kv_cache_memory")
        self.swap_space = parse_bytes(self.swap_space, "swap_space", allow_zero=True)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("num_blocks", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}")
        if self.cpu_threads_bind not in ("auto", "none"):
            parse_cores(self.cpu_threads_bind)
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")


def parse_cores(text: str) -> list[int]:
    """A core list as ``--cpu-threads-bind`` takes it: ``"0-1,4"`` → [0, 1, 4]."""
    cores: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not match or (match.group(2) and int(match.group(2)) < int(match.group(1))):
            raise ConfigError(f"cpu_threads_bind: cannot read {text!r}; use auto, none, or cores like 0-1 or 0,2")
        first = int(match.group(1))
        cores.extend(range(first, int(match.group(2) or first) + 1))
    if len(set(cores)) != len(cores):
        raise ConfigError(f"cpu_threads_bind: {text!r} names a core twice")
    return cores


@functools.cache
def config_fields() -> dict[str, typing.Any]:
    """EngineConfig's field names and their resolved types, in declaration order."""
    hints = typing.get_type_hints(EngineConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(EngineConfig)}


def _checked(name: str, value, hint, error: type[ValueError]):
    """``value`` if it has type ``hint`` (ints as int, not bool; an int where a float goes), else ``error``."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    for option in options:
        if typing.get_origin(option) is Literal:
            if isinstance(value, str) and value in typing.get_args(option):
                return value
        elif option is type(None):
            if value is None:
                return value
        elif option is bool:
            if isinstance(value, bool):
                return value
        elif isinstance(value, bool):
            continue    # True is an int to Python, but never a block size or a count
        elif option is int and isinstance(value, numbers.Integral):
            return int(value)
        elif option is float and isinstance(value, numbers.Real):
            return float(value)
        elif option is str and isinstance(value, str):
            return value
    message = f"{name} must be {describe_type(hint)}, got {value!r}"
    raise error(message, name) if issubclass(error, RequestError) else error(message)


def describe_type(hint) -> str:
    """How a type reads in an error message: "an integer or None", "one of 'paged', 'contiguous'"."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        return " or ".join(describe_type(option) for option in typing.get_args(hint))
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(choice) for choice in typing.get_args(hint))
    return {type(None): "None", bool: "True or False", int: "an integer", float: "a number",
            str: "a string"}[hint]


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16     # None: whatever the context and the pool leave after the prompt
    temperature: float = 1.0    # below GREEDY_TEMPERATURE (0 included): greedy
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: Sequence[str] | str | None = ()
    stop_token_ids: Sequence[int] | None = ()
    ignore_eos: bool = False
    # False skips turning tokens into text (outputs carry token ids only), as vLLM's option of the same
    # name does: for callers that only want ids, like the bench with its synthetic prompts.
    detokenize: bool = True
    min_p: float = 0.0              # drop tokens under this share of the most likely one's probability
    # transformers' repetition penalty: a token already in the prompt or the output has a positive logit divided
    # by it, a negative one multiplied by it (1.0: off).
    repetition_penalty: float = 1.0
    # OpenAI's: subtracted from a token's logit once if it is in the output, and per time it is there.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None   # token id -> added to its logit, -100 .. 100
    min_tokens: int = 0             # stop tokens (EOS, stop_token_ids) are forbidden before this many
    bad_words: Sequence[str] | None = ()    # words never generated (as vLLM tokenizes them: with and without a space)
    # Log-probabilities of each sampled token and of the N most likely (0: the sampled one only; None: none),
    # and of each prompt token (costs the LM head over the whole prompt; the prompt then skips the prefix cache).
    # They come from the model's own distribution, before penalties, bias and temperature, as vLLM's do.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Constrained decoding: a grammar engine's spec (engine/structured.py), e.g. ("json_object", None) or
    # ("json_schema", schema); the sampler masks every token the grammar does not allow next.
    structured_output: tuple[str, object] | None = None

    def validate(self) -> None:
        """Raise RequestError naming the first bad field; change nothing."""
        self.normalized()

    def normalized(self) -> SamplingParams:
        """A checked copy for the engine to keep: the caller may change or reuse this object afterwards.

        Stop rules become tuples and a temperature below GREEDY_TEMPERATURE becomes 0.0 (greedy).
        """
        for name in ("n", "top_k"):
            _checked(name, getattr(self, name), int, RequestError)
        _checked("max_tokens", self.max_tokens, int | None, RequestError)
        for name in ("ignore_eos", "detokenize"):
            _checked(name, getattr(self, name), bool, RequestError)
        seed = _checked("seed", self.seed, int | None, RequestError)
        temperature = _checked("temperature", self.temperature, float, RequestError)
        top_p = _checked("top_p", self.top_p, float, RequestError)
        if self.n < 1:
            raise RequestError(f"n must be at least 1, got {self.n!r}", "n")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens!r}", "max_tokens")
        if not 0 <= temperature < math.inf:  # also refuses NaN
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}", "temperature")
        if not 0.0 < top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if self.top_k < -1:
            raise RequestError(f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k!r}", "top_k")
        stop = self._stop_strings()
        max_tokens = None if self.max_tokens is None else int(self.max_tokens)
        return dataclasses.replace(
            self, n=int(self.n), max_tokens=max_tokens, top_k=int(self.top_k), seed=seed,
            temperature=0.0 if temperature < GREEDY_TEMPERATURE else temperature, top_p=top_p,
            stop=stop, stop_token_ids=self._stop_token_ids(), **_checked_knobs(self))

    def _stop_strings(self) -> tuple[str, ...]:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is None:
            return ()
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise RequestError(f"stop must be a string or a list of strings, got {self.stop!r}", "stop")
        if not all(stop):
            raise RequestError("stop strings must be non-empty", "stop")
        if stop and not self.detokenize:
            raise RequestError("stop strings need detokenize=True: they are matched against the text", "stop")
        return tuple(stop)

    def _stop_token_ids(self) -> tuple[int, ...]:
        ids = self.stop_token_ids
        if ids is None:
            return ()
        if not isinstance(ids, (list, tuple, set, frozenset)) or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise RequestError(f"stop_token_ids must be a list of token ids (integers >= 0), got {ids!r}",
                               "stop_token_ids")
        return tuple(int(t) for t in ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def reads_more_than_logits(self) -> bool:
        """True when sampling needs the request's own state (its tokens, a grammar) or reports log-probabilities:
        only such requests take the sampler's slower path; everyone else skips it."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias) or self.min_tokens > 0 or bool(self.bad_words)
                or self.logprobs is not None or self.prompt_logprobs is not None
                or self.structured_output is not None)


def max_request_tokens(n: int, num_blocks: int, block_size: int, max_model_len: int, contiguous: bool) -> int:
    """The longest prompt plus reply one request of ``n`` samples may have on this pool, capped at
    max_model_len; 0 when not even one token fits. The inverse of KVCacheManager.max_blocks_needed, and the one
    place this rule is written: the engine sizes a request's default reply with it, the load presets their
    requests."""
    if contiguous:
        reservation = -(-max_model_len // block_size)
        return max_model_len if n * reservation <= num_blocks else 0
    # A paged sample at its peak holds prompt + reply - 1 tokens: the last sampled token is never written.
    per_sample = num_blocks // n * block_size
    return min(max_model_len, per_sample + 1) if per_sample else 0


def model_sampling(defaults: tuple[tuple[str, float | int], ...] = (), **fields) -> SamplingParams:
    """SamplingParams from a model's own defaults (RunnerInfo.sampling_defaults): greedy where the model asks
    for no sampling, as transformers' generate decodes it; ``fields`` win over both."""
    return SamplingParams(**({"temperature": 0.0} | dict(defaults) | fields))


MAX_LOGPROBS = 20       # top log-probabilities per token, as vLLM's default max_logprobs and OpenAI's top_logprobs
MAX_LOGIT_BIAS = 300    # entries, as OpenAI allows


def _checked_knobs(params: SamplingParams) -> dict:
    """The penalties, bias, bans, log-probability counts and grammar, checked; RequestError names the first bad
    one. Values that change nothing come back as the defaults, so a neutral request stays on the fast path."""
    def number(name: str, low: float, high: float) -> float:
        value = _checked(name, getattr(params, name), float, RequestError)
        if not low <= value <= high:
            raise RequestError(f"{name} must be in [{low:g}, {high:g}], got {getattr(params, name)!r}", name)
        return value

    repetition = _checked("repetition_penalty", params.repetition_penalty, float, RequestError)
    if not 0.0 < repetition < math.inf:
        raise RequestError(f"repetition_penalty must be a finite number > 0 (1: off), got "
                           f"{params.repetition_penalty!r}", "repetition_penalty")

    min_tokens = _checked("min_tokens", params.min_tokens, int, RequestError)
    if min_tokens < 0 or (params.max_tokens is not None and min_tokens > params.max_tokens):
        raise RequestError(f"min_tokens must be between 0 and max_tokens, got {params.min_tokens!r}", "min_tokens")
    counts = {}
    for name in ("logprobs", "prompt_logprobs"):
        value = _checked(name, getattr(params, name), int | None, RequestError)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise RequestError(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value!r}", name)
        counts[name] = value
    return {"min_p": number("min_p", 0.0, 1.0), "repetition_penalty": repetition,
            "presence_penalty": number("presence_penalty", -2.0, 2.0),
            "frequency_penalty": number("frequency_penalty", -2.0, 2.0), "min_tokens": min_tokens,
            "logit_bias": _logit_bias(params.logit_bias), "bad_words": _bad_words(params.bad_words),
            "structured_output": _structured_output(params.structured_output), **counts}


def _logit_bias(bias) -> dict[int, float] | None:
    if not bias:
        return None
    if not isinstance(bias, Mapping) or len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to numbers, got {bias!r:.80}",
                           "logit_bias")
    checked = {}
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
            raise RequestError(f"logit_bias: {token!r} is not a token id (an integer >= 0)", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not -100.0 <= value <= 100.0:
            raise RequestError(f"logit_bias: the bias of token {token} must be a number in [-100, 100], got "
                               f"{value!r}", "logit_bias")
        checked[int(token)] = float(value)
    return checked


def _bad_words(words) -> tuple[str, ...]:
    if words is None:
        return ()
    words = (words,) if isinstance(words, str) else words
    if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
        raise RequestError(f"bad_words must be a list of non-empty strings, got {words!r:.80}", "bad_words")
    return tuple(words)


def _structured_output(spec):
    if spec is None:
        return None
    if not (isinstance(spec, tuple) and len(spec) == 2 and spec[0] in ("json_object", "json_schema", "regex")):
        raise RequestError(f"structured_output must be ('json_object', None), ('json_schema', schema) or "
                           f"('regex', pattern), got {spec!r:.80}", "structured_output")
    return spec
