"""``kvscope attach``: the kvscope window over a running vLLM server.

vLLM is the engine here; kvscope only watches. A data source thread reads the
server's ``/metrics`` (prometheus_client's parser) and its KV-cache events (ZMQ
SUB and DEALER replay, msgpack decoded by msgspec), keeps a model of each
data-parallel rank's block pool, and hands the window immutable frames built on
the app's own snapshot types. Whatever vLLM does not publish, the window says
in words instead of drawing it.
"""
