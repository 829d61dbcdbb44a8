"""The attached server's data side: decoding its KV events and metrics, modelling its pools, the data source
thread, the recorded replay and the run log. Nothing here knows a window exists (an import-linter contract)."""
