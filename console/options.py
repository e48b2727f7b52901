"""The command-line flags every engine-running command shares (console, serve, run-trace,
bench --in-process), declared once.

Each flag maps to one settings key (`runtime/settings.py`); names follow vLLM where vLLM has
the setting (`--max-num-seqs`, `--max-num-batched-tokens`, `--enable-prefix-caching`,
`--block-size`, `--kv-cache-dtype`, `--max-model-len`, `--seed`). `--config FILE` reads the
same keys from TOML; a flag overrides the file, the file overrides the executor's defaults.
`--help` groups the flags in panels.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Annotated, Any

import typer

from kvdeck.runtime.core.config import KNOB_CHOICES
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.server_prompt_cache import CACHE_RAM_MIB
from kvdeck.runtime.executors.server_slots import UBATCH
from kvdeck.runtime.executors.sim_config import TIMING_MODES
from kvdeck.runtime.kv.formats import KV_FORMATS
from kvdeck.runtime.logs import LEVELS
from kvdeck.runtime.settings import EXECUTOR_DEFAULTS, EXECUTORS, GIB, Settings, load

EXECUTOR = "Executor and model"
ENGINE = "Engine (vLLM names)"
KNOBS = "Scheduling knobs (live-tunable)"
SIM = "Simulated card (--executor sim)"


def _gib_to_bytes(gib: float) -> int:
    if not gib > 0:
        raise ConfigError(f"--kv-memory-gib must be greater than 0, got {gib!r}.")
    return int(gib * GIB)


def _gib_to_bytes_or_zero(gib: float) -> int:
    if not gib >= 0:
        raise ConfigError(f"--host-kv-memory-gib must be 0 or more, got {gib!r}.")
    return int(gib * GIB)


def _one_of(knob: str) -> str:
    """A choice knob's help: its values."""
    return f"{', '.join(KNOB_CHOICES[knob])}."


def _defaults(key: str, scale: float = 1.0) -> str:
    """'default 512 torch, 8192 sim' for a key whose default depends on the executor."""
    values = {e: EXECUTOR_DEFAULTS[e][key] for e in EXECUTORS}
    parts = [f"{v / scale:g} {e}" if isinstance(v, (int, float)) else f"{v} {e}"
             for e, v in values.items()]
    return "default " + ", ".join(parts)


@dataclass(frozen=True)
class Flag:
    key: str
    """The settings key the flag sets."""
    decls: tuple[str, ...]
    type: type
    help: str
    panel: str
    convert: Callable[[Any], Any] | None = None

    @property
    def param(self) -> str:
        return "opt_" + self.key


