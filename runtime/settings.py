"""One settings object for every entry point, layered: the executor's defaults, then a config
file, then command-line flags.

Keys are flat (a TOML config file uses the same names): the session's own (`executor`,
`model`, `tokenizer`, `device`, `dtype`, `threads`, `pace`, `served_model_name`), the fields
of `EngineConfig`, of `Knobs` and of `SimConfig`. An unknown key or a bad value is refused
with one sentence naming it and what is allowed.

Defaults depend on the executor and are the same for every command that runs it, so a
request that fits in the console fits in run-trace and behind the API too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvdeck.runtime.core.config import (
    EngineConfig,
    Knobs,
    check_choice,
    check_float,
    check_int,
    read_toml,
    split_settings,
)
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.sim import SimConfig

EXECUTORS = ("sim", "torch", "llama_cpp")
GIB = 1 << 30

EXECUTOR_DEFAULTS: dict[str, dict[str, Any]] = {
    # A datacenter card: Qwen3-8B on an RTX PRO 6000 with 16 GiB of KV.
    "sim": {"kv_memory_bytes": 16 * GIB, "kv_format": "bf16",
            "max_num_batched_tokens": 8192, "chunk_size": 2048, "weight_format": "dense"},
    # A laptop CPU: small steps keep every stream moving; weights as the start-up
    # micro-benchmark finds fastest for one request (`runtime/models/kernels.py`).
    "torch": {"kv_memory_bytes": GIB // 2, "kv_format": "fp16",
              "max_num_batched_tokens": 512, "chunk_size": 256, "weight_format": "measured"},
    # llama.cpp runs the GGUF's own quantized weights; its batches take more tokens.
    # Its slots (`n_parallel`) cap the requests running at once; 1 GiB gives each of them
    # 3,640 of Gemma 3 270M's positions.
    "llama_cpp": {"kv_memory_bytes": GIB, "kv_format": "fp16", "max_num_seqs": 16,
                  "max_num_batched_tokens": 512, "chunk_size": 256, "weight_format": "dense"},
}
"""Per-executor defaults that differ from the dataclasses' own."""


@dataclass(frozen=True)
class SessionOptions:
    """What to run, as opposed to how the engine schedules it."""

    executor: str = "torch"
    model: str | None = None
    """Model name or GGUF path (torch); None takes the embedded default."""
    tokenizer: str | None = None
    """Sim: a model whose tokenizer decodes the simulated token ids (None: stand-in words)."""
    device: str = "auto"
    dtype: str | None = None
    threads: int | None = None
    int4_group_size: int = 32
    int8_group_size: int = 64
    weight_activations: str = "measured"
    pace: float = 1.0
    """Sim behind the console or the API: virtual seconds per wall second."""
    served_model_name: str | None = None
    """The model id the API serves (default: the model's name)."""
    n_gpu_layers: int = 0
    """llama_cpp: layers offloaded to the GPU (a Metal or CUDA build; -1: all)."""
    batch_invariant: bool = False
    """llama_cpp: decode each request in a call of its own, so batching never changes its
    output (llama.cpp's kernels are not batch-invariant); as slow as serial decoding."""
    n_parallel: int = 16
    """llama_cpp: slots, the most requests running at once (each a KV stream of the pool's
    tokens / n_parallel). 16, not llama-server's habitual 8: a decode step's weights are
    read once for all its rows, and on a 2-core Xeon (Gemma 3 270M, plain kernels) a row
    cost 7.6 ms in an 8-row step, 6.1 in a 16-row one and 6.6 in a 32-row one."""
    llama_repack: str = "auto"
    """llama_cpp: re-pack the GGUF's weights for llama.cpp's CPU kernels (its extra buffer
    types) `on`, `off`, or `auto`: as a start-up probe in a child process found safe on
    this machine (`runtime/executors/llama_cpp_probe.py`)."""
    draft_model: str | None = None
    """Torch and llama_cpp: a smaller model (name or GGUF path) sharing the model's
    tokenizer, loaded for `speculative_method = draft`."""

    def __post_init__(self) -> None:
        check_choice("executor", self.executor, EXECUTORS)
        check_choice("llama_repack", self.llama_repack, ("auto", "on", "off"))
        if self.threads is not None:
            check_int("threads", self.threads, 1, 1024)
        check_float("pace", self.pace, 1e-3, 1e6)
        if self.draft_model and self.executor == "sim":
            raise ConfigError("--draft-model loads a real draft model (torch and llama_cpp "
                              "executors); the sim models one with --draft-cost and "
                              "--drafting.")


