"""The simulator against real servers: predicted beside measured, on the same traces.

    python -m benchmarks.sim_vs_real            # kvdeck serve, llama_cpp and torch executors
    python -m benchmarks.sim_vs_real --peers    # llama-server and vLLM's CPU build instead
    python -m benchmarks.sim_vs_real --peers --only llama-server    # one of them
    python -m benchmarks.sim_vs_real --repeat 1    # each trace once, not three times

`make bench` runs the first, `make clients` the second (the peers install into
`.venv-clients/` on first use, as for `make bench-serve`).

For each server: start it on Gemma 3 270M (8 sequences at most), probe it from outside
(`kvdeck calibrate --url`'s probes, `runtime/planning/probe.py`), measure two traces against
it (`kvdeck bench`) `--repeat` times each (3; the traces take turns), each run on the server
started afresh (the sim starts empty too), between two speed checks (`SPEED`: three of the
probes again, just before the restart and just after the run) and followed by the wake
probes again (`probe.wake_probe`), and probe it again with new prompts. The step model is
fitted to the median of each probe's timings (a wake point's over both rounds and every
run's), and the traces are predicted through the sim executor with that profile (`kvdeck
run-trace --timing fit`), the sim serving first what the server served before each trace
(the start-up check and `kvdeck bench`'s warm-up: `--before`, `--warmup`). The medians of
TTFT and TPOT and the output throughput are set side by side, the measured ones each the
median over the runs, and each run's own ratios are printed beside them;
`bench-results/sim_vs_real.json` keeps the probe points, the traces and every request's
figures on both sides too.

On a shared 2-core machine a server's steps move by more than the bounds below within
minutes (one server's 512-token prompt alone: 0.67 s, half a minute later 0.78, no steal
time shown). Two figures say how far: the drift (the server's own probe timings after the
traces over those before), and each trace's speed (the checks beside it over the same
probes in the rounds, prefill and decode apart). The prediction is made with the rounds'
fit, before anything of the trace is measured; beside it, the ratios with the rounds'
points at that speed (`at_speed`) say how much of a miss the machine's speed explains.
(When a trace ran once, its two prefill checks followed the machine's noise as much as its
drift: over eight such runs, 34 of 40 medians came within their bounds as probed and 30
at speed; docs/benchmarks.md.)

The traces, with token ids written out so both sides see the same prompts:
- **Mooncake excerpt:** the shipped Mooncake conversation sample's first 16 requests, prompts
  cut to 768 tokens (their hash blocks kept, so shared blocks stay shared) and outputs to
  32, arrivals rescaled to this machine (below); requests the sample gives one instant
  are sent 20 ms apart in its order, so that the server takes them in the order the sim
  does (sent at once, the later burst of six reached the torch server in another order,
  which moved its TTFT median between 0.94 and 1.21 of the prediction from run to run).
- **Shared prefix:** 16 requests of a 512-token common prefix and 64 tokens of their own,
  32 outputs, Poisson arrivals.

Both arrive at half the rate one request alone would take through the fitted model (its
prefill, then its outputs one step at a time): busy enough that requests batch, not so busy
that the queue alone sets the figures. The rate comes from the fit, never from a measurement
of the traces. The closest call of each trace's prediction with the rounds' fit
(`close_calls.py`: how near an arrival came to a step's start where that decided more than
when its own prompt ran) is printed under it, marked a coin toss where nearer than
`MARGIN`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from benchmarks import peers
from benchmarks.close_calls import close_call_s
from kvdeck.runtime.core.step_data import causal_pairs
from kvdeck.runtime.executors.server_slots import UBATCH
from kvdeck.runtime.models.registry import DEFAULT_MODEL, resolve_model
from kvdeck.runtime.planning.calibrate import Point, fit_step_model
from kvdeck.runtime.planning.probe import (
    FULL,
    Probes,
    probe,
    server_name,
    wake_probe,
    write_server_profiles,
)
from kvdeck.runtime.planning.profiles import HardwareProfile, ModelProfile, StepFit
from kvdeck.runtime.runs.loadgen import cap_arrivals
from kvdeck.runtime.runs.trace import load_arrivals, synthesize_tokens
from kvdeck.runtime.text.tokenizer import Tokenizer

THREADS = 2
MAX_SEQS = 8
REQUESTS = 16
PROMPT_CAP, OUTPUTS, PREFIX, OWN = 768, 32, 512, 64
LLAMA_BATCH = 2048
"""llama-server's default `-b` (its `-ub`: `server_slots.UBATCH`)."""
VOCAB = 32_000
"""Token ids are drawn below this (every modern vocabulary has them)."""
APART = 0.02
"""Seconds between requests the Mooncake sample gives one instant (see `write_traces`): more
than a server just woken takes to file a request (5 ms apart, the first of a burst after a
minute idle reached kvdeck's engine 4 ms after the next one)."""
MARGIN = 0.025
"""A prediction whose closest call (`close_calls.py`) is nearer than this is marked a coin
toss: a call of 14 ms (a request the sim took in that long before the Mooncake excerpt's
later burst's second step on llama-server) went the other way in each of three runs, and
25 ms leaves room above it."""
WAKE_SEEDS = 100
"""The wake probes' seeds count up from here, apart from the speed checks' (10 up)."""
TOLERANCE = {"kvdeck (llama_cpp)": 0.15, "kvdeck (torch)": 0.15, "llama-server": 0.15,
             "vLLM (CPU, bf16)": 0.25}
