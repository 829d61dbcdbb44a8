"""`make gpu-check`: each GPU check in turn, its time, and one table at the end. Run with the CUDA venv's python.

    python tests/gpu/gpu_check.py [KVSCOPE]    (KVSCOPE: the kvscope command of that venv)
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def checks(kvscope: str) -> list[tuple[str, list[str]]]:
    python = sys.executable
    return [
        ("torch sees a GPU", [python, "-c", "import torch; assert torch.cuda.is_available(); "
                                            "print(torch.cuda.get_device_name(0))"]),
        ("Triton kernels vs torch oracle, exact tokens, pool sizing",
         [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "gpu" / "test_cuda.py")]),
        ("bench kernels --device cuda", [kvscope, "bench", "kernels", "--device", "cuda", "--repeats", "5"]),
        ("bench mixed --device cuda (16 requests)",
         [kvscope, "bench", "throughput", "--device", "cuda", "--workload", "mixed", "--requests", "16",
          "--dtype", "bfloat16", "--systems", "kvscope-paged,hf-static", "--no-floor", "--no-log"]),
    ]


def main(argv: list[str]) -> int:
    kvscope = argv[1] if len(argv) > 1 else "kvscope"
    rows = []
    for name, command in checks(kvscope):
        start = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, cwd="/", check=False)
        seconds = time.perf_counter() - start
        print(result.stdout, result.stderr[-2000:] if result.returncode else "", sep="\n", flush=True)
        last = (result.stdout.strip().splitlines() or ["-"])[-1][:70]
        status = "ok" if result.returncode == 0 else f"FAILED ({result.returncode})"
        rows.append((name, status, f"{seconds:.0f}s", last))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    print("\n" + "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows))
    return 0 if all(row[1] == "ok" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
