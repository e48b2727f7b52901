"""The fleet: vLLM's KV-cache events read (a decoder, one replica's cache, a subscriber per
replica) and written (kvdeck's own server publishing them)."""