"""The issue's bounds on |predicted / measured − 1| for the TTFT and TPOT medians."""
SPEED = Probes((512,), ((1, 64), (4, 64)), FULL.outputs, FULL.repeats)
"""The speed check sent just before and just after each run of a trace: three of the rounds'
own probes, under their labels (a prompt of 512 alone, one and four rows decoding). 512, not
the rounds' longest (768): a check is sent twelve times a server, and its ratios stay
comparable with the runs recorded before the longer probe."""
REPEAT = 3
"""Runs of each trace on each server (`--repeat`): the verdict compares the prediction with
the median of the runs' medians (`median_figures`; odd, so that the median is one run's)."""


def alone_seconds(fit: StepFit, prompt: int, outputs: int) -> float:
    """One request alone through the fitted model: its prefill, then one step per output."""
    prefill = fit.seconds(prompt, causal_pairs(prompt, 0), 1, prompt)
    decode = sum(fit.seconds(1, causal_pairs(1, prompt + i), 1, prompt + i + 1)
                 for i in range(outputs - 1))
    return prefill + decode


def write_traces(folder: Path, fit: StepFit) -> dict[str, Path]:
    """Both traces, their rates from `fit`."""
    rng = random.Random(0)
    moon = cap_arrivals(load_arrivals("mooncake-conversation", limit=REQUESTS), PROMPT_CAP,
                        OUTPUTS)
    mean_prompt = sum(a.prompt_len for a in moon) / len(moon)
    gap = alone_seconds(fit, int(mean_prompt), OUTPUTS) * 2  # half the rate of one alone
    span = moon[-1].arrival_s or 1.0
    # Requests of one instant go APART seconds apart in the trace's order: sent at once,
    # they reach the server in whatever order their connections win, and the sim, which
    # takes them in order, would predict another request's time for each.
    same = [sum(b.arrival_s == a.arrival_s for b in moon[:i]) for i, a in enumerate(moon)]
    moon = [replace(a, arrival_s=a.arrival_s / span * gap * (len(moon) - 1) + APART * same[i],
                    prompt_tokens=tuple(synthesize_tokens(a, i, VOCAB)), hash_ids=None)
            for i, a in enumerate(moon)]
    prefix = [rng.randrange(100, VOCAB) for _ in range(PREFIX)]
    gap = alone_seconds(fit, PREFIX + OWN, OUTPUTS) * 2
    t, shared = 0.0, []
    for _ in range(REQUESTS):
        own = [rng.randrange(100, VOCAB) for _ in range(OWN)]
        shared.append({"arrival_s": t, "output_len": OUTPUTS, "prompt_tokens": prefix + own})
        t += rng.expovariate(1 / gap)
    paths = {"Mooncake excerpt": folder / "mooncake.jsonl",
             "shared prefix": folder / "shared.jsonl"}
    paths["Mooncake excerpt"].write_text("".join(json.dumps(a.to_json()) + "\n" for a in moon))
    paths["shared prefix"].write_text("".join(json.dumps(o) + "\n" for o in shared))
    return paths


