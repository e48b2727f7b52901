"""Inbox messages: the commands the engine loop takes between iterations (add, abort, knobs,
pause, resume, step, watch, priority, recording), each with its JSON form."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AddRequest:
    """Queue a validated request (its arrival may lie in the future)."""

    request: Any
    """A `request.Request`."""

    def to_json(self) -> dict:
        r = self.request
        return {"kind": "add", "request_id": r.request_id, "arrival_time": r.arrival_time,
                "prompt_tokens": r.num_prompt_tokens, "max_tokens": r.sampling.max_tokens}


@dataclass(frozen=True)
class Abort:
    request_id: str
    reason: str

    def to_json(self) -> dict:
        return {"kind": "abort", "request_id": self.request_id, "reason": self.reason}


@dataclass(frozen=True)
class SetKnobs:
    """Knobs to apply from the next iteration (already validated), and what changed."""

    knobs: Any
    """A `config.Knobs`."""
    changes: dict[str, Any]

    def to_json(self) -> dict:
        return {"kind": "knobs", "changes": self.changes}


@dataclass(frozen=True)
class Pause:
    def to_json(self) -> dict:
        return {"kind": "pause"}


@dataclass(frozen=True)
class Resume:
    def to_json(self) -> dict:
        return {"kind": "resume"}


@dataclass(frozen=True)
class Watch:
    """Put this request's timeline in every snapshot (None: stop)."""

    request_id: str | None

    def to_json(self) -> dict:
        return {"kind": "watch", "request_id": self.request_id}


@dataclass(frozen=True)
class SetPriority:
    """Change a queued or running request's priority (lower runs first)."""

    request_id: str
    priority: int

    def to_json(self) -> dict:
        return {"kind": "priority", "request_id": self.request_id, "priority": self.priority}


@dataclass(frozen=True)
class StepOnce:
    """While paused, run this many iterations."""

    count: int = 1

    def to_json(self) -> dict:
        return {"kind": "step", "count": self.count}


@dataclass(frozen=True)
class StartRecording:
    """Attach a recorder at the next iteration boundary; it starts with a checkpoint."""

    recorder: Any
    """A `recording.Recorder`."""

    def to_json(self) -> dict:
        return {"kind": "record", "run_dir": str(self.recorder.run_dir)}


@dataclass(frozen=True)
class StopRecording:
    def to_json(self) -> dict:
        return {"kind": "stop-recording"}


@dataclass(frozen=True)
class ResetPrefixCache:
    """Drop every cached block no request holds (vLLM's `POST /reset_prefix_cache`)."""

    def to_json(self) -> dict:
        return {"kind": "reset_prefix_cache"}


InboxMessage = AddRequest | Abort | SetKnobs | Pause | Resume | StepOnce | StartRecording \
    | StopRecording | Watch | SetPriority | ResetPrefixCache
