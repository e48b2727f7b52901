"""Executors run an iteration's plan: `sim` (timing model), later `torch` and `llama_cpp`."""
