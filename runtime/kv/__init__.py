"""Paged KV cache: block pool, block tables, prefix tree, host tier, formats, the
KV events and the transfers log."""
