"""Whether llama.cpp can be trusted on this machine, and the one way the project opens it.

llama.cpp picks its CPU kernels from what the build and the CPU support, and some of those
paths fault on some machines: on Sapphire Rapids-class Xeons built with GCC 12, ggml's AMX
matrix multiply (one of its *extra buffer types*, the re-packed weight layouts) dies with a
general protection fault on the first decode. A fault kills the whole process, so it cannot
be caught; it can only be seen from outside.

So before a configuration is used, a short decode runs in a **child process**: the default
model (or the model being opened) loaded with extra buffer types on, a prompt chunk, single
decodes and a multi-sequence batch. If the child dies by a signal, the same runs without
extra buffer types; if that dies too, llama.cpp is unusable here. The verdict is cached in
`<cache>/llama-probe.json` under a key of llama-cpp-python's version, the build's system
info, the CPU's flags and the probe model, so it costs a second or two once per machine.
`--llama-repack on|off` overrides it; `kvdeck probe` prints it (`--refresh` probes again).

Every place that loads a model with llama.cpp takes its parameters from here:
`model_params` for the low-level API (the executor, the draft model), `open_llama` for
llama-cpp-python's own `Llama` (the tests' and benchmarks' references). A vocabulary-only
load runs no kernel, so it never waits for the probe.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.faults import fault_spec
from kvdeck.runtime.resources import cache_dir, read_cache_json, write_cache_entry

CACHE_FILE = "llama-probe.json"
LOG_FILE = "llama-probe.log"
PROBE_TIMEOUT_S = 300
"""A probe child still running after this long counts as failed (and is not cached)."""
REPACK_CHOICES = ("auto", "on", "off")

# The child: only llama-cpp-python and ctypes (no torch), so it starts in well under a
# second. It mirrors the executor's context (a stream per sequence) and decodes the shapes
# the executor decodes: a prompt chunk, single rows, and one batch over several sequences.
CHILD = r"""
import ctypes, math, sys
from kvdeck.runtime.faults import crash_at
import llama_cpp as L
from llama_cpp._logger import set_verbose
set_verbose(False)
path, repack, threads = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
crash_at("probe")
L.llama_backend_init()
mp = L.llama_model_default_params()
mp.n_gpu_layers = 0
mp.use_extra_bufts = repack
model = L.llama_model_load_from_file(path.encode(), mp)
if not model:
    sys.exit("llama.cpp could not load " + path)
cp = L.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 1024, 64, 64, 4
cp.n_threads = cp.n_threads_batch = threads
cp.kv_unified = False
cp.no_perf = True
ctx = L.llama_init_from_model(model, cp)
if not ctx:
    sys.exit("llama.cpp could not create a context")
n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
batch = L.llama_batch_init(64, 0, 1)
def decode(rows):
    if repack:
        crash_at("repack-decode")
    batch.n_tokens = len(rows)
    for i, (tok, pos, seq) in enumerate(rows):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
        batch.seq_id[i][0], batch.logits[i] = seq, 1
    if L.llama_decode(ctx, batch) != 0:
        sys.exit("llama_decode failed on %d rows" % len(rows))
    for i in range(len(rows)):
        row = ctypes.cast(L.llama_get_logits_ith(ctx, i), ctypes.POINTER(ctypes.c_float))
        if not all(math.isfinite(row[j]) for j in range(0, n_vocab, 97)):
            sys.exit("llama.cpp returned non-finite logits")
for seq in range(4):
    decode([(2 + (7 * seq + i) % 1000, i, seq) for i in range(32)])
for step in range(3):
    decode([(10 + step, 32 + step, 0)])
