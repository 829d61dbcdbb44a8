"""The attached window's own panels, one per file: what a vLLM server publishes, and in words what it does not."""
