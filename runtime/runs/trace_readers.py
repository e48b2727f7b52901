"""Readers of the traces the field publishes besides Mooncake's and Azure's (`trace.py`),
each read as its format is written, with its own block size and time unit:

- **Bailian** (Alibaba's Qwen-Bailian usage traces, JSONL): `chat_id`, `parent_chat_id`
  (−1 at a session's first turn), `timestamp` in seconds, `input_length`, `output_length`,
  `turn`, `type`, `hash_ids` of 16-token blocks. A session is the chain of chats from its
  root; each row covers its whole context, so a later turn's hash ids repeat the earlier
  turns' and share their prefix.
- **BurstGPT** (CSV): `Timestamp` in seconds, `Model`, `Request tokens`, `Response tokens`,
  `Total tokens`, `Log Type`. Lengths only: every prompt is distinct. A failed request
  (0 response tokens) still arrives and asks for one token.
- **AIPerf's `mooncake_trace`** (JSONL): Mooncake's fields (`input_length`,
  `output_length`, `hash_ids` of 512-token blocks) with `session_id` and, instead of a
  `timestamp` in milliseconds, a `delay` in milliseconds after the session's previous turn.
  AIPerf counts a delay from the previous answer; a trace run has no client waiting for
  answers, so here it counts from the previous turn's arrival (a lower bound on the gap).
- **vLLM's `timed_trace`** (`vllm bench serve --dataset-name timed_trace`): Mooncake-shaped
  JSONL read with vLLM's settings — `--format timed-trace:chunk_hash_size=512,
  sec_multiplier=0.001,label_timestamp=ts` — defaults as vLLM's (16-token chunks, seconds,
  Mooncake's field names).
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path

from kvdeck.runtime.errors import TraceError
from kvdeck.runtime.runs.arrival import Arrival, int_field, json_lines, num_field

BAILIAN_BLOCK = 16
AIPERF_BLOCK = 512
BURSTGPT_HEADER = ["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens",
                   "Log Type"]


def _hash_ids(o: dict, where: str, required: bool) -> tuple[int, ...] | None:
    hashes = o.get("hash_ids")
    if hashes is None and not required:
        return None
    if not isinstance(hashes, list) or not all(isinstance(h, int) and not isinstance(h, bool)
                                               for h in hashes):
        raise TraceError(f"{where} has hash_ids that are not a list of integers.")
    return tuple(hashes)


def read_bailian(path: Path) -> Iterator[Arrival]:
    roots: dict[int, int] = {}
    for lineno, o in json_lines(path):
        where = f"{path} line {lineno}"
        chat = int_field(o, "chat_id", where, lo=-(1 << 62))
        parent = int_field(o, "parent_chat_id", where, lo=-1, default=-1)
        if parent != -1 and parent not in roots:
            raise TraceError(f"{where} continues chat {parent}, which no earlier line "
                             "starts; a session's turns must follow its first.")
        roots[chat] = chat if parent == -1 else roots[parent]
        yield Arrival(num_field(o, "timestamp", where, required=True),
                      int_field(o, "input_length", where, 1),
                      max(int_field(o, "output_length", where), 1),
                      hash_ids=_hash_ids(o, where, required=False),
                      hash_block_tokens=BAILIAN_BLOCK, request_id=f"c{chat}",
                      session=f"c{roots[chat]}")


def read_burstgpt(path: Path) -> Iterator[Arrival]:
    with path.open(encoding="utf-8", errors="replace", newline="") as f:
        rows = csv.reader(f)
        header = [h.strip() for h in next(rows, [])]
        if header != BURSTGPT_HEADER:
            raise TraceError(f"{path} line 1 must be BurstGPT's header "
                             f"{','.join(BURSTGPT_HEADER)}.")
        for lineno, row in enumerate(rows, 2):
            if not row:
                continue
            where = f"{path} line {lineno}"
            if len(row) != len(BURSTGPT_HEADER):
                raise TraceError(f"{where} has {len(row)} fields; expected "
                                 f"{len(BURSTGPT_HEADER)}.")
            try:
                t, prompt, answer = float(row[0]), int(row[2]), int(row[3])
            except ValueError:
                raise TraceError(f"{where} has a Timestamp or token count that is not a "
                                 f"number: {row[:4]!r}.") from None
            if t < 0 or prompt < 1 or answer < 0:
                raise TraceError(f"{where} has Timestamp {t}, Request tokens {prompt}, "
                                 f"Response tokens {answer}; the time must be ≥ 0, the "
                                 "request ≥ 1 token and the response ≥ 0.")
            yield Arrival(t, prompt, max(answer, 1))


def read_aiperf(path: Path) -> Iterator[Arrival]:
    last: dict[str, float] = {}
    t_prev = 0.0
    for lineno, o in json_lines(path):
        where = f"{path} line {lineno}"
        session = str(o["session_id"]) if o.get("session_id") is not None else None
        if "timestamp" in o:
            t = num_field(o, "timestamp", where, required=True) / 1000.0
        elif "delay" in o:
            base = last.get(session, t_prev) if session is not None else t_prev
            t = base + num_field(o, "delay", where, required=True) / 1000.0
        else:
            t = last.get(session, t_prev) if session is not None else t_prev
        if session is not None:
            last[session] = t
        t_prev = t
        yield Arrival(t, int_field(o, "input_length", where, 1),
                      int_field(o, "output_length", where, 1),
                      hash_ids=_hash_ids(o, where, required=False),
                      hash_block_tokens=AIPERF_BLOCK, session=session)


TIMED_TRACE = {"chunk_hash_size": 16, "sec_multiplier": 1.0, "label_timestamp": "timestamp",
               "label_input_length": "input_length", "label_output_length": "output_length",
               "label_hash_ids": "hash_ids"}
"""vLLM's `timed_trace` dataset settings (`vllm bench serve --timed-trace-*`), its defaults."""


