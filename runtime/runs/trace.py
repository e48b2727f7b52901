"""Arrival traces: kvdeck's own JSONL, Mooncake JSONL and Azure LLM CSV (Bailian, BurstGPT
and AIPerf's `mooncake_trace`: `trace_readers.py`; generated workloads in load stages:
`stages.py`).

All three load into `Arrival` records (seconds from the first arrival). Traces without
prompt text get synthetic tokens that preserve what matters for the KV cache:

- Mooncake: each hash id is a block of `hash_block_tokens` tokens (default 512) generated
  from the id, so equal ids at equal positions give identical token prefixes.
- kvdeck JSONL: explicit `prompt_tokens`, or a `prompt_len` whose first `prefix_len` tokens
  are shared by every record with the same `prefix_group`.
- Azure: lengths only; every prompt is distinct.

kvdeck JSONL schema, one object per line (only `arrival_s` and a prompt are required):

    {"arrival_s": 0.25, "prompt_len": 2048, "output_len": 256,
     "prefix_group": "sys", "prefix_len": 1024, "deadline_s": 7.0, "priority": 0,
     "id": "r1", "session": "chat-7"}
    {"arrival_s": 0.5, "prompt_tokens": [2, 651, 3681], "output_len": 16,
     "check": {"expected": "Paris"}}

`check` (optional) is what the answer must satisfy to count as correct, in the API's shape:
exactly one of `{"json_schema": {...}}`, `{"regex": "..."}`, `{"expected": "..."}`
(`runtime/text/checks.py`).

Files are parsed as data only; a malformed line raises a TraceError naming the file, the line
and the problem.
"""

from __future__ import annotations

import csv
import json
import zlib
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import numpy as np

from kvdeck.runtime.errors import TraceError
from kvdeck.runtime.resources import SAMPLE_TRACES, sample_trace
from kvdeck.runtime.runs.arrival import Arrival, int_field, json_lines, num_field
from kvdeck.runtime.text.checks import parse_check

FORMATS = ("auto", "kvdeck", "mooncake", "azure", "bailian", "burstgpt", "aiperf", "stages",
           "timed-trace")


def _block_tokens(key: int, n: int, vocab_size: int) -> np.ndarray:
    """`n` tokens determined by `key` alone (never token 0..2, often BOS/EOS/PAD ids)."""
    return np.random.default_rng(key).integers(3, vocab_size, n, dtype=np.int64)


def _key(text: str) -> int:
    return zlib.crc32(text.encode())


def synthesize_tokens(a: Arrival, index: int, vocab_size: int,
                      hash_block_tokens: int = 512) -> list[int]:
    """The prompt tokens for an arrival (its own, or synthesized deterministically)."""
    if a.prompt_tokens is not None:
        return list(a.prompt_tokens)
    parts: list[np.ndarray] = []
    if a.hash_ids is not None:
        remaining = a.prompt_len
        size = a.hash_block_tokens or hash_block_tokens
        for h in a.hash_ids:
            n = min(size, remaining)
            parts.append(_block_tokens((1 << 40) + h, n, vocab_size))
            remaining -= n
        if remaining > 0:
            parts.append(_block_tokens((2 << 40) + index, remaining, vocab_size))
    else:
        shared = min(a.prefix_len, a.prompt_len) if a.prefix_group is not None else 0
        if shared:
            parts.append(_block_tokens((3 << 40) + _key(a.prefix_group or ""), shared,
                                       vocab_size))
        parts.append(_block_tokens((4 << 40) + index, a.prompt_len - shared, vocab_size))
    return np.concatenate(parts).tolist()


def detect_format(path: Path) -> str:
    if path.suffix.lower() == ".toml":
        return "stages"
    if path.suffix.lower() == ".csv":
        with path.open(encoding="utf-8", errors="replace") as f:
            return "burstgpt" if f.readline().startswith("Timestamp,") else "azure"
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    first = json.loads(line)
                except json.JSONDecodeError:
                    raise TraceError(f"{path} line 1 is not JSON; trace files are kvdeck, "
                                     "Mooncake, Bailian or AIPerf JSONL, Azure or BurstGPT "
                                     "CSV, or a staged workload (.toml).") from None
                keys = set(first) if isinstance(first, dict) else set()
                if "chat_id" in keys:
                    return "bailian"
                if "input_length" in keys and keys & {"session_id", "delay"}:
                    return "aiperf"
                if "hash_ids" in keys and "timestamp" in keys:
                    return "mooncake"
                return "kvdeck"
    raise TraceError(f"{path} is empty; a trace needs at least one request.")


def resolve_trace(path: str | Path) -> Path:
    """A trace file's path: `path` itself, or the shipped sample of that name."""
    p = Path(path)
    if p.is_file():
        return p
    sample = sample_trace(str(path))
    if sample is not None:
        return Path(str(sample))
    raise TraceError(f"Trace file {p} does not exist; sample traces are "
                     f"{', '.join(SAMPLE_TRACES)}.")


