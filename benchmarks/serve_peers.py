"""`kvdeck serve` (each real executor) beside llama.cpp's own server and vLLM's CPU build:
same machine, same GGUF, same load, same client (`kvdeck bench`), from one run.

The servers (`benchmarks/peers.py`) are all started first and stay up, idle but for the
one under load; then every case runs on every server in turn, round after round, each
round in another order. On a shared cloud machine the speed of the same code drifts by
20 % within minutes, so figures from servers measured an hour apart compare the weather:
here each round's servers run minutes apart, and the ratios to llama-server are taken per
round and their median reported.

Loads, 64 output tokens per request exactly (`ignore_eos`), greedy, streamed, all
requests sent at once and capped in flight by the concurrency, prompts as token ids (the
same ids reach every server; none tokenizes):
- **distinct**: 128-token prompts, `<bos>` and random ids, at concurrency 1 (8 requests), 8
  (32) and 32 (64);
- **shared prefix**: 1,024 tokens every request of the case shares, then 128 of its own, at
  concurrency 1 (8) and 8 (32): prefix caches show here (kvdeck's prefix tree, llama-server's
  slot prompt cache, vLLM's block cache).

Every prompt of the run is new to every server but for the prefix a case shares on
purpose. Windows of one English passage, as `kvdeck bench --text-prompts` sends, overlap
from one request to the next, and llama-server then reuses most of a prompt from its
previous one (a 50 ms first token for a 128-token prompt); rounds that repeated their
prompts measured every server's prefix cache from the second round on.

`KVDECK_BENCH_ROUNDS` (default 2) sets the rounds, `KVDECK_BENCH_SERVERS` a
comma-separated subset of `llama-server,vllm,llama_cpp,torch`. Results:
`bench-results/serve_peers.json`.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks import peers
from kvdeck.runtime.models.kernels import cpuinfo
from kvdeck.runtime.models.registry import DEFAULT_MODEL, resolve_model

THREADS = 2
PROMPT_TOKENS, OUTPUT_TOKENS, PREFIX_TOKENS = 128, 64, 1024
CASES = (("distinct", 1, 8), ("distinct", 8, 32), ("distinct", 32, 64),
         ("shared prefix", 1, 8), ("shared prefix", 8, 32))
"""(load, concurrency, requests)."""
VOCAB = 262_144
"""Gemma 3's vocabulary: the shared-prefix load's token ids are drawn from it."""
BASE = "llama-server"


class Prompts:
    """Prompts that share nothing with any earlier one of the run, unless told to."""

    def __init__(self, bos: int = 2):
        self.bos = bos
        self.rng = random.Random(0)

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(1000, VOCAB) for _ in range(n)]

    def trace(self, path: Path, load: str, n: int) -> Path:
        """A kvdeck JSONL trace of `n` requests of `load`, all arriving at once."""
        if load == "shared prefix":  # the prefix (with the <bos>), then 128 of its own
            shared, own = [self.bos, *self.ids(PREFIX_TOKENS - 1)], PROMPT_TOKENS
        else:
            shared, own = [self.bos], PROMPT_TOKENS - 1
        lines = [{"arrival_s": 0.0, "output_len": OUTPUT_TOKENS,
                  "prompt_tokens": shared + self.ids(own)} for _ in range(n)]
        path.write_text("".join(json.dumps(o) + "\n" for o in lines))
        return path


def drive(url: str, trace: Callable[[], Path], concurrency: int, n: int) -> dict:
    """`kvdeck bench` against `url` on a trace `trace()` writes; its summary. A run in
    which some request did not finish (llama-server now and then drops a connection before
    answering) is said and run once more on new prompts: the same ones would find the
    server's cache warm."""
    try:
        return _drive(url, trace(), concurrency, n)
    except Unfinished as e:
        print(f"  {url}: {e}; running the case again on new prompts", flush=True)
        return _drive(url, trace(), concurrency, n)


class Unfinished(RuntimeError):
    pass


def _drive(url: str, trace: Path, concurrency: int, n: int) -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "kvdeck.console.cli", "bench", str(trace), "--url", url, "--model",
         DEFAULT_MODEL, "--concurrency", str(concurrency), "--exact-length-field",
         "ignore_eos", "--json"], capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"kvdeck bench failed: {r.stderr.strip()[-500:]}")
    out = json.loads(r.stdout)
    summary = out["summary"]
    if summary["statuses"] != {"finished_length": n}:
        why = sorted({q["reason"] or q["status"] for q in out["requests"]
                      if q["status"] != "finished_length"})
        raise Unfinished(f"not every request finished: {summary['statuses']} ({'; '.join(why)})")
    return summary


def start_llama_server(model: Path) -> peers.Server:
    """llama-server with re-packed weights where they work here, else `--no-repack`."""
    for repack in (True, False):
        s = peers.llama_server(model, DEFAULT_MODEL, THREADS, repack)
        try:
            s.start(DEFAULT_MODEL)
            return s
        except peers.ServerDied as e:
            s.stop()
            print(f"{s.name}: {e}", flush=True)
    raise RuntimeError("llama-server dies on this machine with and without --no-repack")


def cpu_model() -> str:
    return cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_flags() -> str:
    """The instruction sets that decide kernels here, of those the CPU reports."""
    have = set((cpuinfo("flags") or "").split())
    return " ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8",
                                "amx_bf16") if f in have)


