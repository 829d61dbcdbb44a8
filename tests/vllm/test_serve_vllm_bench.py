"""vLLM's own client against kvscope serve: `vllm bench serve` completes a random-dataset run with no failed request."""

from __future__ import annotations

import os
from pathlib import Path

from kvscope.app.bench.serve_bench import SERVED_NAME, ServeBenchSettings, vllm_client_row
from kvscope.app.serve.server import ServeApp, ServeOptions
from kvscope.engine import EngineConfig, LLMEngine
from kvscope.engine.model.loader import fetch_default_model


def test_vllm_bench_serve_completes_against_kvscope_serve(tmp_path: Path):
    model_dir = str(fetch_default_model())
    engine = LLMEngine(EngineConfig(model=model_dir, max_model_len=1024, num_blocks=512))
    server = ServeApp(engine, ServeOptions(port=0, served_model_name=SERVED_NAME, access_log=False))
    server.start_in_thread()
    try:
        settings = ServeBenchSettings(model_dir=model_dir, num_prompts=24, input_len=128, output_len=16,
                                      vllm_python=os.environ["KVSCOPE_VLLM_PYTHON"], client="vllm")
        row = vllm_client_row("kvscope", server.url, settings, rate=8.0, scratch=tmp_path)
    finally:
        server.stop()
    assert (row.completed, row.failed) == (24, 0)
    assert row.output_throughput > 0 and row.ttft_p50_ms is not None and row.itl_p50_ms is not None
