"""Record real servers' `/metrics` (and llama-server's `/slots`) for attach's tests.

    python -m benchmarks.record_metrics     # writes tests/data/metrics/*_real.txt

Starts vLLM's CPU build and llama-server (as `make clients` installs them,
`benchmarks/peers.py`) on Gemma 3 270M, sends six completions — three sharing a long
prefix, so prefix-cache counters move — and saves each server's `/metrics` text as it then
answers (llama-server started with `--metrics`), and llama-server's `/slots`.
"""

from __future__ import annotations

import random
from datetime import date
from pathlib import Path

import httpx

from benchmarks import peers
from kvdeck.runtime.models.registry import DEFAULT_MODEL, resolve_model

OUT = Path("tests/data/metrics")


def traffic(url: str) -> None:
    rng = random.Random(2)
    prefix = [rng.randrange(1000, 30000) for _ in range(400)]
    for i in range(6):
        own = [rng.randrange(1000, 30000) for _ in range(30)]
        prompt = prefix + own if i < 3 else own * 8
        r = httpx.post(url + "/completions", timeout=300, json={
            "model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0})
        r.raise_for_status()


def main() -> None:
    gguf = resolve_model(DEFAULT_MODEL)
    servers = {
        "vllm_0.32_real.txt": peers.vllm(gguf, DEFAULT_MODEL, 2, "--max-model-len", "2048"),
        "llamacpp_real.txt": peers.llama_server(gguf, DEFAULT_MODEL, 2, repack=False),
    }
    servers["llamacpp_real.txt"].argv.append("--metrics")
    for name, server in servers.items():
        try:
            server.start(DEFAULT_MODEL)
            traffic(server.url)
            base = server.url.removesuffix("/v1")
            text = httpx.get(base + "/metrics", timeout=30).text
            (OUT / name).write_text(f"# {server.version}: recorded by "
                                    f"benchmarks/record_metrics.py on {date.today()}\n" + text)
            if "llama" in name:
                (OUT / "llamacpp_slots_real.json").write_text(
                    httpx.get(base + "/slots", timeout=30).text)
            print(f"{OUT / name}: {len(text.splitlines())} lines", flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