@dataclass(frozen=True)
class Settings:
    """Everything needed to build a session (see `kvdeck.runtime.session.build_session`)."""

    session: SessionOptions = field(default_factory=SessionOptions)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    executor_choice: str = ""
    """Why this executor, when none was named and the machine chose it
    (`kvdeck.runtime.executors.choice`), and how llama.cpp runs where its probe found a kernel
    mode that crashes; printed at start-up and notified in the console."""

    @property
    def executor(self) -> str:
        return self.session.executor

    def flat(self) -> dict[str, Any]:
        """The settings as flat keys (what a config file holds). The simulated card's
        settings only for the sim: a real executor's model is its GGUF, not a profile."""
        out: dict[str, Any] = {}
        parts = (self.session, self.engine) + ((self.sim,) if self.executor == "sim" else ())
        for part in parts:
            for f in dataclasses.fields(part):
                if f.name != "knobs":
                    out[f.name] = getattr(part, f.name)
        out.update(dataclasses.asdict(self.engine.knobs))
        if self.executor == "torch" and self.sim.graph_buckets:  # CUDA graphs' sizes
            out["graph_buckets"] = self.sim.graph_buckets
        return out


SETTING_CLASSES = (SessionOptions, EngineConfig, Knobs, SimConfig)


def defaults_for(executor: str) -> dict[str, Any]:
    """The defaults every command uses for `executor`, as flat keys."""
    check_choice("executor", executor, EXECUTORS)
    return dict(EXECUTOR_DEFAULTS[executor])


def resolve(file_values: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None,
            *, default_executor: str = "torch") -> Settings:
    """Layer the executor's defaults, a config file's values and flag overrides (later
    wins) into validated settings. `default_executor = "auto"`: where neither names an
    executor, the faster one for this machine (`kvdeck.runtime.executors.choice`)."""
    values = {**(file_values or {}), **(overrides or {})}
    why = ""
    if "executor" not in values and default_executor == "auto":
        from kvdeck.runtime.executors.choice import choose_executor

        default_executor, extra, why = choose_executor(values)
        values.update(extra)
    executor = values.get("executor", default_executor)
    check_choice("executor", executor, EXECUTORS)
    values = {**defaults_for(executor), **values, "executor": executor}
    if values.get("kv_format") == "auto":
        values["kv_format"] = EXECUTOR_DEFAULTS[executor]["kv_format"]
    session, engine, knobs, sim = split_settings(values, *SETTING_CLASSES)
    try:
        return Settings(SessionOptions(**session),
                        EngineConfig(knobs=Knobs(**knobs), **engine), SimConfig(**sim),
                        executor_choice=why)
    except TypeError as e:  # a wrong value type reaching a dataclass, e.g. a table
        raise ConfigError(f"Invalid setting: {e}.") from None


def load(config: str | Path | None, overrides: dict[str, Any] | None = None, *,
         default_executor: str = "torch") -> Settings:
    """`resolve` with the values of TOML file `config` (None: no file)."""
    return resolve(read_toml(config) if config else {}, overrides,
                   default_executor=default_executor)


def to_toml(values: dict[str, Any]) -> str:
    """Flat settings as a TOML config file (None values are left out: they mean "the
    default")."""
    lines = ["# kvdeck settings: use with --config FILE (flags override it)"]
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        elif isinstance(value, str):
            text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        else:
            raise ConfigError(f"Setting {key!r} has a value a config file cannot hold: "
                              f"{value!r}.")
        lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"
