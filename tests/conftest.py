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

# tests/vllm/ runs against a real vLLM server that takes minutes to start: only under `make test-vllm`.
collect_ignore = [] if os.environ.get("KVSCOPE_VLLM_PYTHON") else ["vllm"]
