"""The C++ CPU kernels (paged attention, the packed linear, RMSNorm, rotary, the sampler's random rows, thread
pinning): built once per machine, loaded as torch ops.

The torch reference path moves every context byte several times (gather, upcast, matmul, softmax,
embedding_bag); the C++ kernels read each key and value row out of the pool once. They are compiled on first
use with the machine's own C++ compiler (``-O3 -march=native -fopenmp``) against the installed torch, into the
user cache dir, keyed by the source, torch version, compiler and CPU; processes starting together share one
build through a file lock. Later starts load the cached library in milliseconds.

Where no compiler is found or the build fails, one line on stderr says so and the torch reference serves
instead, as it does for dtypes the C++ code does not cover (float16, float64). ``KVSCOPE_CPU_KERNELS=torch``
forces the reference path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from kvscope.kernels import reference
from kvscope.kernels.reference import copy_blocks, store_kv, swap_blocks

__all__ = ["available", "bind_threads", "copy_blocks", "cpu_flags", "first_argmax", "has_amx", "huge_page_zeros",
           "is_packed_linear_weight", "linear", "linear_available", "pack_linear_weight", "paged_decode_attention",
           "paged_prefill_attention", "rms_norm", "rotary", "sample_nucleus", "status", "store_kv", "supports",
           "swap_blocks", "unpack_linear_weight"]

# One library: attention (its ops, decode and prefill), the packed linear, RMSNorm, rotary, the sampler, thread
# pinning.
SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("paged_attention_cpu.cpp", "paged_decode_cpu.cpp", "paged_prefill_cpu.cpp",
                             "linear_cpu.cpp", "linear_amx_cpu.cpp", "norm_cpu.cpp", "rotary_cpu.cpp",
                             "sampler_cpu.cpp", "threads_cpu.cpp"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("paged_attention_cpu.h", "linear_cpu.h"))
DTYPES = (torch.float32, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128, 256)  # the C++ code's instances: head_dim is a compile-time constant there
_FORCE_TORCH = "KVSCOPE_CPU_KERNELS"
_BUILD_TIMEOUT_S = 900
_HUGE_PAGE = 2 * 2**20
_MADV_HUGEPAGE = 14  # Linux
_PANEL = 16          # output columns per panel of a packed linear weight (linear_cpu.cpp's kLanes)
_NEVER = 2**62       # bf16_min_rows that keeps a linear on the exact (fp32-activation) path
# From this many rows up a bf16 linear runs on AMX tiles where the CPU has them (linear_amx_cpu.cpp). Measured
# on SmolLM2's four shapes, weights out of L2 as in a model: at 1-3 rows the vdpbf16ps path is up to 1.15x
# faster (no tiles to set up, no padding to 16 rows); AMX is 1.05-1.1x faster at 4, 1.2x at 6, 3-4x at 32.
AMX_MIN_ROWS = 4


class BuildError(RuntimeError):
    """The C++ kernels could not be built or loaded; the message says why, in a few words."""


def build_dir() -> Path:
    """Where built kernels live: beside the model cache (``KVSCOPE_CACHE`` or the user cache dir)."""
    import platformdirs

    override = os.environ.get("KVSCOPE_CACHE")
    root = Path(override).expanduser() if override else Path(platformdirs.user_cache_dir("kvscope"))
    return root / "kernels"


def _compiler() -> str:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler or not shutil.which(compiler):
        raise BuildError("no C++ compiler found (install g++, or set CXX)")
    return compiler


def cpu_flags() -> str:
    """The CPU's feature flags line, as /proc/cpuinfo gives it (part of the build's cache key)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _library_path(compiler: str) -> Path:
    key = hashlib.sha256()
    for part in (*(source.read_bytes() for source in (*SOURCES, *HEADERS)), torch.__version__.encode(),
                 compiler.encode(), cpu_flags().encode()):
        key.update(part)
    return build_dir() / f"kvscope_cpu-{key.hexdigest()[:16]}.so"