def write_before(folder: Path) -> Path:
    """The trace of what each server serves before a trace's first request but `kvdeck
    bench`'s warm-up (the sim's `--warmup`): the start-up check, run again for each trace,
    which restarts the server."""
    check = Tokenizer(resolve_model(DEFAULT_MODEL)).encode(peers.START_CHECK[0])
    path = folder / "before.jsonl"
    path.write_text(json.dumps({"arrival_s": 0.0, "output_len": peers.START_CHECK[1],
                                "prompt_tokens": check}) + "\n")
    return path


def kvdeck_cli(*args: str, env: dict | None = None) -> dict:
    """`kvdeck ARGS --json`'s answer: `summary` and `requests`."""
    r = subprocess.run([sys.executable, "-m", "kvdeck.console.cli", *args, "--json"],
                       capture_output=True, text=True, timeout=3600, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"kvdeck {args[0]} failed: {r.stderr.strip()[-500:]}")
    return json.loads(r.stdout)


def figures(summary: dict) -> dict[str, float]:
    return {"ttft_p50_s": summary["ttft_s"]["p50"], "tpot_p50_s": summary["tpot_s"]["p50"],
            "output_tokens_per_s": summary["output_tokens_per_s"]}


def per_request(run: dict) -> list[dict]:
    """Each request's arrival, prompt and cached tokens, TTFT and TPOT (arrival order), kept
    in the results so that a run can be examined request by request afterwards."""
    keys = ("arrival", "prompt_tokens", "cached_tokens", "ttft", "tpot")
    return [{k: r.get(k) for k in keys} for r in run["requests"]]


def merged(before: list[Point], after: list[Point], wakes: list[list[Point]]) -> list[Point]:
    """Each probe timed in both rounds, at the median of its times (a probe one round lacks
    — a server that did not say it reused a prefix that time — is left out); a wake point at
    the median of both rounds' and those of `wakes`, the rounds sent after each trace (a
    median: one wake of 760 ms in a round where the others took 0–80 would set a mean)."""
    again = {p.label: p.seconds for p in after}
    times = {p.label: [p.seconds] for p in before}
    for p in (q for round_ in (after, *wakes) for q in round_):
        times.setdefault(p.label, []).append(p.seconds)
    return [replace(p, seconds=statistics.median(times[p.label])) for p in before
            if p.label in again]


def ratios(new: list[Point], old: list[Point], kind: str = "") -> list[float]:
    """Each step point of `new` (of `kind` only, where given) over the same probe's in
    `old`, ascending; a wake or save point, the small difference of two steps, is no step
    of its own and is left out."""
    ref = {p.label: p.seconds for p in old if p.step and p.seconds > 0}
    return sorted(p.seconds / ref[p.label] for p in new
                  if p.step and p.label in ref and kind in ("", p.kind))


def drift(before: list[Point], after: list[Point]) -> dict[str, float]:
    """The server's own probe timings after the traces over those before: median and
    range of the per-probe ratios (NaN where the rounds have no probe in common)."""
    moved = ratios(after, before)
    if not moved:
        return dict.fromkeys(("median", "min", "max"), float("nan"))
    return {"median": statistics.median(moved), "min": moved[0], "max": moved[-1]}


