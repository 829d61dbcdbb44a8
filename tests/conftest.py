import os
import sys
from pathlib import Path

# The shared helpers (tests/support/: models, invariants, fakes, harnesses) are imported as plain modules.
sys.path.insert(0, str(Path(__file__).parent / "support"))

# Triton decides between compiling and interpreting when a kernel is defined, so on a machine without CUDA the
# interpreter is chosen here, before any test module (tests/gpu/ among them) can import kernels/triton_*.py.
try:
    import torch
except ImportError:
    torch = None
if torch is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under xdist each worker takes its share of the cores for torch's compute threads. Left alone, torch starts one
# thread per core in every worker, so two workers on two cores run four threads at OpenMP barriers, each parallel
# op waiting for a thread that is not on a core: on the 2-core machine under load, one transformers generate of
# SmolLM2 (60-token prompt, 14 tokens) took 14.1 s on 2 threads and 1.5 s on 1. The share also goes to the
# processes the tests start (servers, `kvscope chat`, lm-eval) through OMP_NUM_THREADS.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _workers > 1:
    _share = max(1, len(os.sched_getaffinity(0)) // _workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    if torch is not None:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# tests/vllm/ runs against a real vLLM server that takes minutes to start: only under `make test-vllm`.
collect_ignore = [] if os.environ.get("KVSCOPE_VLLM_PYTHON") else ["vllm"]
