"""Acceptance statistics of speculative decoding, as vLLM counts them.

A *round* is one speculating request in one step: `k` draft tokens verified, `a` of them
accepted, `a + 1` tokens emitted (the accepted ones, then the target's own) unless a stop
ended the request earlier. Counted among the emitted tokens, so the live engine and a
replayed trace (which knows how many tokens each step emitted) count the same.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_POSITIONS = 16


@dataclass(frozen=True)
class SpeculationView:
    """What snapshots show of speculative decoding."""

    method: str
    num_speculative_tokens: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    emitted_tokens: int
    acceptance_rate: float
    mean_accepted_length: float
    per_position: tuple[float, ...]
    """Acceptance rate at each draft position reached (position 1 first)."""
    accepted_per_pos: tuple[int, ...]
    seconds_per_token: float
    """ΣT/ΣN over speculation rounds: each round's step time over the tokens it emitted."""
    draft_seconds: float = 0.0
    """Time a draft model spent drafting, in all (part of the steps' times)."""
    step_seconds: float = 0.0
    """Time of the steps it drafted in, in all (the draft's share is the ratio)."""
    draft_model: str = ""
    """The draft model's name ("" without one)."""


class SpecStats:
    """Drafts, draft tokens, accepted tokens and acceptance per draft position."""

    def __init__(self) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_emitted_tokens = 0
        self.accepted_per_pos = [0] * MAX_POSITIONS
        """How often the draft token at position i (0 first) was accepted."""
        self.drafts_per_pos = [0] * MAX_POSITIONS
        """How often a draft reached position i (had at least i + 1 tokens)."""
        self.round_seconds = 0.0
        self.draft_seconds = 0.0
        self.draft_step_seconds = 0.0

    def on_draft_step(self, draft_seconds: float, step_seconds: float) -> None:
        """A step in which a draft model ran for `draft_seconds` of its `step_seconds`."""
        self.draft_seconds += draft_seconds
        self.draft_step_seconds += step_seconds

    def on_round(self, num_draft: int, accepted: int, emitted: int, seconds: float) -> None:
        """One request's round: `seconds` is the step's time (every request in a step waits
        for all of it), counted once per round for ΣT/ΣN."""
        self.round_seconds += seconds
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += accepted
        self.num_emitted_tokens += emitted
        for i in range(num_draft):
            self.drafts_per_pos[i] += 1
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per round (accepted + the target's own): what one verify pass buys."""
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0

    def per_position(self) -> list[float]:
        """Acceptance rate at each draft position that was reached."""
        return [a / d for a, d in zip(self.accepted_per_pos, self.drafts_per_pos, strict=True)
                if d]

    def view(self, method: str, k: int, draft_model: str = "") -> SpeculationView:
        emitted = self.num_emitted_tokens
        return SpeculationView(
            method, k, self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
            emitted, self.acceptance_rate, self.mean_accepted_length,
            tuple(self.per_position()), tuple(self.accepted_per_pos),
            self.round_seconds / emitted if emitted else 0.0,
            self.draft_seconds, self.draft_step_seconds, draft_model)

    def to_json(self) -> dict:
        return {"drafts": self.num_drafts, "draft_tokens": self.num_draft_tokens,
                "accepted": self.num_accepted_tokens, "emitted": self.num_emitted_tokens,
                "accepted_per_pos": list(self.accepted_per_pos),
                "drafts_per_pos": list(self.drafts_per_pos), "seconds": self.round_seconds,
                "draft_seconds": self.draft_seconds,
                "draft_step_seconds": self.draft_step_seconds}

    def load(self, d: dict) -> None:
        self.num_drafts, self.num_draft_tokens = d["drafts"], d["draft_tokens"]
        self.num_accepted_tokens, self.num_emitted_tokens = d["accepted"], d["emitted"]
        self.accepted_per_pos = list(d["accepted_per_pos"])
        self.drafts_per_pos = list(d["drafts_per_pos"])
        self.round_seconds = d["seconds"]
        self.draft_seconds = d.get("draft_seconds", 0.0)
        self.draft_step_seconds = d.get("draft_step_seconds", 0.0)