def row(name: str, rnd: int, load: str, conc: int, n: int, s: dict) -> dict:
    return {"server": name, "round": rnd, "load": load, "concurrency": conc, "requests": n,
            "output_tokens_per_s": s["output_tokens_per_s"],
            **{f"{k}_{p}_s": s[f"{k}_s"][p] for k in ("ttft", "itl", "e2e")
               for p in ("p50", "p90")}}


def table(rows: list[dict], names: list[str]) -> list[dict]:
    """Per server and case: medians over rounds, and the median of the per-round ratios to
    llama-server (throughput; TTFT and ITL p50, lower is better)."""
    out = []
    for load, conc, _ in CASES:
        base = {r["round"]: r for r in rows if r["server"].startswith(BASE)
                and (r["load"], r["concurrency"]) == (load, conc)}
        for name in names:
            mine = [r for r in rows if r["server"] == name
                    and (r["load"], r["concurrency"]) == (load, conc)]
            if not mine:
                continue
            med = {k: statistics.median(r[k] for r in mine) for k in mine[0]
                   if k.endswith("_s")}
            ratio = {}
            if base and not name.startswith(BASE):
                for key, col in (("throughput", "output_tokens_per_s"),
                                 ("ttft_p50", "ttft_p50_s"), ("itl_p50", "itl_p50_s")):
                    ratio[key] = statistics.median(r[col] / base[r["round"]][col]
                                                   for r in mine if r["round"] in base)
            out.append({"server": name, "load": load, "concurrency": conc, **med,
                        "ratio_to_llama_server": ratio})
    return out


def show(summary: list[dict]) -> None:
    print(f"\n{'server':<28} {'load':<13} {'conc':>4} {'tok/s':>7} {'TTFT p50':>9} "
          f"{'ITL p50':>8} {'E2E p50':>8}   vs llama-server: tok/s, TTFT, ITL")
    for s in summary:
        r = s["ratio_to_llama_server"]
        ratios = f"{r['throughput']:.2f}x, {r['ttft_p50']:.2f}x, {r['itl_p50']:.2f}x" \
            if r else "1 (the base)"
        print(f"{s['server']:<28} {s['load']:<13} {s['concurrency']:>4} "
              f"{s['output_tokens_per_s']:>7.1f} {1e3 * s['ttft_p50_s']:>7.0f}ms "
              f"{1e3 * s['itl_p50_s']:>6.1f}ms {s['e2e_p50_s']:>7.2f}s   {ratios}")


def main(out_dir: Path = Path("bench-results")) -> dict:
    print(__doc__.strip().splitlines()[0])
    out_dir.mkdir(exist_ok=True)
    model = resolve_model(DEFAULT_MODEL)
    rounds = int(os.environ.get("KVDECK_BENCH_ROUNDS", "2"))
    wanted = os.environ.get("KVDECK_BENCH_SERVERS", "llama-server,vllm,llama_cpp,torch")
    wanted = [w.strip() for w in wanted.split(",") if w.strip()]
    servers: list[peers.Server] = []
    try:
        for w in wanted:  # the base first: a machine where it cannot run has no table
            if w == "llama-server":
                servers.append(start_llama_server(model))
            elif w == "vllm":
                s = peers.vllm(model, DEFAULT_MODEL, THREADS)
                s.start(DEFAULT_MODEL)
                servers.append(s)
            elif w in ("llama_cpp", "torch"):
                s = peers.kvdeck(w, DEFAULT_MODEL, THREADS)
                s.start(DEFAULT_MODEL)
                servers.append(s)
            else:
                raise SystemExit(f"KVDECK_BENCH_SERVERS: {w!r} is not one of llama-server, "
                                 "vllm, llama_cpp, torch.")
        print(f"{cpu_model()} ({cpu_flags()}), {os.cpu_count()} cores; {model.name}; "
              f"{THREADS} threads in every server; {rounds} rounds; (load, concurrency, "
              f"requests) {CASES}")
        for s in servers:
            print(f"  {s.name}: {s.version}")
        rows = []
        prompts = Prompts()
        for rnd in range(rounds):
            order = servers[rnd % len(servers):] + servers[:rnd % len(servers)]
            for load, conc, n in CASES:
                for s in order:
                    path = out_dir / f"serve-peers-{len(rows)}.jsonl"
                    r = row(s.name, rnd, load, conc, n, drive(
                        s.url, functools.partial(prompts.trace, path, load, n), conc, n))
                    rows.append(r)
                    print(f"round {rnd + 1} {s.name:>26} {load:>13} c={conc:<2}: "
                          f"{r['output_tokens_per_s']:6.1f} tok/s, TTFT p50 "
                          f"{1e3 * r['ttft_p50_s']:6.0f} ms, ITL p50 "
                          f"{1e3 * r['itl_p50_s']:5.1f} ms", flush=True)
    finally:
        for s in servers:
            s.stop()
    summary = table(rows, [s.name for s in servers])
    show(summary)
    result = {"benchmark": "serve_peers", "cpu": cpu_model(), "cpu_flags": cpu_flags(),
              "cores": os.cpu_count(), "threads": THREADS, "model": model.name,
              "rounds": rounds, "versions": {s.name: s.version for s in servers},
              "rows": rows, "summary": summary}
    (out_dir / "serve_peers.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