def _compile_command(compiler: str, output: Path) -> list[str]:
    torch_dir = Path(torch.__file__).parent
    include, lib = torch_dir / "include", torch_dir / "lib"
    return [compiler, "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++20",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            "-isystem", str(include), "-isystem", str(include / "torch" / "csrc" / "api" / "include"),
            *map(str, SOURCES), "-o", str(output), "-L", str(lib), "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]


def _build(compiler: str, target: Path) -> None:
    """Compile into a temporary file beside ``target``, then rename: a reader never sees half a library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    print("kvscope: building the C++ CPU kernels (once per machine, about a minute) ...", file=sys.stderr,
          flush=True)
    handle, temporary = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        result = subprocess.run(_compile_command(compiler, Path(temporary)), capture_output=True, text=True,
                                timeout=_BUILD_TIMEOUT_S, check=False)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise BuildError(f"{Path(compiler).name} failed: {last[:200]}")
        os.replace(temporary, target)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"build failed: {exc}") from exc
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _build_locked(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, at worst two builds race to the same rename
        fcntl = None
    with open(target.parent / ".build.lock", "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():  # another process may have built it while this one waited
            _build(compiler, target)


def _load() -> str:
    """Build if needed and load; returns the library's path."""
    if os.environ.get(_FORCE_TORCH, "").lower() == "torch":
        raise BuildError(f"{_FORCE_TORCH}=torch")
    compiler = _compiler()
    target = _library_path(compiler)
    if not target.exists():
        _build_locked(compiler, target)
    try:
        torch.ops.load_library(str(target))
    except OSError as exc:
        raise BuildError(f"cannot load {target.name}: {exc}") from exc
    return str(target)


@functools.cache
def status() -> str:
    """Which CPU attention path serves: the C++ kernels, or why the torch one does."""
    try:
        _load()
    except BuildError as exc:
        if not str(exc).startswith(_FORCE_TORCH):
            print(f"kvscope: C++ CPU kernels unavailable ({exc}); using the torch attention path (slower)",
                  file=sys.stderr, flush=True)
        return f"torch kernels ({exc})"
    _register_fakes()
    return "C++ kernels"


def available() -> bool:
    return status() == "C++ kernels"


def supports(query: torch.Tensor, kv_layer: torch.Tensor) -> bool:
    return (query.dtype == kv_layer.dtype and kv_layer.dtype in DTYPES and query.shape[-1] in HEAD_DIMS
            and kv_layer.is_contiguous() and available())


def _register_fakes() -> None:
    """Shapes for torch.compile and meta tensors: both ops return a tensor shaped like the query."""
    for name in ("paged_decode_attention", "paged_prefill_attention"):
        torch.library.register_fake(f"kvscope_cpu::{name}")(lambda query, *args: torch.empty_like(query))
    torch.library.register_fake("kvscope_cpu::rms_norm")(
        lambda x, weight, eps: x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)))
    torch.library.register_fake("kvscope_cpu::linear")(
        lambda x, packed, out_features, bias, out_dtype, min_rows, amx_min_rows: x.new_empty(
            (*x.shape[:-1], out_features), dtype=out_dtype))


def linear_available() -> bool:
    """Whether kvscope's own packed linear (``linear_cpu.cpp``) serves; it is part of the same library."""
    return available()


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] (fp32 or bf16) in the layout ``linear`` reads: panels of 16 output columns."""
    return torch.ops.kvscope_cpu.pack_linear_weight(weight)


def is_packed_linear_weight(packed: torch.Tensor) -> bool:
    return packed.dim() in (3, 4) and packed.shape[-1 if packed.dim() == 3 else -2] == _PANEL


def unpack_linear_weight(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The dense [N, K] weight back, exactly (packing only moves values)."""
    if packed.dim() == 4:   # bf16: [panels, K/2, 16, 2]
        dense = packed.permute(0, 2, 1, 3).reshape(packed.shape[0] * _PANEL, -1)
    else:                   # fp32: [panels, K, 16]
        dense = packed.permute(0, 2, 1).reshape(packed.shape[0] * _PANEL, -1)
    return dense[:out_features, :in_features].contiguous()