FLAGS: tuple[Flag, ...] = (
    Flag("executor", ("--executor",), str, f"{', '.join(EXECUTORS)}. The console and serve "
         "choose the faster real one for this machine when none is given (llama_cpp where "
         "llama-cpp-python is installed, unless a torch-only setting is given or torch "
         "sees a CUDA GPU that llama.cpp cannot use); the start-up line says which.",
         EXECUTOR),
    Flag("model", ("--model",), str, "Model name (kvdeck models) or GGUF path (torch).",
         EXECUTOR),
    Flag("tokenizer", ("--tokenizer",), str, "Sim: decode simulated tokens with this model's "
         "tokenizer (default: stand-in words, exact token counts).", EXECUTOR),
    Flag("device", ("--device",), str, "auto, cpu, cuda, cuda:N or mps (torch).", EXECUTOR),
    Flag("dtype", ("--dtype",), str, "fp32, bf16, fp16, int8, int8-head (torch; default: "
         "bf16 on CUDA, and on a CPU whichever of fp32 and bf16 a one-time timing finds "
         "clearly faster there).", EXECUTOR),
    Flag("threads", ("--threads",), int, "CPU threads (torch, llama_cpp).", EXECUTOR),
    Flag("n_gpu_layers", ("--n-gpu-layers",), int, "Layers offloaded to the GPU (llama_cpp "
         "with a Metal or CUDA build; -1: all; default 0).", EXECUTOR),
    Flag("batch_invariant", ("--batch-invariant/--no-batch-invariant",), bool,
         "llama_cpp: decode each request alone, so batching never changes an output "
         "(llama.cpp's kernels are not batch-invariant); as slow as serial (default off).",
         EXECUTOR),
    Flag("n_parallel", ("--n-parallel",), int, "Slots: the most requests running at once "
         "(llama_cpp; each gets the KV budget's tokens / N; default 16, and max_num_seqs "
         "may not exceed it).", EXECUTOR),
    Flag("llama_repack", ("--llama-repack",), str, "llama_cpp: re-pack the GGUF's weights "
         "for llama.cpp's faster CPU kernels: auto (as a start-up probe in a child process "
         "found safe on this machine; `kvdeck probe` shows it), on, off (default auto).",
         EXECUTOR),
    Flag("int4_group_size", ("--int4-group-size",), int,
         "Inputs per scale of int4 weights: 32, 64, 128, 256 (torch; default 32).", EXECUTOR),
    Flag("int8_group_size", ("--int8-group-size",), int,
         "Inputs per scale of int8 weights, 0 = one per output channel (torch; default 64).",
         EXECUTOR),
    Flag("weight_activations", ("--weight-activations",), str,
         "Activation dtype of int8/int4 products: measured (the fastest here), fp32, bf16, "
         "fp16 (torch; default measured).", EXECUTOR),
    Flag("pace", ("--pace",), float, "Sim behind the console or API: virtual seconds per wall "
         "second (default 1).", EXECUTOR),
    Flag("draft_model", ("--draft-model",), str,
         "Draft model for speculative decoding (name or GGUF path; torch, llama_cpp): a "
         "smaller model "
         "with the model's tokenizer, e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b. Use "
         "with --speculative-method draft.", EXECUTOR),
    Flag("served_model_name", ("--served-model-name",), str,
         "Model id the API serves (default: the model's name).", EXECUTOR),
    Flag("max_model_len", ("--max-model-len",), int, "Context limit (default: the model's).",
         ENGINE),
    Flag("block_size", ("--block-size",), int, "KV block size in tokens (default 16).", ENGINE),
    Flag("kv_format", ("--kv-cache-dtype",), str,
         f"auto, {', '.join(KV_FORMATS)} ({_defaults('kv_format')}; live-tunable).", ENGINE),
    Flag("kv_memory_bytes", ("--kv-memory-gib",), float,
         f"KV pool budget in GiB ({_defaults('kv_memory_bytes', GIB)}).", ENGINE,
         convert=lambda gib: _gib_to_bytes(gib)),
    Flag("host_kv_memory_bytes", ("--host-kv-memory-gib",), float,
         "Host KV tier in GiB, for swapped-out requests and demoted prefix blocks (default 0: "
         "none; pinned memory on CUDA).", ENGINE, convert=lambda gib: _gib_to_bytes_or_zero(gib)),
    Flag("free_window_kv", ("--free-window-kv/--no-free-window-kv",), bool,
         "Free sliding-window layers' KV behind the window (torch; models mixing full and "
         "sliding-window layers such as Gemma 3; no host tier) (default off).", ENGINE),
    Flag("kv_eviction", ("--kv-eviction",), str,
         "Token-level KV eviction for prompts past the pool: off, sink-window (keep sink + "
         "recent tokens) or heavy-hitter (and the most-attended blocks); lossy, torch "
         "(default off).", ENGINE),
    Flag("kv_sink_tokens", ("--kv-sink-tokens",), int,
         "Tokens kept at the start of each request under eviction (default 4).", ENGINE),
    Flag("kv_recent_tokens", ("--kv-recent-tokens",), int,
         "Tokens kept before the next position under eviction (default 512).", ENGINE),
    Flag("kv_heavy_tokens", ("--kv-heavy-tokens",), int,
         "Heavy-hitter eviction: most-attended tokens kept besides (default 256).", ENGINE),
    Flag("max_num_seqs", ("--max-num-seqs",), int, "Most requests per iteration (default 256).",
         ENGINE),
    Flag("max_num_batched_tokens", ("--max-num-batched-tokens",), int,
         f"Token budget per iteration ({_defaults('max_num_batched_tokens')}).", ENGINE),
    Flag("enable_prefix_caching", ("--enable-prefix-caching/--no-enable-prefix-caching",),
         bool, "Share and cache prompt prefixes (default on).", ENGINE),
    Flag("prompt_cuts", ("--prompt-cuts",), str, "Offsets before a prompt's end where its "
         "prefill chunk ends, like 516,4: llama-server's context checkpoints (4 + ubatch and "
         "4 tokens before the end, on models with sliding-window or recurrent layers) "
         "(default none).", ENGINE),
    Flag("seed", ("--seed",), int, "Seed for sampling, sim tokens and traffic (default 0).",
         ENGINE),
    Flag("max_waiting", ("--max-waiting",), int,
         "Waiting-queue bound; beyond it requests are refused (429) (default 4096).", ENGINE),
    Flag("max_loras", ("--max-loras",), int, "LoRA adapters resident at once, hence in one "
         "batch; others load from the host on demand (default 0: all).", ENGINE),
    Flag("chunk_size", ("--chunk-size",), int,
         f"Most prompt tokens per request per iteration ({_defaults('chunk_size')}).", KNOBS),
    Flag("scheduling", ("--scheduling",), str, _one_of("scheduling"), KNOBS),
    Flag("queue_policy", ("--queue-policy",), str, _one_of("queue_policy"), KNOBS),
    Flag("sjf_max_wait_s", ("--sjf-max-wait-s",), float, "Aging bound for sjf (default 30).",
         KNOBS),
    Flag("priority_max_wait_s", ("--priority-max-wait-s",), float,
         "Aging bound for priority: a request waiting this long goes ahead of every priority "
         "and is not preempted for arrivals' sake (default 30).", KNOBS),
    Flag("reservation", ("--reservation",), str, _one_of("reservation"), KNOBS),
    Flag("preemption", ("--preemption",), str, "recompute, swap (to the host tier and back) "
         "or auto (whichever the timing model says is faster per victim); swap and auto need "
         "--host-kv-memory-gib (default recompute).",
         KNOBS),
    Flag("demote_prefixes", ("--demote-prefixes/--no-demote-prefixes",), bool,
         "Demote evicted prefix-cache blocks to the host tier instead of dropping them "
         "(default on; needs --host-kv-memory-gib).", KNOBS),
    Flag("offload_layers", ("--offload-layers",), int,
         "Keep the FFN weights of the last N layers in host memory, prefetched before each "
         "runs; the device memory freed goes to the KV pool (default 0).", KNOBS),
    Flag("speculative_method", ("--speculative-method",), str,
         "Speculative decoding: off, ngram (prompt lookup: propose what followed the "
         "latest match of the last tokens) or draft (a smaller model, --draft-model, drafts "
         "in the step); verified losslessly in one pass (default off).",
         KNOBS),
    Flag("num_speculative_tokens", ("--num-speculative-tokens",), int,
         "Most draft tokens per request per step (default 4).", KNOBS),
    Flag("draft_length", ("--draft-length",), str,
         "adaptive (per request, lengthen the draft while an extra verify row costs less "
         "per expected token than the step's time per token) or fixed (always "
         "--num-speculative-tokens) (default adaptive).", KNOBS),
    Flag("prompt_lookup_max", ("--prompt-lookup-max",), int,
         "ngram: the longest n-gram looked up (default 3).", KNOBS),
    Flag("itl_target_ms", ("--itl-target-ms",), float,
         "Inter-token-latency target: each step's prefill chunks are sized so the timing "
         "model predicts the step within it; the budgets still cap them (default 0: off).",
         KNOBS),
    Flag("offload_buffers", ("--offload-buffers",), int,
         "Device buffers for offloaded layers: 1 serializes copy and compute, 2 overlap them "
         "(default 2).", KNOBS),
    Flag("prefix_cache_capacity", ("--prefix-cache-capacity",), int,
         "Most blocks the prefix cache keeps (0: the pool).", KNOBS),
    Flag("prefix_wait", ("--prefix-wait/--no-prefix-wait",), bool,
         "A waiting request whose next prompt block a running request is still prefilling "
         "waits for it to be cached instead of computing it again (default on).", KNOBS),
    Flag("cache_admission_k", ("--cache-admission-k",), int,
         "Prefix-cache admission: 1 caches every completed block; k >= 2 only prefixes in "
         "the prompts of k of the last --cache-admission-window requests (default 1).", KNOBS),
    Flag("cache_admission_window", ("--cache-admission-window",), int,
         "Admitted requests whose prompts count for --cache-admission-k (default 1024).",
         KNOBS),
    Flag("eviction_policy", ("--eviction-policy",), str, _one_of("eviction_policy"),
         KNOBS),
    Flag("admission_control", ("--admission-control/--no-admission-control",), bool,
         "Check deadlines against the timing model before admitting (default off).", KNOBS),
    Flag("on_deadline_miss", ("--on-deadline-miss",), str, _one_of("on_deadline_miss"),
         KNOBS),
    Flag("weight_format", ("--weight-format",), str,
         "Matrix weights: dense, fp32, bf16, fp16, int8, int4, auto or measured (the fastest "
         "at batch 1 of dense and int8, by a start-up micro-benchmark), for all groups or "
         f"per group like attn=int8,ffn=int4,head=bf16 ({_defaults('weight_format')}).",
         KNOBS),
    Flag("model_profile", ("--model-profile",), str, "Model profile (default qwen3-8b).", SIM),
    Flag("hardware", ("--hardware",), str, "Hardware profile (default rtx-pro-6000).", SIM),
    Flag("timing", ("--timing",), str, f"{', '.join(TIMING_MODES)}.", SIM),
    Flag("fixed_ms", ("--fixed-ms",), float, "Fitted step model: fixed ms per step.", SIM),
    Flag("per_token_us", ("--per-token-us",), float, "Fitted step model: µs per new token.",
         SIM),
    Flag("per_pair_ns", ("--per-pair-ns",), float, "Fitted step model: ns per causal pair.",
         SIM),
    Flag("eos_probability", ("--eos-probability",), float,
         "Chance a simulated token ends the request (default 0).", SIM),
    Flag("spec_acceptance", ("--spec-acceptance",), float, "Speculation what-ifs: the chance "
         "each draft token is accepted given the ones before were (default 0.7).", SIM),
    Flag("spec_acceptance_profile", ("--spec-acceptance-profile",), str,
         "Speculation what-ifs per draft position, like 0.9,0.8,0.7: the chance each is "
         "accepted given the ones before were; later positions take the last (overrides "
         "--spec-acceptance).", SIM),
    Flag("draft_cost", ("--draft-cost",), float, "A modelled draft model: one draft pass "
         "costs this fraction of a target step (default 0: none; enables "
         "--speculative-method draft).", SIM),
    Flag("draft_kv_ratio", ("--draft-kv-ratio",), float, "The modelled draft's KV per token "
         "as a fraction of the target's (default 0).", SIM),
    Flag("drafting", ("--drafting",), str, "sequential (one draft pass per position) or "
         "parallel (one pass for all; default sequential).", SIM),
    Flag("graph_buckets", ("--graph-buckets",), str, "Execution shapes: CUDA-graph batch "
         "sizes, like 1,2,4,8,16,32; a step pads its rows to the next: the sim prices the "
         "padding, the torch executor on CUDA replays a captured graph per size for decode "
         "steps (default none: eager).", EXECUTOR),
    Flag("tensor_parallel", ("--tensor-parallel", "--tp"), int, "Cards each layer is split "
         "across: 1, 2, 4 or 8 (an all-reduce per layer over the profile's interconnect; "
         "default 1).", SIM),
    Flag("pipeline_parallel", ("--pipeline-parallel", "--pp"), int, "Pipeline stages of "
         "consecutive layers: 1, 2, 4 or 8 (default 1).", SIM),
    Flag("memory_utilization", ("--memory-utilization",), float, "Above 0: the KV budget is "
         "what the layout's cards leave at this share of their memory less the weights "
         "(vLLM's --gpu-memory-utilization; default 0: --kv-memory-gib).", SIM),
    Flag("server_slots", ("--server-slots",), int, "Above 0: price steps as llama-server "
         "with N slots (-np N, KV per slot) runs them: requests take slots as it assigns "
         "them, a step runs as the micro-batches llama.cpp cuts it into (runs of "
         f"neighbouring slots, up to {UBATCH} tokens), a pass each, and a launch waits for the "
         "saves of idle slots the profile times (default 0: one pass for every row).", SIM),
    Flag("server_cache_ram_mib", ("--server-cache-ram",), int, "Under --server-slots: "
         "llama-server's --cache-ram in MiB, the host prompt cache a launch saves idle slots "
         "to; past it the oldest states go, to be saved again (0: no cache, nothing saved; "
         f"-1: no byte limit, the context's tokens bound it; default {CACHE_RAM_MIB}).", SIM),
    Flag("server_context_tokens", ("--server-context",), int, "Under --server-slots: "
         "llama-server's context in tokens (-c, all its slots'), which bounds its prompt "
         "cache's tokens (default 0: the sim's KV pool's tokens).", SIM),
    Flag("prompt_pass", ("--prompt-pass/--no-prompt-pass",), bool, "Price a step of "
         "prompt chunks beside decode rows as llama.cpp runs it: a pass of the decode rows, "
         "then one of the prompts, each corrected by the profile's measured steps of that "
         "shape (default off: one step with the fit's mixed term; --server-slots prices "
         "such a step by its micro-batches instead).", SIM),
    Flag("fail_at_step", ("--fail-at-step",), int, "Fault injection: the simulated executor "
         "fails for good on this step.", SIM),
)

