"""kvscope serve: the engine behind the interfaces the ecosystem already speaks.

An OpenAI-compatible HTTP API (FastAPI on uvicorn), vLLM's Prometheus metrics and vLLM's KV-cache events over
ZMQ, all fed by kvscope's own engine, so the official `openai` client, `curl`, `vllm bench serve` and `kvscope
attach` work against it as they do against `vllm serve`. The modules: protocol (request models, response
bodies), errors (OpenAI-style error bodies), bridge (the asyncio server and the engine thread), routes (the
ASGI app), limits (body size and concurrency), metrics, kv_events, status_log (vLLM's log lines), server
(uvicorn, start and stop), hosted (the server under a window) and cli (the `serve` subcommand). The serving
benchmark, which only drives servers from outside, is app/bench/serve_bench.py.
"""