def compare(server: peers.Server, sim_flags: list[str], folder: Path,
            repeat: int = REPEAT) -> list[dict]:
    """Probe `server` from outside, measure both traces on it `repeat` times, each run
    between two speed checks, probe it again; then fit the step model to both rounds and
    predict the traces (the sim run with `sim_flags`, the server's own batching settings)
    with it, and, beside that, with it at the speed the checks found beside each trace.
    Each figure measured is its median over the runs (`median_figures`).

    Long because it runs the benchmark's steps in their order, each a few lines."""
    hw = server_name(server.url)
    base, card = ModelProfile.load(DEFAULT_MODEL), HardwareProfile.load("local")
    before = probe(server.url, DEFAULT_MODEL, FULL, progress=lambda m: None, shape=base)
    save = next((p for p in before if p.kind == "save"), None)

    def check(seed: int) -> list[Point]:
        return probe(server.url, DEFAULT_MODEL, SPEED, progress=lambda m: None, seed=seed,
                     shape=base, save=save)

    # The traces' rates come from the first round's fit: they are fixed before any
    # trace is sent.
    traces = write_traces(folder, fit_step_model(before))
    measured: dict[str, list[dict]] = {t: [] for t in traces}
    checks: dict[str, list[list[Point]]] = {t: [] for t in traces}
    wakes: list[list[Point]] = []
    # The traces take turns (one of each, then again), so that a machine slowing down
    # over the runs weighs on both alike.
    for run in range(repeat):
        for i, (trace, path) in enumerate(traces.items()):
            seed = 10 + 2 * (run * len(traces) + i)
            # The check before a trace runs on the server as the last probes left it: the
            # trace meets one just started, as the sim starts (empty caches, and
            # llama-server's slots in their first order, which decides whether two
            # requests decode in one pass or two: `executors/server_slots.py`).
            first = check(seed)
            server.stop()
            server.start(DEFAULT_MODEL)
            measured[trace].append(kvdeck_cli("bench", str(path), "--url", server.url,
                                              "--model", DEFAULT_MODEL))
            checks[trace].append(first + check(seed + 1))
            # How the machine wakes from idle changes within minutes; timed right after
            # each trace (and its check), on the server that ran it, the wake points follow
            # the traces closer than the two rounds alone (one found +38 ms after 5 s, one
            # a quarter of an hour later nothing, while the trace between them paid 0–70
            # ms on waking).
            wakes.append(wake_probe(server.url, DEFAULT_MODEL, FULL, progress=lambda m: None,
                                    seed=WAKE_SEEDS + len(wakes)))
    after = probe(server.url, DEFAULT_MODEL, FULL, progress=lambda m: None, seed=1,
                  shape=base)
    points = merged(before, after, wakes)
    fit = fit_step_model(points)
    # The fitted profiles go to the run's own folder, not the user's profiles: each server
    # runs on a new port, and its profile means nothing after the run.
    env = {**os.environ, "KVDECK_CACHE": str(folder / "cache")}
    served = write_before(folder)

    def predict(path: Path, name: str, step_fit: StepFit, timed: list[Point],
                record: Path | None = None) -> dict:
        """The sim's run of the trace at `path` with a profile `name` of `step_fit` and the
        points it was fitted to (`timed`), recorded at `record` where given."""
        saved = os.environ.get("KVDECK_CACHE")
        os.environ["KVDECK_CACHE"] = env["KVDECK_CACHE"]
        try:
            write_server_profiles(server.url, base, name, hw, step_fit, timed, card)
        finally:
            if saved is None:
                del os.environ["KVDECK_CACHE"]
            else:
                os.environ["KVDECK_CACHE"] = saved
        return kvdeck_cli("run-trace", str(path), "--executor", "sim", "--model-profile",
                          name, "--hardware", hw, "--timing", "fit", *sim_flags,
                          "--before", str(served), "--warmup",
                          *(("--record", str(record)) if record else ()), env=env)

    rows, moved = [], drift(before, after)
    for i, (trace, path) in enumerate(traces.items()):
        beside = [p for c in checks[trace] for p in c]
        factors = speed(beside, points)
        there = at_speed(points, factors)
        fit_there = fit_step_model(there)
        record = folder / f"predicted-{i}"
        probed = predict(path, f"{DEFAULT_MODEL}-{hw}", fit, points, record)
        sim = predict(path, f"{DEFAULT_MODEL}-{hw}-{i}", fit_there, there)
        runs = [figures(m["summary"]) for m in measured[trace]]
        real = median_figures(runs)
        predicted, at = figures(probed["summary"]), figures(sim["summary"])
        rows.append({"server": server.name, "trace": trace, "predicted": predicted,
                     "measured": real, "ratio": over(predicted, real),
                     "speed": factors, "predicted_at_speed": at,
                     "ratio_at_speed": over(at, real),
                     "fit": fit.to_json(), "fit_at_speed": fit_there.to_json(),
                     "drift": moved, "sim_flags": sim_flags,
                     "close_call_s": None if math.isinf(close := close_call_s(
                         record, fit.overhead_s)) else close,
                     "arrivals": path.read_text(), "points": [vars(p) for p in points],
                     "speed_checks": [vars(p) for p in beside],
                     "wake_rounds": [[vars(p) for p in r if p.kind == "wake"]
                                     for r in (before, *wakes, after)],
                     "requests": {"predicted": per_request(probed),
                                  "at_speed": per_request(sim)},
                     "runs": [{"measured": m, "ratio": over(predicted, m),
                               "speed": speed(c, points), "requests": per_request(r)}
                              for m, c, r in zip(runs, checks[trace], measured[trace],
                                                 strict=True)]})
    return rows


