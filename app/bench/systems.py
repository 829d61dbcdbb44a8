"""The systems the bench compares, by name, and which of them each workload runs by default."""

from __future__ import annotations

PAGED = "kvscope-paged"
CONTIGUOUS = "kvscope-contiguous"
PAGED_NO_PREFIX = "kvscope-paged-noprefix"
HF_STATIC = "hf-static"
HF_CB = "hf-cb"
VLLM = "vllm"

KVSCOPE_SYSTEMS = (PAGED, CONTIGUOUS, PAGED_NO_PREFIX)
SYSTEMS = (*KVSCOPE_SYSTEMS, HF_STATIC, HF_CB, VLLM)

_EVERY = (PAGED, CONTIGUOUS, HF_STATIC, HF_CB)
DEFAULT_SYSTEMS = {
    # vLLM runs in its own venv; without one its row says how to get it.
    "mixed": (*_EVERY, VLLM),
    # Without prefix caching: the baseline for the prefix cache's savings.
    "shared-prefix": (PAGED, PAGED_NO_PREFIX, CONTIGUOUS, HF_STATIC, HF_CB),
    "parallel-sampling": _EVERY,
    # Pool pressure is a kvscope setting; the peers have no equivalent knob to squeeze.
    "overload-recompute": (PAGED, CONTIGUOUS),
    "overload-swap": (PAGED, CONTIGUOUS),
    # One request: batching has nothing to do; vLLM is the peer to beat on latency.
    "chat": (PAGED, HF_STATIC, VLLM),
}


def systems_for(workload: str, chosen: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """``chosen`` (from --systems) for every workload, else the workload's defaults."""
    return chosen or DEFAULT_SYSTEMS.get(workload, _EVERY)