decode([(20 + seq, 35 if seq == 0 else 32, seq) for seq in range(4)])
print("ok")
"""


@dataclass(frozen=True)
class Attempt:
    repack: bool
    outcome: str
    """'ok', 'signal SIGSEGV' (or another signal), 'exit N', or 'timeout'."""
    seconds: float


@dataclass(frozen=True)
class Verdict:
    """What the probe found on this machine."""

    repack: bool | None
    """True: re-packed kernels work; False: only without them; None: llama.cpp crashes
    in both kernel modes here."""
    attempts: list[Attempt] = field(default_factory=list)
    amx: bool = False
    """The CPU advertises AMX and the build has llama.cpp's AMX kernels."""
    cached: bool = False
    key: str = ""

    @property
    def note(self) -> str:
        """One line for start-up and the console's notification ('' where all works)."""
        if self.repack:
            return ""
        kernels = "AMX kernels" if self.amx else "re-packed CPU kernels"
        if self.repack is False:
            return (f"llama.cpp's {kernels} crash on this CPU (a known llama.cpp bug); running "
                    "without its re-packed weights (--llama-repack on to force them)")
        return (f"llama.cpp crashes on this CPU with and without its {kernels} (probe log: "
                f"{cache_dir() / LOG_FILE})")


def cpu_flags() -> str:
    """The CPU's feature flags as the kernel reports them (Linux), else the platform's
    processor string."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    import platform

    return platform.processor() or platform.machine()


def probe_model(model_path: str | Path | None = None) -> Path:
    """The GGUF the probe decodes: the embedded default model where it is installed (one
    verdict for every model), else `model_path`."""
    from kvdeck.runtime.errors import ModelNotFoundError
    from kvdeck.runtime.models.registry import DEFAULT_MODEL, resolve_model

    try:
        return Path(resolve_model(DEFAULT_MODEL))
    except ModelNotFoundError:
        if model_path is None:
            raise
        return Path(resolve_model(str(model_path)))


def machine_key(model: Path) -> tuple[str, dict]:
    """(key, its parts): what the verdict depends on."""
    from importlib.metadata import version

    import llama_cpp

    parts = {
        "llama_cpp_python": version("llama_cpp_python"),
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace"),
        "cpu_flags": cpu_flags(),
        "model": f"{model.name} {model.stat().st_size}",
        "faults": fault_spec(),
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
    return digest, parts


def _run_child(model: Path, repack: bool, log) -> Attempt:
    threads = max(1, min(2, os.cpu_count() or 1))
    t0 = time.perf_counter()
    log.write(f"--- probe: {model} with extra buffer types {'on' if repack else 'off'}\n")
    log.flush()
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, str(model), "1" if repack else "0",
                            str(threads)], stdout=subprocess.PIPE, stderr=log,
                           timeout=PROBE_TIMEOUT_S, text=True)
    except subprocess.TimeoutExpired:
        return Attempt(repack, "timeout", time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    if r.returncode < 0:
        try:
            name = signal.Signals(-r.returncode).name
        except ValueError:
            name = str(-r.returncode)
        return Attempt(repack, f"signal {name}", seconds)
    if r.returncode != 0 or r.stdout.strip() != "ok":
        return Attempt(repack, f"exit {r.returncode}", seconds)
    return Attempt(repack, "ok", seconds)


_memo: dict[tuple[Path, str], Verdict] = {}
"""Verdicts this process has read or measured, by cache directory and key."""


def verdict(model_path: str | Path | None = None, *, refresh: bool = False) -> Verdict:
    """The probe's verdict for this machine, from the cache or from running the probe
    (`refresh`: run it again). Raises `ModelNotFoundError` (or `OSError`) when there is no
    model to probe with."""
    model = probe_model(model_path)
    key, parts = machine_key(model)
    memo = (cache_dir(), key)
    if not refresh:
        if memo in _memo:
            return _memo[memo]
        record = read_cache_json(CACHE_FILE).get(key)
        if record is not None:
            v = _from_record(record, key)
            _memo[memo] = v
            return v
    amx = "amx_int8" in parts["cpu_flags"] and "AMX_INT8 = 1" in parts["system_info"]
    cache_dir().mkdir(parents=True, exist_ok=True)
    attempts: list[Attempt] = []
    with open(cache_dir() / LOG_FILE, "a") as log:
        for repack in (True, False):
            attempt = _run_child(model, repack, log)
            attempts.append(attempt)
            if attempt.outcome == "ok" or not attempt.outcome.startswith("signal"):
                break
    last = attempts[-1]
    if last.outcome == "ok":
        result: bool | None = last.repack
    elif last.outcome.startswith("signal"):
        result = None  # both modes died by a signal
    else:
        # Not a crash (a timeout, a load error): nothing learnt about the kernels. Trust
        # neither mode for this run, keep no verdict, and say so.
        raise ConfigError(f"llama.cpp's start-up probe failed ({last.outcome} with extra "
                          f"buffer types {'on' if last.repack else 'off'}); its output is "
                          f"in {cache_dir() / LOG_FILE}. --llama-repack on or off skips "
                          "the probe, --executor torch avoids llama.cpp.")
    v = Verdict(result, attempts, amx, cached=False, key=key)
    write_cache_entry(CACHE_FILE, key, {"repack": result, "amx": amx, "parts": parts,
                                        "attempts": [asdict(a) for a in attempts],
                                        "when": time.strftime("%Y-%m-%d %H:%M:%S")})
    _memo[memo] = v
    return v


def _from_record(record: dict, key: str) -> Verdict:
    attempts = [Attempt(**a) for a in record.get("attempts", [])]
    return Verdict(record.get("repack"), attempts, bool(record.get("amx")), cached=True,
                   key=key)


def resolve_repack(setting: str, model_path: str | Path | None = None) -> tuple[bool, str]:
    """(use extra buffer types, the line to say at start-up) for `--llama-repack`
    `setting`: `on`/`off` as given, `auto` as the probe found. Raises `ConfigError` where
    llama.cpp crashes in both modes."""
    if setting not in REPACK_CHOICES:
        raise ConfigError(f"llama_repack must be one of {', '.join(REPACK_CHOICES)}, got "
                          f"{setting!r}.")
    if setting != "auto":
        return setting == "on", ""
    v = verdict(model_path)
    if v.repack is None:
        raise ConfigError(f"{v.note}; use --executor torch.")
    return v.repack, v.note


def model_params(n_gpu_layers: int = 0, repack: bool | None = None, vocab_only: bool = False):
    """llama.cpp's model parameters for a load (`repack` None: as the probe found)."""
    import llama_cpp

    mp = llama_cpp.llama_model_default_params()
    mp.n_gpu_layers = n_gpu_layers
    mp.vocab_only = vocab_only
    if vocab_only:
        return mp  # no kernel runs on a vocabulary: nothing to probe
    mp.use_extra_bufts = resolve_repack("auto")[0] if repack is None else repack
    return mp


@contextlib.contextmanager
def _default_params(repack: bool) -> Iterator[None]:
    """llama-cpp-python's `Llama` builds its model parameters from
    `llama_model_default_params()` and exposes no `use_extra_bufts`; for the length of one
    construction, that function returns parameters with it set."""
    import llama_cpp.llama_cpp as low

    original = low.llama_model_default_params

    def patched():
        mp = original()
        mp.use_extra_bufts = repack
        return mp

    low.llama_model_default_params = patched
    try:
        yield
    finally:
        low.llama_model_default_params = original


def open_llama(path: str | Path, repack: bool | None = None, **kwargs):
    """llama-cpp-python's own `Llama(path, **kwargs)`, with extra buffer types as the
    probe found (or as `repack` says) and flash attention on unless `flash_attn` says
    otherwise, as the executor's contexts run: its logits then agree with theirs."""
    from llama_cpp import Llama

    if kwargs.get("vocab_only"):
        return Llama(str(path), **kwargs)
    kwargs.setdefault("flash_attn", True)
    use = resolve_repack("auto", path)[0] if repack is None else repack
    with _default_params(use):
        return Llama(str(path), **kwargs)