def median_figures(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the runs of a trace (each run's own a median already, but
    throughput): a server's median over 16 requests moves from run to run by more than the
    bounds where a request or two sits on an edge (whether it arrives to an idle server or
    beside another's prompt), and the median of several runs is the server's, not one
    run's draw. Of an even number of runs, the mean of the middle two."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def over(predicted: dict[str, float], real: dict[str, float]) -> dict[str, float]:
    """predicted / measured, figure by figure."""
    return {k: predicted[k] / real[k] for k in predicted}


def speed(checks: list[Point], points: list[Point]) -> dict[str, float]:
    """How fast the server ran beside a trace against `points` (the rounds' merged probes):
    for prefill and for decode, the median over `checks` (the speed checks sent just before
    and just after each run of the trace) of each check's time over the same probe's in
    `points`; 1 where no check matches a probe. On a shared 2-core machine a 512-token
    prompt alone took 0.67 s and half a minute later 0.78 on one server, with no steal time
    shown: a profile timed minutes away from a trace carries that into the prediction."""
    out = {}
    for kind in ("prefill", "decode"):
        found = ratios(checks, points, kind)
        out[kind] = statistics.median(found) if found else 1.0
    return out


def at_speed(points: list[Point], factors: dict[str, float]) -> list[Point]:
    """`points` as the server would have timed them at `factors`' speed: a prefill point's
    seconds times the prefill factor, a decode point's times the decode one, a step running
    both (mixed) times their geometric mean; a wake's or a save's, no step of its own, as
    they are."""
    f = {**factors, "mixed": math.sqrt(factors["prefill"] * factors["decode"])}
    return [replace(p, seconds=p.seconds * f[p.kind]) if p.kind in f else p for p in points]


def servers(with_peers: bool) -> list[tuple[peers.Server, list[str]]]:
    """kvdeck's own executors, or (`with_peers`) the servers users would pick instead:
    llama-server with 8 slots (`--no-repack`: the one start that works on every CPU here)
    and vLLM's CPU build; each with the batching settings the sim runs its prediction with
    (the server's own: kvdeck's real executors' token budget of 512 and chunk of 256,
    llama-server's batch of 2,048, vLLM told 2,048). kvdeck's llama_cpp executor runs a
    step's prompt chunks in a micro-batch after its decode rows' (`--prompt-pass`).
    llama-server's prediction runs with its slots (`--server-slots 8`: its KV is kept per
    slot, a step runs as the micro-batches llama.cpp cuts it into, runs of neighbouring
    slots up to `UBATCH` tokens, so the decode rows of slots that are not neighbours run in
    passes of their own; prompts fill the batch in slot order, and a slot keeps its last
    prompt; its context bounds its prompt cache's tokens), and with its prompt cuts on Gemma
    3 (`llama_server_cuts`): a burst's prompts advance in pieces and have their first tokens
    together. Its slots share no prefix with each other, so its prediction runs with prefix
    caching off."""
    seqs = ["--max-num-seqs", str(MAX_SEQS)]
    if not with_peers:
        own = [*seqs, "--max-num-batched-tokens", "512", "--chunk-size", "256"]
        return [(peers.kvdeck(ex, DEFAULT_MODEL, THREADS, *seqs),
                 [*own, "--prompt-pass"] if ex == "llama_cpp" else own)
                for ex in ("llama_cpp", "torch")]
    gguf = resolve_model(DEFAULT_MODEL)
    wide = [*seqs, "--max-num-batched-tokens", str(LLAMA_BATCH), "--chunk-size",
            str(LLAMA_BATCH)]
    slots = [*wide, "--server-slots", str(MAX_SEQS), "--server-context",
             str(peers.LLAMA_SERVER_CONTEXT), "--no-enable-prefix-caching"]
    return [(peers.llama_server(gguf, DEFAULT_MODEL, THREADS, repack=False),
             [*slots, *llama_server_cuts()]),
            (peers.vllm(gguf, DEFAULT_MODEL, THREADS, *seqs, "--max-num-batched-tokens",
                        "2048"), wide)]


def llama_server_cuts() -> list[str]:
    """The sim's `--prompt-cuts` for llama-server on the model: on one with sliding-window
    layers (Gemma 3) it checkpoints each prompt's state `4 + n_ubatch` and 4 tokens before
    its end, each offset at most `n_batch` (its defaults: 512 and 2,048), ending the
    prompt's batch there (its `server-context.cpp`; seen in its log at `-v`)."""
    if not ModelProfile.load(DEFAULT_MODEL).sliding_window:
        return []
    return ["--prompt-cuts", f"{min(LLAMA_BATCH, 4 + UBATCH)},{min(LLAMA_BATCH, 4)}"]


MEDIANS = ("ttft_p50_s", "tpot_p50_s")
"""The figures the bounds are on."""


def held(ratio: dict[str, float], bound: float) -> bool:
    """Whether every median of `ratio` is within `bound` of 1."""
    return all(abs(ratio[k] - 1) <= bound for k in MEDIANS)


def show(rows: list[dict]) -> None:
    """The table: predicted with the rounds' fit beside measured, and its verdict; then
    (at speed) the ratios predicted at the speed the checks found beside the trace (`!`:
    outside the bound), that speed (prefill / decode) and the drift between the rounds."""
    print(f"{'server':<24} {'trace':<17} {'TTFT p50 pred/meas':>22} {'TPOT p50 pred/meas':>22} "
          f"{'tok/s pred/meas':>18}  at speed   speed      server drift")
    for r in rows:
        p, m, q, d = r["predicted"], r["measured"], r["ratio"], r["drift"]
        a, v = r["ratio_at_speed"], r["speed"]
        # A server's name may carry its flags ("llama-server --no-repack").
        bound = next((b for name, b in TOLERANCE.items() if r["server"].startswith(name)),
                     0.15)
        there = "/".join(f"{a[k]:.2f}{'' if abs(a[k] - 1) <= bound else '!'}" for k in MEDIANS)
        ttft = f"{p['ttft_p50_s'] * 1e3:7.0f}/{m['ttft_p50_s'] * 1e3:<5.0f} ms"
        tpot = f"{p['tpot_p50_s'] * 1e3:6.1f}/{m['tpot_p50_s'] * 1e3:<5.1f} ms"
        rate = f"{p['output_tokens_per_s']:6.0f}/{m['output_tokens_per_s']:<5.0f}"
        print(f"{r['server']:<24} {r['trace']:<17} {ttft} {q['ttft_p50_s']:5.2f} "
              f"{tpot} {q['tpot_p50_s']:5.2f} {rate} {q['output_tokens_per_s']:4.2f}  "
              f"{'within' if held(q, bound) else 'MISSES'} ±{bound:.0%}  "
              f"{there:<10} "
              f"{v['prefill']:.2f}/{v['decode']:.2f}  "
              f"{d['median']:.2f} ({d['min']:.2f}–{d['max']:.2f})")
        runs = r.get("runs", [])
        if len(runs) > 1:
            each = ", ".join("/".join(f"{x['ratio'][k]:.2f}" for k in MEDIANS) for x in runs)
            within = sum(held(x["ratio"], bound) for x in runs)
            print(f"{'':<24} {'':<17} each run: {each} ({within} of {len(runs)} within)")
        if "close_call_s" in r:
            print(f"{'':<24} {'':<17} closest call: {close_call_text(r['close_call_s'])}")


def close_call_text(seconds: float | None) -> str:
    """A prediction's closest call as the table says it (None: no step that an arrival
    could have swayed)."""
    if seconds is None:
        return "none"
    mark = "" if seconds >= MARGIN else " (a coin toss: close_calls.py)"
    return f"an arrival {seconds * 1e3:.1f} ms from a predicted step's start{mark}"


def main(with_peers: bool = False, out_dir: Path = Path("bench-results"),
         only: str = "", repeat: int = REPEAT) -> list[dict]:
    """Every server's rows (`only`: the servers whose name contains it; `repeat`: runs of
    each trace)."""
    runs_count(str(repeat))  # the command line's rule, for a call from Python too
    print("The simulator against real servers: the step model fitted to each from outside "
          "(kvdeck calibrate --url), then each trace predicted by the sim and measured on "
          "the server (ratio = predicted / measured)", flush=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for server, sim_flags in servers(with_peers):
            if only and only not in server.name:
                continue
            try:
                server.start(DEFAULT_MODEL)
                rows += compare(server, sim_flags, Path(tmp), repeat)
            except peers.ServerDied as e:
                print(f"{server.name}: {e}; left out", flush=True)
            finally:
                server.stop()
    show(rows)
    out_dir.mkdir(exist_ok=True)
    (out_dir / "sim_vs_real.json").write_text(json.dumps(rows, indent=2))
    return rows


def runs_count(text: str) -> int:
    """`--repeat`'s value: a whole number of runs, 1 or more."""
    if not text.isdecimal() or int(text) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of runs; give a whole number, 1 or more")
    return int(text)


if __name__ == "__main__":
    cli = argparse.ArgumentParser(prog="python -m benchmarks.sim_vs_real",
                                  description=__doc__.split("\n\n")[0])
    cli.add_argument("--peers", action="store_true",
                     help="llama-server and vLLM's CPU build instead of kvdeck's executors")
    cli.add_argument("--only", default="", help="only the servers whose name contains this")
    cli.add_argument("--repeat", type=runs_count, default=REPEAT,
                     help=f"runs of each trace on each server (default {REPEAT}); the "
                          "verdict takes the median of the runs' medians")
    a = cli.parse_args()
    main(a.peers, only=a.only, repeat=a.repeat)
