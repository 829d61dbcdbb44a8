"""The model side of the engine: everything that needs torch and transformers.

The step core (``engine/``: requests, block pool, KV cache manager, scheduler, outputs) decides what runs; this
room runs it. ``model_runner`` drives a transformers model over the paged pool; ``loader`` finds and converts
weights; ``memory`` sizes the pool; ``patches`` lists, in their apply order, the module patches kvscope puts on a
transformers model (packed linears, fused ops, precision); ``sampler`` picks tokens; ``threads`` pins the CPU
threads. The core reaches this room only through the ``Runner`` Protocol (``engine/runner.py``), except where
``LLMEngine`` builds its default runner.
"""
