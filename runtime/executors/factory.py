"""Executors by name, so every front end builds them the same way."""

from __future__ import annotations

from runtime.errors import ConfigError
from runtime.executors.sim import SimConfig, SimExecutor

EXECUTORS = ("sim", "torch")


def make_executor(name: str, *, model: str | None = None, device: str = "auto",
                  dtype: str | None = None, threads: int | None = None, seed: int = 0,
                  sim_config: SimConfig | None = None):
    """Build the executor `name`; `model` (a name or a GGUF path) is required for torch."""
    if name == "sim":
        return SimExecutor(sim_config or SimConfig(), seed=seed)
    if name == "torch":
        from runtime.executors.torch import TorchExecutor
        from runtime.models.registry import DEFAULT_MODEL, resolve_model

        return TorchExecutor(resolve_model(model or DEFAULT_MODEL), device=device, dtype=dtype,
                             threads=threads, seed=seed)
    raise ConfigError(f"Unknown executor {name!r}; available executors: {', '.join(EXECUTORS)}.")
