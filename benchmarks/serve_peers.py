"""`kvdeck serve` (each real executor) beside llama.cpp's own server and vLLM's CPU build:
same machine, same GGUF, same load, same client (`kvdeck bench`), from one run.

The servers (`benchmarks/peers.py`) are all started first and stay up, idle but for the
one under load; then every case runs on every server in turn, round after round, each
round in another order. On a shared cloud machine the speed of the same code drifts by
20 % within minutes, so figures from servers measured an hour apart compare the weather:
here each round's servers run minutes apart, and the ratios to llama-server are taken per
round and their median reported.

Loads, 64 output tokens per request exactly (`ignore_eos`), greedy, streamed, all
requests sent at once and capped in flight by the concurrency:
- **text**: 128-token text prompts (windows of a built-in passage, starting at different
  places), at concurrency 1 (8 requests), 8 (32) and 32 (64);
- **shared prefix**: 1,024 token ids every request shares, then 128 of its own, at
  concurrency 1 (8) and 8 (32): prefix caches show here (kvdeck's prefix tree, llama-server's
  slot prompt cache, vLLM's block cache).

`KVDECK_BENCH_ROUNDS` (default 2) sets the rounds, `KVDECK_BENCH_SERVERS` a
comma-separated subset of `llama-server,vllm,llama_cpp,torch`. Results:
`bench-results/serve_peers.json`.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks import peers
from runtime.models.registry import DEFAULT_MODEL, resolve_model

THREADS = 2
PROMPT_TOKENS, OUTPUT_TOKENS, PREFIX_TOKENS = 128, 64, 1024
CASES = (("text", 1, 8), ("text", 8, 32), ("text", 32, 64), ("shared prefix", 1, 8),
         ("shared prefix", 8, 32))
"""(load, concurrency, requests)."""
VOCAB = 262_144
"""Gemma 3's vocabulary: the shared-prefix load's token ids are drawn from it."""
BASE = "llama-server"


def shared_prefix_trace(path: Path, n: int) -> Path:
    lines = [{"arrival_s": 0.0, "prompt_len": PREFIX_TOKENS + PROMPT_TOKENS,
              "output_len": OUTPUT_TOKENS, "prefix_group": "system",
              "prefix_len": PREFIX_TOKENS} for _ in range(n)]
    path.write_text("".join(json.dumps(o) + "\n" for o in lines))
    return path


def drive(url: str, load: str, concurrency: int, n: int, out_dir: Path) -> dict:
    """`kvdeck bench` against `url`; its summary."""
    if load == "text":
        source = ["--text-prompts", "--prompt-len", str(PROMPT_TOKENS), "--output-len",
                  str(OUTPUT_TOKENS), "--length-spread", "0", "--num-requests", str(n),
                  "--rate", "1000"]
    else:
        source = [str(shared_prefix_trace(out_dir / f"shared-prefix-{n}.jsonl", n)),
                  "--vocab-size", str(VOCAB)]
    r = subprocess.run(
        [sys.executable, "-m", "console.cli", "bench", *source, "--url", url, "--model",
         DEFAULT_MODEL, "--concurrency", str(concurrency), "--exact-length-field",
         "ignore_eos", "--json"], capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"kvdeck bench failed: {r.stderr.strip()[-500:]}")
    summary = json.loads(r.stdout)["summary"]
    if summary["statuses"] != {"finished_length": n}:
        raise RuntimeError(f"not every request finished: {summary['statuses']}")
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
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return " ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16",
                                            "amx_int8", "amx_bf16") if f in have)
    except OSError:
        pass
    return ""


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
        for rnd in range(rounds):
            order = servers[rnd % len(servers):] + servers[:rnd % len(servers)]
            for load, conc, n in CASES:
                for s in order:
                    r = row(s.name, rnd, load, conc, n, drive(s.url, load, conc, n, out_dir))
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
