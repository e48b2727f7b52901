"""`kvdeck serve` (llama_cpp executor) vs llama-cpp-python's own OpenAI server, same GGUF.

Model: Gemma 3 270M (Q4_K_M GGUF, the embedded default), 2 threads on both sides. The
peer is `python -m llama_cpp.server` from llama-cpp-python's `[server]` extra, installed
in a virtual environment of its own (`.venv-clients/llama-server`, built here on first
use; pip's wheel cache makes the rebuild of llama-cpp-python quick). The servers run one
after the other and are driven by the same load: `kvdeck bench` with synthetic 128-token
prompts (text windows of a built-in English passage, which both tokenize with the same
vocabulary; llama-cpp-python's server takes no token-id prompts) and exactly 32 output
tokens, greedy (`ignore_eos` for kvdeck; `min_tokens` for the peer, which has no
`ignore_eos`), at concurrency 1 (8 requests) and 8 (32 requests), all sent at once and
capped in flight by `--concurrency`. The peer serves one request at a time and queues the
rest (`--interrupt_requests False`; by default a new request cancels the running one).
Reported per server and concurrency: output tokens/s, TTFT and ITL medians, and kvdeck's
ratios to the peer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from runtime.models.registry import DEFAULT_MODEL, resolve_model

PEER_VENV = Path(".venv-clients/llama-server")
PEER_SPEC = "llama-cpp-python[server]==0.3.36"
THREADS = 2
PROMPT_TOKENS, OUTPUT_TOKENS = 128, 32
CASES = ((1, 8), (8, 32))
"""(concurrency, requests)."""


def peer_python() -> Path:
    """The peer's interpreter, installing llama-cpp-python's server into its own venv
    the first time."""
    py = PEER_VENV / "bin" / "python"
    stamp = PEER_VENV / ".installed"
    if not stamp.exists():
        subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", PEER_SPEC], check=True)
        stamp.touch()
    return py


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


@contextmanager
def server(argv: list[str], url: str, env: dict | None = None):
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **(env or {})})
    try:
        wait_ready(url, proc)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def drive(url: str, concurrency: int, n: int, exact_length_field: str) -> dict:
    """`kvdeck bench` against `url`; its summary."""
    r = subprocess.run(
        [sys.executable, "-m", "console.cli", "bench", "--url", url, "--model", DEFAULT_MODEL,
         "--text-prompts", "--prompt-len", str(PROMPT_TOKENS), "--output-len",
         str(OUTPUT_TOKENS), "--length-spread", "0", "--num-requests", str(n), "--rate",
         "1000", "--concurrency", str(concurrency), "--exact-length-field",
         exact_length_field, "--json"], capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"kvdeck bench failed: {r.stderr.strip()[-500:]}")
    summary = json.loads(r.stdout)["summary"]
    if summary["statuses"] != {"finished_length": n}:
        raise RuntimeError(f"not every request finished: {summary['statuses']}")
    return summary


def measure(name: str, argv: list[str], url: str, field: str) -> list[dict]:
    rows = []
    with server(argv, url):
        for conc, n in CASES:
            s = drive(url, conc, n, field)
            row = {"server": name, "concurrency": conc, "requests": n,
                   "output_tokens_per_s": s["output_tokens_per_s"],
                   "ttft_p50_s": s["ttft_s"]["p50"], "itl_p50_s": s["itl_s"]["p50"]}
            rows.append(row)
            print(f"{name:>16} concurrency {conc}: {row['output_tokens_per_s']:6.1f} tok/s, "
                  f"TTFT p50 {1e3 * row['ttft_p50_s']:6.0f} ms, ITL p50 "
                  f"{1e3 * row['itl_p50_s']:5.1f} ms", flush=True)
    return rows


def main(out_dir: Path = Path("bench-results")) -> dict:
    print(__doc__.strip().splitlines()[0])
    path = resolve_model(DEFAULT_MODEL)
    print(f"model {path.name}; {PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} output tokens, "
          f"greedy; {THREADS} threads each; concurrency/requests {CASES}")
    py = peer_python()
    port = free_port()
    peer = measure("llama_cpp.server", [
        str(py), "-m", "llama_cpp.server", "--model", str(path), "--host", "127.0.0.1",
        "--port", str(port), "--n_threads", str(THREADS), "--n_threads_batch", str(THREADS),
        "--n_ctx", "2048", "--interrupt_requests", "False"],
        f"http://127.0.0.1:{port}/v1", "min_tokens")
    port = free_port()
    ours = measure("kvdeck llama_cpp", [
        sys.executable, "-m", "console.cli", "serve", "--executor", "llama_cpp",
        "--threads", str(THREADS), "--port", str(port), "--served-model-name",
        DEFAULT_MODEL], f"http://127.0.0.1:{port}/v1", "ignore_eos")
    ratios = []
    for p, k in zip(peer, ours, strict=True):
        r = {"concurrency": p["concurrency"],
             "throughput": k["output_tokens_per_s"] / p["output_tokens_per_s"],
             "ttft": k["ttft_p50_s"] / p["ttft_p50_s"], "itl": k["itl_p50_s"] / p["itl_p50_s"]}
        ratios.append(r)
        print(f"kvdeck / peer at concurrency {r['concurrency']}: throughput "
              f"{r['throughput']:.2f}x, TTFT p50 {r['ttft']:.2f}x, ITL p50 {r['itl']:.2f}x")
    out_dir.mkdir(exist_ok=True)
    result = {"benchmark": "serve_vs_llama_server", "model": path.name, "threads": THREADS,
              "peer": PEER_SPEC, "rows": peer + ours, "ratios": ratios}
    (out_dir / "serve_vs_llama_server.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