_CONFIG = inspect.Parameter(
    "opt_config", inspect.Parameter.KEYWORD_ONLY, default=None,
    annotation=Annotated[str | None, typer.Option(
        "--config", help="TOML file of settings (the keys of --help's flags, snake_case); "
        "flags override it.", rich_help_panel="Settings", show_default=False)])
_LOG_LEVEL = inspect.Parameter(
    "opt_log_level", inspect.Parameter.KEYWORD_ONLY, default="warning",
    annotation=Annotated[str, typer.Option(
        "--log-level", help=f"{', '.join(LEVELS)}; logs go to ~/.cache/kvdeck/logs/.",
        rich_help_panel="Settings")])


def _flag_param(f: Flag, repeated: tuple[str, ...] = ()) -> inspect.Parameter:
    kind = list[f.type] if f.key in repeated else f.type  # type: ignore[valid-type]
    extra = " Repeat it for more than one." if f.key in repeated else ""
    return inspect.Parameter(
        f.param, inspect.Parameter.KEYWORD_ONLY, default=None,
        annotation=Annotated[kind | None, typer.Option(
            *f.decls, help=f.help + extra, rich_help_panel=f.panel, show_default=False)])


def _wrap(fn: Callable, extra: list[inspect.Parameter], take: Callable[[dict], dict]):
    """`fn` with `extra` keyword options added to its signature; `take` turns the values
    of those options into the keyword arguments `fn` receives instead."""
    sig = inspect.signature(fn, eval_str=True)
    names = {p.name for p in extra}
    own = [p for p in sig.parameters.values() if p.name not in ("settings", "log_level")]

    @functools.wraps(fn)
    def wrapper(**kwargs: Any) -> Any:
        mine = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        return fn(**kwargs, **take(mine))

    wrapper.__signature__ = sig.replace(parameters=own + extra)  # type: ignore[attr-defined]
    return wrapper


