"""Compile the Triton kernels for real NVIDIA targets ahead of time; no GPU needed.

The interpreter checks what the kernels compute but not whether they lower: dot shape limits, types, register
pressure. This runs the real compiler down to a cubin (Triton's bundled ptxas) for each kernel at the launch
parameters the wrappers use, and prints each build's register and stack (spill) use as JSON lines.

Run in its own process: kernels defined under TRITON_INTERPRET=1 cannot be compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvscope.kernels import triton_ops  # noqa: E402

INT32_POINTERS = {"block_tables_ptr", "context_lens_ptr", "cu_seqlens_q_ptr"}
INT64_POINTERS = {"slot_ptr", "src_ptr", "dst_ptr"}
TRITON_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def signature(kernel, constants: dict, dtype: torch.dtype) -> dict[str, str]:
    def arg_type(name: str) -> str:
        if name in constants:
            return "constexpr"
        if name in INT32_POINTERS:
            return "*i32"
        if name in INT64_POINTERS:
            return "*i64"
        if name == "sinks_ptr":
            return "*fp32"
        if name.endswith("_ptr"):
            return "*" + TRITON_DTYPE[dtype]
        return "fp32" if name in ("scale_log2e", "softcap_log2e") else "i32"

    return {name: arg_type(name) for name in kernel.arg_names}


def resource_usage(cubin: bytes) -> dict[str, int]:
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        command = [str(cuobjdump), "-res-usage", file.name]
        text = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    fields = next(line for line in text.splitlines() if "REG:" in line).split()
    return {key.lower(): int(value) for key, value in (field.split(":")[:2] for field in fields[:2])}


def build(kernel, meta: dict, dtype: torch.dtype, capability: int) -> dict:
    constants = {name: value for name, value in meta.items() if name != "num_warps"}
    source = ASTSource(kernel, signature(kernel, constants, dtype), constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": meta.get("num_warps", 4)})
    return resource_usage(compiled.asm["cubin"])


def builds(head_dims: list[int]) -> list[tuple[str, object, dict, torch.dtype]]:
    """(name, kernel, meta, cache dtype) for each kernel at the parameters its wrapper launches with: attention
    plain, and with soft-capping and sinks both compiled in."""
    ops = triton_ops
    plain, variants = ops._variant_meta(None, None), ops._variant_meta(30.0, torch.zeros(1))
    result = []
    for dtype in (torch.float32, torch.bfloat16):
        for head_dim in head_dims:
            result += [
                ("decode", ops._paged_decode_kernel, {**ops.decode_meta(dtype, 4, head_dim, 16), **plain}, dtype),
                ("decode", ops._paged_decode_kernel, {**ops.decode_meta(dtype, 3, head_dim, 1), **variants}, dtype),
                ("prefill", ops._paged_prefill_kernel, {**ops.prefill_meta(dtype, 3, head_dim, 32), **plain}, dtype),
                ("prefill", ops._paged_prefill_kernel, {**ops.prefill_meta(dtype, 3, head_dim, 32), **variants},
                 dtype),
                ("store_kv", ops._store_kv_kernel, ops.store_kv_meta(3, head_dim, 16), dtype),
            ]
        result.append(("copy_blocks", ops._copy_blocks_kernel, ops.copy_blocks_meta(16 * 3 * 64), dtype))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sm", type=int, nargs="+", default=[80, 90], help="compute capabilities")
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    args = parser.parse_args()
    for capability in args.sm:
        for name, kernel, meta, dtype in builds(args.head_dim):
            usage = build(kernel, meta, dtype, capability)
            report = {"kernel": name, "sm": capability, "dtype": TRITON_DTYPE[dtype],
                      "head_dim": meta.get("HEAD_DIM"), **usage}
            print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
