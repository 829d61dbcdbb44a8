"""vLLM's status sentence, written once for the window's status line and `kvscope serve`'s 10-second log line.

vLLM logs "Avg prompt throughput: … tokens/s, Avg generation throughput: … tokens/s, Running: N reqs, Waiting:
N reqs, GPU KV cache usage: …%, Prefix cache hit rate: …%"; kvscope says the same things the same way ("CPU KV
cache usage" off CUDA, as vLLM's CPU build says). Plain text, no textual: the headless server imports it too.
"""

from __future__ import annotations


def status_sentence(prompt_rate: float, generation_rate: float, running: int, waiting: int, swapped: int | None,
                    device: str, kv_usage: float, hit_rate: float, *, grouped: bool = False) -> str:
    """``swapped`` None leaves the swapped count out (vLLM V1 has none). ``grouped`` writes 3,890.0 for the
    window's readers; the log keeps vLLM's 3890.0, which scripts parse."""
    rate = ",.1f" if grouped else ".1f"
    kv_name = "GPU" if device.startswith("cuda") else "CPU"
    parts = [f"Avg prompt throughput: {prompt_rate:{rate}} tokens/s",
             f"Avg generation throughput: {generation_rate:{rate}} tokens/s",
             f"Running: {running} reqs", f"Waiting: {waiting} reqs"]
    if swapped is not None:
        parts.append(f"Swapped: {swapped} reqs")
    parts += [f"{kv_name} KV cache usage: {100 * kv_usage:.1f}%", f"Prefix cache hit rate: {100 * hit_rate:.1f}%"]
    return ", ".join(parts)
