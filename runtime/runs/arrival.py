"""One request of an arrival trace (`Arrival`), and the checked field readers every trace
reader shares (`trace.py`, `trace_readers.py`, `stages.py`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvdeck.runtime.errors import TraceError
from kvdeck.runtime.runs.records import json_object
from kvdeck.runtime.text.checks import AnswerCheck


@dataclass(frozen=True)
class Arrival:
    """One request of an arrival trace."""

    arrival_s: float
    prompt_len: int
    output_len: int
    prompt_tokens: tuple[int, ...] | None = None
    hash_ids: tuple[int, ...] | None = None
    prefix_group: str | None = None
    prefix_len: int = 0
    deadline_s: float | None = None
    priority: int = 0
    request_id: str | None = None
    check: AnswerCheck | None = None
    """What the answer must satisfy to count as correct (None: no check)."""
    session: str | None = None
    """The conversation it is a turn of (multi-turn traces), for session affinity."""
    hash_block_tokens: int | None = None
    """Tokens per hash id, where the trace's format fixes it (Mooncake 512; a staged
    workload its own); None: the run's `hash_block_tokens`."""

    def to_json(self) -> dict:
        """This arrival as a kvdeck JSONL object (tokens included, so replays are exact)."""
        d: dict = {"arrival_s": self.arrival_s, "output_len": self.output_len}
        if self.request_id:
            d["id"] = self.request_id
        if self.prompt_tokens is not None:
            d["prompt_tokens"] = list(self.prompt_tokens)
        else:
            d["prompt_len"] = self.prompt_len
        if self.hash_ids is not None:
            d["hash_ids"] = list(self.hash_ids)
        if self.prefix_group is not None:
            d["prefix_group"], d["prefix_len"] = self.prefix_group, self.prefix_len
        if self.deadline_s is not None:
            d["deadline_s"] = self.deadline_s
        if self.priority:
            d["priority"] = self.priority
        if self.check is not None:
            d["check"] = self.check.to_json()
        if self.session is not None:
            d["session"] = self.session
        return d


def json_lines(path: Path) -> Iterator[tuple[int, dict]]:
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield lineno, json_object(line, f"{path} line {lineno}", TraceError)


def int_field(obj: dict, key: str, where: str, lo: int = 0, default: int | None = None) -> int:
    v = obj.get(key, default)
    if v is None:
        raise TraceError(f"{where} lacks {key!r}.")
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise TraceError(f"{where} has {key}={v!r}; it must be an integer ≥ {lo}.")
    return v


def num_field(obj: dict, key: str, where: str, default: float | None = None,
         required: bool = False) -> float | None:
    v = obj.get(key, default)
    if v is None:
        if required:
            raise TraceError(f"{where} lacks {key!r}.")
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise TraceError(f"{where} has {key}={v!r}; it must be a number ≥ 0.")
    return float(v)