def load_arrivals(path: str | Path, fmt: str = "auto", *, limit: int | None = None,
                  time_scale: float = 1.0) -> list[Arrival]:
    """Read an arrival trace. `time_scale` multiplies inter-arrival times (0.5: twice as fast);
    `limit` keeps the first N requests."""
    p = resolve_trace(path)
    fmt, _, options = fmt.partition(":")  # timed-trace:key=value,... (vLLM's settings)
    if options and fmt != "timed-trace":
        raise TraceError(f"Only --format timed-trace takes options after a colon; got "
                         f"{fmt}:{options}.")
    if fmt not in FORMATS:
        raise TraceError(f"Unknown trace format {fmt!r}; formats are {', '.join(FORMATS)}.")
    if time_scale <= 0:
        raise TraceError(f"time_scale must be greater than 0, got {time_scale}.")
    if fmt == "auto":
        fmt = detect_format(p)
    from kvdeck.runtime.runs import trace_readers as tr
    from kvdeck.runtime.runs.stages import read_stages

    timed = tr.timed_trace_options(options) if fmt == "timed-trace" else None
    reader = {"kvdeck": _read_kvdeck, "mooncake": _read_mooncake, "azure": _read_azure,
              "bailian": tr.read_bailian, "burstgpt": tr.read_burstgpt,
              "aiperf": tr.read_aiperf, "stages": read_stages,
              "timed-trace": lambda path: tr.read_timed_trace(path, timed)}[fmt]
    out: list[Arrival] = []
    for a in reader(p):
        out.append(a)
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise TraceError(f"{p} holds no requests.")
    t0 = min(a.arrival_s for a in out)
    out = [replace(a, arrival_s=(a.arrival_s - t0) * time_scale) for a in out]
    out.sort(key=lambda a: a.arrival_s)
    return out


def _read_kvdeck(path: Path) -> Iterator[Arrival]:
    for lineno, o in json_lines(path):
        where = f"{path} line {lineno}"
        arrival = num_field(o, "arrival_s", where, required=True)
        tokens = o.get("prompt_tokens")
        if tokens is not None:
            if not isinstance(tokens, list) or not tokens or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
                raise TraceError(f"{where} has prompt_tokens that are not a non-empty list of "
                                 "token ids ≥ 0.")
            n = len(tokens)
        else:
            n = int_field(o, "prompt_len", where, lo=1)
        group = o.get("prefix_group")
        yield Arrival(
            arrival_s=float(arrival), prompt_len=n,
            output_len=int_field(o, "output_len", where, 1, 16),
            prompt_tokens=tuple(tokens) if tokens is not None else None,
            hash_ids=tuple(o["hash_ids"]) if isinstance(o.get("hash_ids"), list) else None,
            prefix_group=str(group) if group is not None else None,
            prefix_len=int_field(o, "prefix_len", where, 0, 0),
            deadline_s=num_field(o, "deadline_s", where),
            priority=int_field(o, "priority", where, -(1 << 31), 0),
            request_id=str(o["id"]) if "id" in o else None,
            check=parse_check(o["check"], where=f"The check on {where}", error=TraceError)
            if "check" in o else None,
            session=str(o["session"]) if o.get("session") is not None else None,
        )


def _read_mooncake(path: Path) -> Iterator[Arrival]:
    for lineno, o in json_lines(path):
        where = f"{path} line {lineno}"
        ts = num_field(o, "timestamp", where, required=True)
        n = int_field(o, "input_length", where, 1)
        hashes = o.get("hash_ids")
        if not isinstance(hashes, list) or not all(isinstance(h, int) for h in hashes):
            raise TraceError(f"{where} has hash_ids that are not a list of integers.")
        yield Arrival(float(ts) / 1000.0, n, int_field(o, "output_length", where, 1),
                      hash_ids=tuple(hashes))


def _parse_azure_time(text: str, where: str) -> float:
    # "2023-11-16 18:17:03.9799600": seven fractional digits; datetime takes six.
    head, _, frac = text.strip().partition(".")
    try:
        base = datetime.fromisoformat(head)
        return base.timestamp() + (float("0." + frac) if frac else 0.0)
    except ValueError:
        raise TraceError(f"{where} has TIMESTAMP {text!r}; expected like "
                         "'2023-11-16 18:17:03.9799600'.") from None


def _read_azure(path: Path) -> Iterator[Arrival]:
    with path.open(encoding="utf-8", errors="replace", newline="") as f:
        rows = csv.reader(f)
        header = next(rows, None)
        want = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
        if header is None or [h.strip() for h in header] != want:
            raise TraceError(f"{path} line 1 must be the header {','.join(want)}.")
        for lineno, row in enumerate(rows, 2):
            if not row:
                continue
            where = f"{path} line {lineno}"
            if len(row) != 3:
                raise TraceError(f"{where} has {len(row)} fields; expected 3.")
            try:
                ctx, gen = int(row[1]), int(row[2])
            except ValueError:
                raise TraceError(f"{where} has non-integer token counts {row[1:]!r}.") from None
            if ctx < 1 or gen < 0:
                raise TraceError(f"{where} has ContextTokens={ctx}, GeneratedTokens={gen}; "
                                 "context must be ≥ 1 and generated ≥ 0.")
            # A request that generated nothing still asks for one token.
            yield Arrival(_parse_azure_time(row[0], where), ctx, max(gen, 1))


def synthetic_arrivals(n: int, rate_per_s: float, *, burstiness: float = 1.0,
                       prompt_len: int = 512, output_len: int = 128, spread: float = 0.5,
                       seed: int = 0) -> list[Arrival]:
    """`n` arrivals with gamma inter-arrival times (shape `burstiness`; 1 is Poisson, below 1
    burstier) at `rate_per_s`, lengths uniform within ±`spread` of the means."""
    if n < 1 or rate_per_s <= 0 or burstiness <= 0 or not 0 <= spread < 1:
        raise TraceError("Synthetic arrivals need n ≥ 1, rate > 0, burstiness > 0 and "
                         "0 ≤ spread < 1.")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(burstiness, 1.0 / (rate_per_s * burstiness), n)
    times = np.cumsum(gaps) - gaps[0]

    def lengths(mean: int) -> np.ndarray:
        lo, hi = max(int(mean * (1 - spread)), 1), max(int(mean * (1 + spread)), 1)
        return rng.integers(lo, hi + 1, n)

    return [Arrival(float(t), int(p), int(o))
            for t, p, o in zip(times, lengths(prompt_len), lengths(output_len), strict=True)]
