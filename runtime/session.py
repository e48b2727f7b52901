"""The one engine builder: from `Settings`, the tokenizer, the executor and the engine that
every entry point runs — the console, `serve`, `run-trace`, `bench --in-process` and
`calibrate` — so the same settings give the same engine wherever they are used.

- `torch`: the GGUF model's executor; its tokenizer comes from the same file.
- `sim`: the timing model; a real tokenizer when `tokenizer` names a model (the simulated
  token ids are then drawn from that vocabulary and decoded by it), otherwise the stand-in
  words of `runtime/text/standin.py`, whose token counts are exact.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.base import Executor
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
from kvdeck.runtime.models.registry import DEFAULT_MODEL
from kvdeck.runtime.resources import PASSAGE
from kvdeck.runtime.settings import Settings
from kvdeck.runtime.text.standin import StandInTokenizer


@dataclass
class Session:
    """What `build_session` made, for an entry point to run."""

    settings: Settings
    executor: Executor
    engine: Engine
    tokenizer: object | None
    """A `tokenizer.Tokenizer`, a `standin.StandInTokenizer`, or None (token ids only)."""
    model_id: str
    """The name the API serves the model under."""
    adapters: dict[str, str] = dataclasses.field(default_factory=dict)
    """LoRA adapters loaded into the executor: name → path (`load_adapters`)."""

    def load_adapters(self, modules: list[str]) -> None:
        """Load `NAME=PATH` adapters (vLLM's `--lora-modules`) into the executor; a
        ConfigError sentence for a malformed one, a taken name, an executor without
        adapters or an adapter made for another model."""
        from kvdeck.runtime.executors.base import Adapters, capability

        executor = capability(self.executor, Adapters, "--lora-modules")
        for name, path in parse_lora_modules(modules):
            if name in self.adapters or name == self.model_id:
                raise ConfigError(f"--lora-modules names {name!r} twice, or as the model "
                                  "itself; give each adapter a name of its own.")
            executor.load_adapter(name, path, self.settings.engine.max_loras)
            self.adapters[name] = path
        # Their slots come out of the KV budget (before any request: the pool is empty).
        self.engine.switcher.fit_pool("LoRA adapters")

    @property
    def vocab_size(self) -> int:
        return self.executor.info.vocab_size

    def close(self) -> None:
        self.engine.close()


def parse_lora_modules(modules: list[str]) -> list[tuple[str, str]]:
    """(name, path) of each `NAME=PATH` of vLLM's `--lora-modules`; a ConfigError sentence
    for a malformed one or a name given twice. Pure, so that `kvdeck serve` refuses them
    before loading a model (a name the model itself has is refused on loading)."""
    out: list[tuple[str, str]] = []
    for module in modules:
        name, sep, path = module.partition("=")
        if not sep or not name.strip() or not path.strip() or ":" in name:
            raise ConfigError(f"--lora-modules takes NAME=PATH (a name without ':'), "
                              f"got {module!r}.")
        if any(name.strip() == taken for taken, _ in out):
            raise ConfigError(f"--lora-modules names {name.strip()!r} twice, or as the model "
                              "itself; give each adapter a name of its own.")
        out.append((name.strip(), path.strip()))
    return out


def build_executor(settings: Settings, sim: SimConfig | None = None,
                   text_tokens: list[int] | None = None) -> Executor:
    """The executor `settings` name (`sim`: `sim` overrides the settings' sim config, and
    outputs are read from `text_tokens` when given)."""
    s = settings.session
    if s.executor == "sim":
        return SimExecutor(sim or settings.sim, seed=settings.engine.seed,
                           text_tokens=text_tokens)
    from kvdeck.runtime.models.registry import resolve_model

    if s.executor == "llama_cpp":
        from kvdeck.runtime.executors.llama_cpp import LlamaCppExecutor

        return LlamaCppExecutor(resolve_model(s.model or DEFAULT_MODEL), threads=s.threads,
                                n_gpu_layers=s.n_gpu_layers, n_parallel=s.n_parallel,
                                batch_invariant=s.batch_invariant,
                                seed=settings.engine.seed, repack=s.llama_repack,
                                draft_model=resolve_model(s.draft_model) if s.draft_model
                                else None)
    from kvdeck.runtime.executors.torch import TorchExecutor

    return TorchExecutor(resolve_model(s.model or DEFAULT_MODEL), device=s.device,
                         dtype=s.dtype, threads=s.threads, seed=settings.engine.seed,
                         int4_group_size=s.int4_group_size,
                         int8_group_size=s.int8_group_size,
                         weight_activations=s.weight_activations,
                         draft_model=resolve_model(s.draft_model) if s.draft_model else None,
                         graph_buckets=settings.sim.graph_buckets)


def _real_tokenizer(model: str | Path):
    from kvdeck.runtime.models.registry import resolve_model
    from kvdeck.runtime.text.tokenizer import Tokenizer

    return Tokenizer(resolve_model(str(model)))


def build_session(settings: Settings, *, live: bool = False,
                  with_tokenizer: bool = True) -> Session:
    """Build tokenizer, executor and engine. `live`: a console or a server watches the
    engine, so a simulated one keeps `pace` to the wall clock; headless runs go as fast as
    they can. `with_tokenizer=False` skips detokenization (trace runs use token ids)."""
    s = settings.session
    tokenizer = None
    if s.executor == "sim":
        sim, text = settings.sim, None
        if with_tokenizer and s.tokenizer:
            tokenizer = _real_tokenizer(s.tokenizer)
            # Simulated ids come from the tokenizer's vocabulary, end-of-sequence included,
            # read from a real text so answers decode, and re-encode, as text does.
            sim = dataclasses.replace(sim, vocab_size=tokenizer.vocab_size,
                                      eos_token_id=tokenizer.eos_token_id)
            text = tokenizer.encode(PASSAGE.read_text(encoding="utf-8"), add_bos=False)
        elif with_tokenizer:
            tokenizer = StandInTokenizer(sim.vocab_size, sim.eos_token_id)
        executor = build_executor(settings, sim, text)
        if sim.memory_utilization:  # the KV budget is what the layout's cards leave
            settings = dataclasses.replace(settings, engine=dataclasses.replace(
                settings.engine, kv_memory_bytes=executor.layout.kv_budget_bytes(
                    executor.model, executor.hardware, sim.memory_utilization)))
        model_id = s.served_model_name or executor.model.name
    else:
        executor = build_executor(settings)
        note = executor.info.start_note
        if note:  # llama.cpp runs in a mode other than its fastest: the start-up line says so
            settings = dataclasses.replace(settings, executor_choice="; ".join(
                x for x in (settings.executor_choice, note) if x))
        if with_tokenizer:
            tokenizer = _real_tokenizer(executor.info.model_path)
        # A registry name as given ("qwen2.5-coder-0.5b"), a path by its file name.
        model_id = s.served_model_name or \
            Path(s.model or DEFAULT_MODEL).name.removesuffix(".gguf")
    try:
        engine = Engine(settings.engine, executor, tokenizer=tokenizer,
                        pace=s.pace if live and executor.info.virtual_time else None)
    except BaseException:
        executor.close()
        raise
    return Session(settings, executor, engine, tokenizer, model_id)
