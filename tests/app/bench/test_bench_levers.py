"""The bench's view of the machine and of fairness: matmul peak and MFU, matched engine settings, the chat workload,
and vLLM's per-token times from the runner's own step loop."""

from __future__ import annotations

import types

import pytest
import torch
from models import tiny_model

from kvscope.app.bench import peak, systems_cli, vllm_runner, vllm_system
from kvscope.app.bench.kvscope_system import VARIANTS, engine_config
from kvscope.app.bench.systems import PAGED, VLLM, systems_for
from kvscope.app.bench.workloads import build_workloads, chat, mixed, warm_up_request
from kvscope.app.cli import build_parser
from kvscope.engine import EngineConfig


def test_model_flops_count_every_linear_and_the_head_apart():
    model, _ = tiny_model("llama")
    flops = peak.model_flops(model)
    # tiny llama: hidden 64, 4 heads x 16, 2 kv heads, MLP 128, 2 layers; the head is vocab x 64.
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128
    assert flops.per_token == 2 * 2 * per_layer
    assert flops.head_per_token == 2 * model.config.vocab_size * 64
    assert flops.of_run(10, 3) == 13 * flops.per_token + 3 * flops.head_per_token
    assert peak.utilisation(flops, 10, 3, 2.0, flops.of_run(10, 3) / 1e9) == pytest.approx(0.5)
    assert peak.utilisation(flops, 10, 3, 2.0, None) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_matmul_peak_is_measured(dtype):
    assert peak.matmul_peak_gflops(dtype, repeats=1) > 0


def test_matched_settings_reach_both_kvscope_and_vllm():
    args = build_parser().parse_args(["bench", "throughput", "--matched"])
    assert systems_cli.engine_settings(args) == (128, 4096)
    args = build_parser().parse_args(["bench", "throughput", "--matched", "--block-size", "32"])
    assert systems_cli.engine_settings(args) == (32, 4096)
    assert systems_cli.engine_settings(build_parser().parse_args(["bench", "throughput"])) == (None, None)
    workload = mixed(4)
    config = engine_config(VARIANTS[PAGED], workload, model="fake", device="cpu", dtype="float32", block_size=128,
                           max_num_batched_tokens=4096)
    assert (config.block_size, config.max_num_batched_tokens, config.num_blocks) == (128, 4096, 32768 // 128)
    default = engine_config(VARIANTS[PAGED], workload, model="fake", device="cpu", dtype="float32")
    assert (default.block_size, default.max_num_batched_tokens) == (EngineConfig().block_size,
                                                                    EngineConfig().max_num_batched_tokens)
    job = vllm_system.build_job(workload, warm_up_request(), model_dir="/m", dtype="float32", block_size=128,
                                max_num_batched_tokens=4096)
    assert (job["block_size"], job["max_num_batched_tokens"]) == (128, 4096)


def test_the_chat_workload_is_one_user_and_runs_against_vllm():
    [workload] = build_workloads("chat")
    assert workload == chat() and len(workload.requests) == 1
    [request] = workload.requests
    assert len(request.prompt_token_ids) == 40 and request.max_tokens == 256
    assert VLLM in systems_for("chat") and PAGED in systems_for("chat")


class _FakeEngine:
    """Steps like vLLM's LLMEngine: cumulative outputs, one new token per running request per step."""

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}
        self.made: dict[str, int] = {}

    def add_request(self, request_id, prompt, params) -> None:
        self.requests[request_id] = params.max_tokens
        self.made[request_id] = 0

    def has_unfinished_requests(self) -> bool:
        return any(self.made[r] < n for r, n in self.requests.items())

    def step(self):
        outputs = []
        for request_id, wanted in self.requests.items():
            if self.made[request_id] < wanted:
                self.made[request_id] += 1
                tokens = list(range(self.made[request_id]))
                outputs.append(types.SimpleNamespace(request_id=request_id, finished=self.made[request_id] == wanted,
                                                     outputs=[types.SimpleNamespace(token_ids=tokens)]))
        return outputs


def test_the_vllm_runner_times_every_token_from_its_own_step_loop():
    fake_vllm = types.SimpleNamespace(TokensPrompt=lambda prompt_token_ids: prompt_token_ids,
                                      SamplingParams=lambda **kw: types.SimpleNamespace(**kw))
    llm = types.SimpleNamespace(llm_engine=_FakeEngine())
    requests = [{"prompt_token_ids": [1, 2], "max_tokens": 3, "n": 1}, {"prompt_token_ids": [3], "max_tokens": 5,
                                                                          "n": 1}]
    outputs, times = vllm_runner._stepped(llm, fake_vllm, requests, 0.0, begin=0.0)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 5]
    assert [len(t) for t in times] == [3, 5] and all(a <= b for t in times for a, b in zip(t, t[1:]))
    record = vllm_system.record_from_result(
        {"vllm_version": "x", "settings": {}, "wall_s": 1.0, "peak_rss_mb": 1.0, "load_s": 1.0,
         "outputs": [{"num_tokens": [3], "ttft_s": None, "token_times": times[0]},
                     {"num_tokens": [5], "ttft_s": 0.2, "token_times": []}]},
        types.SimpleNamespace(num_prompt_tokens=3), threads=1)
    assert record.token_times == [times[0], [0.2]]
