"""`kvscope bench`: kvscope against transformers and against its own contiguous baseline."""