def with_options(cls: type) -> Callable[[Callable], Callable]:
    """Give a command one flag per field of the frozen dataclass `cls`, each field
    `Annotated` with its `typer.Option` or `typer.Argument` (help and all); the command
    receives them as one `opts: cls` instead of a parameter each."""
    hints = typing.get_type_hints(cls, include_extras=True)
    extra = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                               annotation=hints[f.name]) for f in fields(cls)]
    names = [f.name for f in fields(cls)]

    def wrap(fn: Callable) -> Callable:
        sig = inspect.signature(fn, eval_str=True)
        rest = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
                for p in sig.parameters.values() if p.name != "opts"]

        @functools.wraps(fn)
        def wrapper(**kwargs: Any) -> Any:
            return fn(cls(**{k: kwargs.pop(k) for k in names}), **kwargs)

        wrapper.__signature__ = sig.replace(parameters=extra + rest)  # type: ignore[attr-defined]
        return wrapper

    return wrap


def with_log_level(fn: Callable) -> Callable:
    """Add `--log-level`; `fn` receives `log_level`."""
    return _wrap(fn, [_LOG_LEVEL], lambda v: {"log_level": v["opt_log_level"]})


def with_settings(fn: Callable | None = None, *, repeated: tuple[str, ...] = ()):
    """Add `--config`, every engine flag and `--log-level`; `fn` receives `settings` — a
    `SettingsRequest` it resolves with the command's default executor. `repeated`: settings
    keys whose flag may be given more than once (`kvdeck serve --model A --model B`); the
    command receives them as `settings.many[key]`, a list, and `settings.flags` holds the
    first."""
    if fn is None:
        return functools.partial(with_settings, repeated=repeated)

    def take(values: dict) -> dict:
        given = {f.key: values[f.param] for f in FLAGS
                 if values.get(f.param) is not None and values[f.param] != []}
        many = {k: list(given.pop(k)) for k in repeated if k in given}
        given.update({k: v[0] for k, v in many.items()})
        return {"settings": SettingsRequest(values.get("opt_config"), given, many),
                "log_level": values["opt_log_level"]}

    params = [_flag_param(f, repeated) for f in FLAGS]
    return _wrap(fn, [_CONFIG, *params, _LOG_LEVEL], take)


@dataclass(frozen=True)
class SettingsRequest:
    """The config file and the flags (settings key -> value as typed) a command was given."""

    config: str | None = None
    flags: dict[str, Any] | None = None
    many: dict[str, list] | None = None
    """Repeated flags' values, in order (`with_settings(repeated=...)`)."""

    def each(self, key: str) -> list[SettingsRequest]:
        """One request per value of the repeated flag `key` (one, unchanged, without it)."""
        values = (self.many or {}).get(key)
        if not values:
            return [self]
        return [SettingsRequest(self.config, {**(self.flags or {}), key: v})
                for v in values]

    def overrides(self) -> dict[str, Any]:
        """The flags as settings values (e.g. GiB as bytes); ConfigError if one is bad."""
        by_key = {f.key: f for f in FLAGS}
        return {k: by_key[k].convert(v) if by_key[k].convert else v
                for k, v in (self.flags or {}).items()}

    def resolve(self, default_executor: str, **fixed: Any) -> Settings:
        """Settings from the executor's defaults, the file, the flags, then `fixed`."""
        return load(self.config, {**self.overrides(), **fixed},
                    default_executor=default_executor)
