import os
import sys
from pathlib import Path

# The shared helpers (tests/support/: models, invariants, fakes, harnesses) are imported as plain modules.
sys.path.insert(0, str(Path(__file__).parent / "support"))

# tests/vllm/ runs against a real vLLM server that takes minutes to start: only under `make test-vllm`.
collect_ignore = [] if os.environ.get("KVSCOPE_VLLM_PYTHON") else ["vllm"]
