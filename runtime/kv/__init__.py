"""Paged KV cache: block pool, block tables, prefix tree, host tier and formats."""