def timed_trace_options(text: str) -> dict:
    """`timed-trace[:key=value,...]` as `--format` takes it, keys as vLLM's flags without
    the `--timed-trace-` prefix; one sentence naming a wrong one."""
    options = dict(TIMED_TRACE)
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, _, value = item.partition("=")
        key = key.replace("-", "_")
        if key not in options or not value:
            raise TraceError(f"--format timed-trace takes {', '.join(TIMED_TRACE)} as "
                             f"key=value; got {item!r}.")
        if key == "chunk_hash_size":
            if not value.isdigit() or int(value) < 1:
                raise TraceError(f"timed-trace chunk_hash_size must be a whole number of "
                                 f"tokens above 0, got {value!r}.")
            options[key] = int(value)
        elif key == "sec_multiplier":
            try:
                options[key] = float(value)
            except ValueError:
                options[key] = -1.0
            if not options[key] > 0:
                raise TraceError(f"timed-trace sec_multiplier must be a number above 0, got "
                                 f"{value!r}.")
        else:
            options[key] = value
    return options


def read_timed_trace(path: Path, options: dict) -> Iterator[Arrival]:
    """vLLM's `timed_trace`: JSONL rows with a timestamp (times `sec_multiplier` gives
    seconds), input and output lengths and hash ids of `chunk_hash_size` tokens, under the
    field names the `label_*` options give (Mooncake's by default)."""
    o = options
    for lineno, row in json_lines(path):
        where = f"{path} line {lineno}"
        yield Arrival(num_field(row, o["label_timestamp"], where, required=True)
                      * o["sec_multiplier"],
                      int_field(row, o["label_input_length"], where, 1),
                      max(int_field(row, o["label_output_length"], where), 1),
                      hash_ids=_hash_ids({"hash_ids": row.get(o["label_hash_ids"])}, where,
                                         required=False),
                      hash_block_tokens=o["chunk_hash_size"])
