"""Executors run an iteration's plan: `sim` (timing model), `torch` and
`llama_cpp` (real models)."""
