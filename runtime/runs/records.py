"""The run's record stream (`iterations.jsonl`): its format version, the record kinds and
`parse_record`, which refuses a kind it does not know with one sentence instead of skipping
it. The records themselves live with what produces them: step records
(`core/step_record.py`), checkpoints (`core/checkpoint.py`), KV events (`kv/events.py`),
inbox messages (`core/commands.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from kvdeck.runtime.core.checkpoint import Checkpoint
from kvdeck.runtime.core.step_record import StepRecord
from kvdeck.runtime.errors import KvdeckError, RunFormatError

RUN_FORMAT = 2
"""Version of the run-directory format; a run written in another version is refused."""


@dataclass(frozen=True)
class Truncated:
    """The recorder reached its size bound at this step and wrote nothing after it."""

    kind: ClassVar[str] = "truncated"
    step: int

    def to_json(self) -> dict:
        return {"kind": self.kind, "step": self.step}

    @classmethod
    def from_json(cls, d: dict, where: str) -> Truncated:
        return cls(d.get("step", 0))


RECORDS: dict[str, type] = {c.kind: c for c in (StepRecord, Checkpoint, Truncated)}
Record = StepRecord | Checkpoint | Truncated


def dumps(data: Any) -> str:
    """Compact, deterministic JSON (insertion-ordered keys, repr floats)."""
    return json.dumps(data, separators=(",", ":"), allow_nan=False)


def json_object(line: str, where: str, error: type[KvdeckError]) -> dict:
    """One line of a JSONL file as a dict; `error(sentence)` naming `where` if it is not."""
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise error(f"{where} is not valid JSON ({e.msg}).") from None
    if not isinstance(d, dict):
        raise error(f"{where} is not a JSON object.")
    return d


def parse_record(line: str, where: str) -> Record:
    """One line of `iterations.jsonl` as a typed record; a RunFormatError names `where` and
    the problem for bad JSON or an unknown kind."""
    d = json_object(line, where, RunFormatError)
    cls = RECORDS.get(d.get("kind"))
    if cls is None:
        raise RunFormatError(f"{where} has an unknown record kind {d.get('kind')!r}; this "
                             f"kvdeck reads {', '.join(RECORDS)} records.")
    return cls.from_json(d, where)
