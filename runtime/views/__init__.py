"""What a running engine shows: the snapshot the console draws, the running figures, per-request
metrics."""
