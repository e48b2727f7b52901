"""Iteration traces: one JSON record per engine step, written to a run directory.

A run directory holds `header.json` (engine config, knobs, pool geometry, executor),
`iterations.jsonl` (one record per step) and `arrivals.jsonl` (every request as a kvdeck
arrival record — its tokens, or the hash ids / prefix group that regenerate them — so the run
can be re-run under another configuration).

A step record holds the plan (`[request, start, new tokens, sampled?]`), the sampled tokens,
timing, admissions, preemptions, rejections, finished requests, copy-on-write copies, knob
changes, arrivals, and the KV events of `BlockManager` — enough to rebuild every block's
state and every request's progress without a model (see `replay.TraceState`).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

from runtime.engine import Engine
from runtime.errors import ConfigError
from runtime.request import Request
from runtime.trace import Arrival

TRACE_VERSION = 1


def dumps(record: dict) -> str:
    """Compact, deterministic JSON (insertion-ordered keys, repr floats)."""
    return json.dumps(record, separators=(",", ":"), allow_nan=False)


def engine_header(engine: Engine) -> dict:
    return {
        "kvdeck_trace": TRACE_VERSION,
        "executor": engine.executor.name,
        "model": engine.executor.model_name,
        "num_blocks": engine.kv.num_blocks,
        "block_size": engine.kv.block_size,
        "kv_format": engine.config.kv_format,
        "bytes_per_block": engine.kv.bytes_per_block,
        "max_model_len": engine.max_model_len,
        "config": dataclasses.asdict(engine.config),
    }


class Recorder:
    """Writes a run directory as the engine steps. Attach with `engine.recorder = rec`."""

    def __init__(self, run_dir: str | Path, engine: Engine, max_bytes: int = 1 << 30,
                 write_requests: bool = False):
        """`write_requests`: log every request the engine admits to arrivals.jsonl with its
        tokens (the console's traffic); trace runs log their compact arrivals instead."""
        self.run_dir = Path(run_dir)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"Cannot create run directory {self.run_dir}: {e.strerror}.") \
                from None
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.truncated = False
        """Set when the size bound stopped recording; the last record says so."""
        (self.run_dir / "header.json").write_text(json.dumps(engine_header(engine), indent=1))
        self._iter = (self.run_dir / "iterations.jsonl").open("w", encoding="utf-8")
        self._arr = (self.run_dir / "arrivals.jsonl").open("w", encoding="utf-8")
        self.engine = engine
        self.write_requests = write_requests
        # The engine thread writes; the console thread may close: one lock for both.
        self._lock = threading.Lock()
        engine.recorder = self

    def __call__(self, record: dict) -> None:
        with self._lock:
            if self.truncated or self._iter.closed:
                return
            line = dumps(record) + "\n"
            if self.num_bytes + len(line) > self.max_bytes:
                self.truncated = True
                line = dumps({"step": record["step"], "truncated": True}) + "\n"
            self._iter.write(line)
            self.num_bytes += len(line)

    def arrival(self, a: Arrival) -> None:
        with self._lock:
            if not self._arr.closed:
                self._arr.write(dumps(a.to_json()) + "\n")

    def on_request(self, req: Request) -> None:
        """Called by the engine as a request arrives (when `write_requests` is set)."""
        if self.write_requests:
            self.arrival(Arrival(
                req.arrival_time, req.num_prompt_tokens, req.sampling.max_tokens,
                prompt_tokens=tuple(req.prompt_token_ids),
                deadline_s=req.deadline - req.arrival_time if req.deadline is not None
                else None, priority=req.priority, request_id=req.request_id))

    def close(self) -> None:
        with self._lock:
            if self.engine.recorder is self:
                self.engine.recorder = None
            self._iter.close()
            self._arr.close()


def read_iterations(run_dir: str | Path) -> tuple[dict, list[dict]]:
    """(header, step records) of a run directory, with a one-sentence error if malformed."""
    d = Path(run_dir)
    try:
        header = json.loads((d / "header.json").read_text())
    except FileNotFoundError:
        raise ConfigError(f"{d} is not a kvdeck run directory (no header.json).") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{d}/header.json is not valid JSON ({e.msg}).") from None
    records = []
    with (d / "iterations.jsonl").open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{d}/iterations.jsonl line {lineno} is not valid JSON "
                                  f"({e.msg}).") from None
    return header, records
