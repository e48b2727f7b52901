"""Run directories: what a recording writes and replay reads.

A run directory holds

- `header.json`: the run format version, engine config, knobs, pool geometry, executor;
- `iterations.jsonl`: a `Checkpoint` record (the engine state when recording started — a
  recording may start mid-run, with requests in flight and prefixes cached), then one
  `StepRecord` per step, and a `Truncated` record if the size bound was reached
  (`core/checkpoint.py`, `core/step_record.py` and `runs/records.py` define them);
- `arrivals.jsonl`: every request as a kvdeck arrival record — its tokens, or the hash ids /
  prefix group that regenerate them — so the run can be re-run under another configuration.

`record_headless` attaches a recorder to an engine no thread is stepping (run-trace);
`record_live` asks a running engine to attach it at its next iteration boundary, where it
takes the checkpoint on its own thread.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

from kvdeck.runtime.core.checkpoint import Checkpoint
from kvdeck.runtime.core.commands import StartRecording, StopRecording
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import Request
from kvdeck.runtime.core.step_record import StepRecord
from kvdeck.runtime.errors import ConfigError, RunFormatError
from kvdeck.runtime.executors.base import Modelled, draft_kv_bytes_per_token, has, offload_of
from kvdeck.runtime.planning.roofline import executor_peaks
from kvdeck.runtime.runs.records import RUN_FORMAT, Record, Truncated, dumps, parse_record
from kvdeck.runtime.runs.trace import Arrival


def engine_header(engine: Engine) -> dict:
    ex, info = engine.executor, engine.executor.info
    offload, gain = offload_of(ex)
    return {
        "kvdeck_run": RUN_FORMAT,
        "executor": info.name,
        "model": info.model_name,
        "num_blocks": engine.kv.num_blocks,
        "block_size": engine.kv.block_size,
        "kv_format": engine.switcher.kv_format,
        "bytes_per_block": engine.kv.bytes_per_block,
        "host_blocks": engine.kv.host.num_blocks,
        "link_bandwidth": info.link_bandwidth,
        "link": info.link_detail,
        "draft_model": info.draft_model_name,
        "draft_kv_bytes_per_token": {f: draft_kv_bytes_per_token(ex, f)
                                     for f in info.kv_formats} if info.draft_model_name else {},
        "offload": offload,
        "offload_gain_bytes": gain,
        "max_model_len": engine.max_model_len,
        "layer_groups": dataclasses.asdict(engine.groups) if engine.groups else None,
        "config": dataclasses.asdict(engine.config),
        # The roofline peaks the live readout used: a replay draws the same readout.
        "peaks": dataclasses.asdict(peaks) if (peaks := executor_peaks(ex)) else None,
        # The sim's card and power: a replayed summary models the same energy.
        "modelled_power": [ex.hardware.name, ex.hardware.power_watts]
        if has(ex, Modelled) else None,
    }


class Recorder:
    """Writes a run directory as the engine steps (see `record_headless`, `record_live`)."""

    def __init__(self, run_dir: str | Path, engine: Engine, max_bytes: int = 1 << 30,
                 write_requests: bool = False):
        """`write_requests`: log every request the engine admits to arrivals.jsonl with its
        tokens (the console's traffic); trace runs log their compact arrivals instead."""
        self.run_dir = Path(run_dir)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "header.json").write_text(json.dumps(engine_header(engine),
                                                                 indent=1))
            self._iter = (self.run_dir / "iterations.jsonl").open("w", encoding="utf-8")
            self._arr = (self.run_dir / "arrivals.jsonl").open("w", encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"Cannot write run directory {self.run_dir}: {e.strerror}.") \
                from None
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.truncated = False
        """Set when the size bound stopped recording; the last record says so."""
        self.engine = engine
        self.write_requests = write_requests
        # The engine thread writes; another thread may close: one lock for both.
        self._lock = threading.Lock()

    def _write(self, data: dict, step: int) -> None:
        with self._lock:
            if self.truncated or self._iter.closed:
                return
            line = dumps(data) + "\n"
            if self.num_bytes + len(line) > self.max_bytes:
                self.truncated = True
                line = dumps(Truncated(step).to_json()) + "\n"
            self._iter.write(line)
            self.num_bytes += len(line)

    def begin(self, checkpoint: Checkpoint) -> None:
        """The first record: the engine's state as recording starts."""
        self._write(checkpoint.to_json(), checkpoint.step)

    def __call__(self, record: StepRecord) -> None:
        self._write(record.to_json(), record.step)

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
                else None, priority=req.priority, request_id=req.request_id,
                check=req.check))

    def close(self) -> None:
        with self._lock:
            if self.engine.recorder is self:
                self.engine.recorder = None
            self._iter.close()
            self._arr.close()


def record_headless(engine: Engine, run_dir: str | Path, **kwargs) -> Recorder:
    """Record an engine that no thread is stepping (the caller steps it): attach now."""
    rec = Recorder(run_dir, engine, **kwargs)
    rec.begin(engine.checkpoint())
    engine.recorder = rec
    return rec


def record_live(engine: Engine, run_dir: str | Path, **kwargs) -> Recorder:
    """Record an engine its loop is stepping: it attaches the recorder (and writes the
    checkpoint) at its next iteration boundary. Stop with `stop_live`."""
    rec = Recorder(run_dir, engine, **kwargs)
    engine.post(StartRecording(rec))
    return rec


def stop_live(engine: Engine) -> None:
    """Detach and close the live recorder after the current iteration."""
    engine.post(StopRecording())


def read_run(run_dir: str | Path) -> tuple[dict, list[Record]]:
    """(header, typed records) of a run directory; one sentence if it is malformed, of
    another format version, or holds a record kind this version does not know."""
    d = Path(run_dir)
    try:
        header = json.loads((d / "header.json").read_text())
    except FileNotFoundError:
        raise RunFormatError(f"{d} is not a kvdeck run directory (no header.json).") from None
    except json.JSONDecodeError as e:
        raise RunFormatError(f"{d}/header.json is not valid JSON ({e.msg}).") from None
    if not isinstance(header, dict):
        raise RunFormatError(f"{d}/header.json is not a JSON object.")
    version = header.get("kvdeck_run", header.get("kvdeck_trace"))
    if version != RUN_FORMAT:
        raise RunFormatError(
            f"{d} was recorded in run format {version!r} and this kvdeck reads format "
            f"{RUN_FORMAT}; re-run its arrivals to record it again (kvdeck run-trace "
            f"{d}/arrivals.jsonl --record NEW_DIR).")
    for key in ("num_blocks", "block_size"):
        if not isinstance(header.get(key), int) or header[key] < 1:
            raise RunFormatError(f"{d}/header.json lacks a positive integer {key!r}.")
    records: list[Record] = []
    try:
        with (d / "iterations.jsonl").open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    records.append(parse_record(line, f"{d}/iterations.jsonl line {lineno}"))
    except FileNotFoundError:
        raise RunFormatError(f"{d} has no iterations.jsonl.") from None
    return header, records
