"""From a step's logits to its tokens: one stage for every executor that computes logits.

Sampling (with the extra branches of parallel sampling and logprobs), verifying drafted
tokens by the lossless rule, and scoring prompt positions are the same arithmetic whoever
computed the logits. The executors lay their rows out differently (torch holds hidden
states and turns only the rows it needs into logits; llama.cpp hands back logits) and give
this stage the rows each step needs; the stage fills what `StepResult` carries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvdeck.runtime.core.step_data import ScheduledChunk
from kvdeck.runtime.spec.verify import sample_draft, verify_greedy
from kvdeck.runtime.text.guided import apply_mask
from kvdeck.runtime.text.sampling import TokenLogprobs, sample, sample_branches, score_tokens


def masked_argmax(logits: torch.Tensor, allowed: torch.Tensor | None) -> list[int]:
    """The greedy token of each row, among the tokens a grammar allows where it has one."""
    if allowed is not None:
        logits = apply_mask(logits.float(), allowed)
    return logits.argmax(-1).tolist()


@dataclass
class LogitsStage:
    """Turns rows into a step's sampled, verified and scored tokens.

    `logits(rows)`: the rows' logits (rows are logits already for an executor that
    returns them; torch passes hidden states and its output head). `argmax(rows,
    allowed)`: greedy tokens of rows under an optional grammar mask (torch's uses its int8
    shortlist, rescored in float). Seeds and end-of-sequence ids make draws reproducible
    and `min_tokens` hold (`text/sampling.py`)."""

    seed: int
    eos_token_ids: tuple[int, ...]
    logits: Callable[[torch.Tensor], torch.Tensor] = lambda rows: rows
    argmax: Callable[[torch.Tensor, torch.Tensor | None], list[int]] = masked_argmax
    score_rows: int = 64
    """Prompt rows turned into logits at a time: a row's logits are a vocabulary of floats
    (1 MiB on Gemma 3), so a long chunk is scored in slices."""
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    spec: dict[str, list[int]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)

    def sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk],
               masks: dict[str, torch.Tensor]) -> None:
        """A token for each chunk (row i of `logits` is chunk i's) and for each of its
        branches, with logprobs where asked."""
        tokens, lps = sample(logits, [c.request for c in chunks], self.seed,
                             self.eos_token_ids, masks)
        for c, tok, lp in zip(chunks, tokens, lps, strict=True):
            self.sampled[c.request_id] = tok
            if lp is not None:
                self.logprobs[c.request_id] = lp
        more, more_lps = sample_branches(logits, chunks, self.seed, self.eos_token_ids, masks)
        self.sampled.update(more)
        self.logprobs.update(more_lps)

    def take_greedy(self, chunks: list[ScheduledChunk], tokens: list[int]) -> None:
        """Greedy tokens found without logits (each chunk's branches draw the same)."""
        for c, tok in zip(chunks, tokens, strict=True):
            self.sampled[c.request_id] = tok
            self.sampled.update((b.request_id, tok) for b in c.branches)

    def verify(self, chunk: ScheduledChunk, rows: torch.Tensor, q: torch.Tensor | None,
               allowed: torch.Tensor | None) -> None:
        """The tokens a speculating chunk emits from its `1 + k` rows: greedy keeps the
        draft up to the first token the target's argmax disagrees with, exactly as plain
        decoding would choose; sampling keeps it by the lossless rule (`q`: the draft
        model's distributions, None for n-gram drafts)."""
        req, draft = chunk.request, list(chunk.draft)
        if req.sampling.temperature == 0.0:
            self.spec[req.request_id] = verify_greedy(self.argmax(rows, allowed), draft)[0]
        else:
            self.spec[req.request_id] = sample_draft(self.logits(rows), req, draft, self.seed,
                                                     q, allowed)

    def score(self, chunk: ScheduledChunk, rows: torch.Tensor) -> None:
        """Prompt logprobs of the chunk's scored positions (`prompt_scored`): row i, the
        logits at position `scored.start + i`, scores the prompt token after it."""
        scored, req = chunk.prompt_scored, chunk.request
        out: list[TokenLogprobs] = []
        for a in range(0, len(scored), self.score_rows):
            b = min(a + self.score_rows, len(scored))
            first = scored.start + a + 1
            out.extend(score_tokens(self.logits(rows[a:b]),
                                    req.prompt_token_ids[first:first + b - a],
                                    req.sampling.prompt_logprobs))
        self.prompt_logprobs[chunk.request_id] = out