def has_amx() -> bool:
    """Whether the packed linear can run on AMX tiles: built for a CPU with AMX-BF16, and Linux granted them."""
    return available() and bool(torch.ops.kvscope_cpu.has_amx())


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, exact: bool = False, amx_min_rows: int = AMX_MIN_ROWS) -> torch.Tensor:
    """``x @ W.T + bias`` on a packed weight; the output has ``x``'s dtype unless ``out_dtype`` says otherwise.

    With bf16 weights the product is of ``x`` rounded to bf16 (as a stock bf16 linear computes it), unless
    ``exact``: then ``x`` stays fp32 and the result is the fp32 product of the bf16 weights (the LM head's logits).
    The rounded product runs on AMX tiles from ``amx_min_rows`` rows up where ``has_amx()``, summed in fp32 too.
    """
    out_dtype = out_dtype or x.dtype
    return torch.ops.kvscope_cpu.linear(x, packed, out_features, bias, out_dtype, _NEVER if exact else 1,
                                        amx_min_rows)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm formula in one op (``norm_cpu.cpp``): ``weight * normalized(x).to(x.dtype)``."""
    return torch.ops.kvscope_cpu.rms_norm(x, weight, eps)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rotate-half rotary in one op (``rotary_cpu.cpp``): ``x * cos + rotate_half(x) * sin`` for q and
    k [batch, heads, tokens, dim] in fp32, with cos and sin [batch, tokens, dim]; every bit the stock formula's."""
    return torch.ops.kvscope_cpu.rotary(q, k, cos, sin)


def first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum in fp32 ``logits`` [rows, vocab] (``sampler_cpu.cpp``); -1 for a row holding NaN."""
    return torch.ops.kvscope_cpu.first_argmax(logits)


def sample_nucleus(logits: torch.Tensor, scales: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor,
                   uniforms: torch.Tensor) -> torch.Tensor:
    """A token per row of fp32 ``logits`` [rows, vocab] (``sampler_cpu.cpp``): softmax of logits * scale (one over
    the temperature), min-p, then a top-p draw using the row's ``uniforms`` [rows, rounds + 1]; -1 for a row
    holding NaN or nothing drawable."""
    return torch.ops.kvscope_cpu.sample_nucleus(logits, scales, top_ps, min_ps, uniforms)


def bind_threads(cpus: list[int]) -> list[int]:
    """Pin the calling thread's OpenMP team, thread i to ``cpus[i]`` (``threads_cpu.cpp``); torch then runs that
    many threads. Returns the core each thread was bound to, -1 where the OS refused."""
    return list(torch.ops.kvscope_cpu.bind_threads(list(cpus)))


def _rows(query: torch.Tensor) -> torch.Tensor:
    return query if query.stride(-1) == 1 else query.contiguous()


def _int32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.int32).contiguous()


def _sinks(sinks: torch.Tensor | None) -> torch.Tensor | None:
    return None if sinks is None else sinks.detach().to(torch.float32).contiguous()


def paged_decode_attention(query, kv_layer, block_tables, context_lens, scale, sliding_window=None, softcap=None,
                           sinks=None) -> torch.Tensor:
    if not supports(query, kv_layer):
        return reference.paged_decode_attention(query, kv_layer, block_tables, context_lens, scale, sliding_window,
                                                softcap, sinks)
    return torch.ops.kvscope_cpu.paged_decode_attention(_rows(query), kv_layer, _int32(block_tables),
                                                        _int32(context_lens), float(scale), sliding_window or 0,
                                                        float(softcap or 0.0), _sinks(sinks))


def paged_prefill_attention(query, kv_layer, block_tables, cu_seqlens_q, context_lens, scale, max_query_len=None,
                            sliding_window=None, softcap=None, sinks=None) -> torch.Tensor:
    if not supports(query, kv_layer):
        return reference.paged_prefill_attention(query, kv_layer, block_tables, cu_seqlens_q, context_lens, scale,
                                                 max_query_len, sliding_window, softcap, sinks)
    return torch.ops.kvscope_cpu.paged_prefill_attention(_rows(query), kv_layer, _int32(block_tables),
                                                         _int32(cu_seqlens_q), _int32(context_lens), float(scale),
                                                         sliding_window or 0, float(softcap or 0.0), _sinks(sinks))


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor backed by transparent huge pages where Linux allows (THP "madvise" or "always").

    Decode reads blocks scattered over the whole pool; with 4 KiB pages nearly every block costs a TLB miss.
    Measured here, decode attention ran 1.1-1.6x faster over a huge-page pool. The advice must come before the
    pages are first touched, hence empty, advise, then zero.
    """
    tensor = torch.empty(shape, dtype=dtype)
    _advise_huge_pages(tensor)
    return tensor.zero_()


def _advise_huge_pages(tensor: torch.Tensor) -> None:
    """Best effort: the whole huge pages inside the tensor's memory; no error if the OS declines."""
    nbytes = tensor.numel() * tensor.element_size()
    start = -(-tensor.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (tensor.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if not sys.platform.startswith("linux") or end <= start:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass
