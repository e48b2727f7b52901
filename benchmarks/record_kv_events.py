"""Record a real vLLM server's KV-cache events for the decoder's tests (`tests/data/`).

    python -m benchmarks.record_kv_events      # writes tests/data/vllm_kv_events/*.jsonl

Starts vLLM's CPU build (as `make clients` installs it, `benchmarks/peers.py`) on Gemma 3
270M with events on, subscribes before the server binds, and drives a script of traffic that
makes every event kind: three prompts sharing a prefix (stored blocks with parents), a run of
distinct prompts through a small pool (removals), a prefix-cache reset then one more request
(`AllBlocksCleared` comes with the next engine step). Then it asks the replay endpoint for
everything from sequence 0. Each frame is written as it arrived — topic, sequence number and
the msgpack payload in base64 — with the prompts sent, so a test can check the decoded
token ids against them. It runs twice: with vLLM's default 64-bit integer block hashes, and
with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` (32-byte digests).
"""

from __future__ import annotations

import base64
import json
import random
import sys
import threading
import time
from pathlib import Path

import httpx
import zmq

from benchmarks import peers
from kvdeck.runtime.models.registry import DEFAULT_MODEL, resolve_model

OUT = Path("tests/data/vllm_kv_events")
BLOCKS = 96
"""`--num-gpu-blocks-override`: small enough that the distinct prompts evict."""
TOPIC = "kv"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def traffic(rng: random.Random) -> list[list[int]]:
    prefix = [rng.randrange(1000, 30000) for _ in range(300)]
    shared = [prefix + [rng.randrange(1000, 30000) for _ in range(40 + 17 * i)]
              for i in range(3)]
    distinct = [[rng.randrange(1000, 30000) for _ in range(700)] for _ in range(10)]
    return shared + distinct


def record(int_hashes: bool) -> dict:
    gguf = resolve_model(DEFAULT_MODEL)
    pub, replay = peers.free_port(), peers.free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}",
              "topic": TOPIC}
    server = peers.vllm(gguf, DEFAULT_MODEL, 2, "--kv-events-config", json.dumps(config),
                        "--num-gpu-blocks-override", str(BLOCKS), "--max-num-seqs", "4",
                        "--max-model-len", "1024")
    server.env.update(VLLM_SERVER_DEV_MODE="1", PYTHONHASHSEED="0",
                      VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES="1" if int_hashes else "0")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
    sub.connect(f"tcp://127.0.0.1:{pub}")  # vLLM binds (its endpoint has `*`): we connect
    frames: list[dict] = []
    stop = threading.Event()

    def listen() -> None:
        while not stop.is_set():
            if sub.poll(100):
                topic, seq, payload = sub.recv_multipart()
                frames.append(frame(topic, seq, payload, time.time()))

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    prompts = traffic(random.Random(1))
    steps: list[str] = []
    try:
        server.start(DEFAULT_MODEL)
        base = server.url.removesuffix("/v1")
        for i, p in enumerate(prompts):
            r = httpx.post(server.url + "/completions", timeout=300, json={
                "model": DEFAULT_MODEL, "prompt": p, "max_tokens": 8, "temperature": 0})
            r.raise_for_status()
            steps.append(f"prompt {i}: {len(p)} tokens")
        r = httpx.post(base + "/reset_prefix_cache", timeout=60)
        steps.append(f"POST /reset_prefix_cache -> {r.status_code}")
        httpx.post(server.url + "/completions", timeout=300, json={
            "model": DEFAULT_MODEL, "prompt": prompts[0], "max_tokens": 4, "temperature": 0})
        steps.append("prompt 0 again")
        time.sleep(2)
        replayed = ask_replay(ctx, replay)
    finally:
        stop.set()
        thread.join(5)
        server.stop()
        sub.close(0)
        ctx.term()
    return {"origin": {"server": server.version, "model": "gemma3-270m as a bf16 checkpoint",
                       "argv": server.argv[1:], "env": server.env, "steps": steps,
                       "num_gpu_blocks_override": BLOCKS,
                       "recorded": time.strftime("%Y-%m-%d")},
            "prompts": prompts, "frames": frames, "replay": replayed}


def ask_replay(ctx: zmq.Context, port: int) -> list[dict]:
    """Everything the replay endpoint still buffers from sequence 0 (a DEALER: one request,
    many replies, then the end marker)."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    out = []
    while sock.poll(5000):
        _, topic, seq, payload = sock.recv_multipart()
        if seq == END_SEQ:
            break
        out.append(frame(topic, seq, payload, None))
    sock.close(0)
    return out


def frame(topic: bytes, seq: bytes, payload: bytes, at: float | None) -> dict:
    d = {"topic": topic.decode(), "seq": int.from_bytes(seq, "big"),
         "payload": base64.b64encode(payload).decode()}
    if at is not None:
        d["received"] = round(at, 3)
    return d


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for int_hashes, name in ((True, "int_hashes"), (False, "bytes_hashes")):
        rec = record(int_hashes)
        path = OUT / f"vllm_{name}.json"
        path.write_text(json.dumps(rec, indent=1))
        print(f"{path}: {len(rec['frames'])} frames live, {len(rec['replay'])} replayed",
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
