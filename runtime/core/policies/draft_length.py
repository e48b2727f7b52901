"""The adaptive draft length (`draft_length = adaptive`): how many draft tokens a
speculating request verifies this step, from the measured step time and each request's
acceptance per draft position."""

from __future__ import annotations

from collections.abc import Callable

from kvdeck.runtime.core.config import Knobs
from kvdeck.runtime.core.request import Request
from kvdeck.runtime.core.step_data import Estimator, causal_pairs
from kvdeck.runtime.spec.stats import MAX_POSITIONS, SpecStats

DraftEstimator = Callable[[int], float]
"""(rows) -> predicted seconds of one draft-model pass over that many rows."""


class DraftLengths:
    """The rule and what it learns from: every request's acceptance per draft position, all
    requests' (`spec`), and the latest step's time and tokens."""

    def __init__(self, estimate: Estimator, spec: SpecStats):
        self.estimate = estimate
        self.spec = spec
        self.draft_estimate: DraftEstimator | None = None
        """A draft-model pass's predicted time (set by the engine when the executor has a
        draft model): the draft's share of the rule's ΔT."""
        self.acceptance: dict[str, tuple[list[int], list[int]]] = {}
        """Per speculating request: (accepted, tried) per draft position."""
        self.last_step = (0.0, 0)
        """(seconds, tokens emitted) of the latest step: T and N of the rule."""

    def draft(self, req: Request, knobs: Knobs, budget: int, room: int, num_decodes: int,
              propose: Callable[[Request, int], list[int]]) -> tuple[int, tuple[int, ...]]:
        """(draft positions, draft tokens) for a decoding request with `room` positions
        left before the model's length; (0, ()) when it should decode one token: it asked
        for logprobs (they come a token a step) or logit processors (penalties, a bias,
        min_p, min_tokens: each token's scores depend on the tokens before it, which a
        draft would have to replay), or has no room left for more. Under
        `speculative_method = draft` the tokens are left empty: the executor's draft model
        writes them in the step."""
        sp = req.sampling
        if sp.logprobs is not None or sp.processes_logits:
            return 0, ()
        k = min(knobs.num_speculative_tokens, sp.max_tokens - len(req.output_token_ids) - 1,
                room, budget - 1)
        if k <= 0:
            return 0, ()
        model = knobs.speculative_method == "draft"
        draft = () if model else tuple(propose(req, k)[:k])
        most = k if model else len(draft)
        # Adaptive lengths follow measured step times; a seeded request promises the same
        # output every run, so it keeps the fixed length (its draws depend on it).
        if most and knobs.draft_length == "adaptive" and sp.seed is None:
            most = self.length(req, most, num_decodes if model else 0)
        return most, draft[:most]

    def length(self, req: Request, most: int, num_drafting: int = 0) -> int:
        """How many draft tokens `req` should verify this step, at most `most`: lengthen
        while `ΔT/ΔN < T/N` — ΔT the time one more verify row adds to a step (the timing
        model at the request's context), ΔN the chance that row's token is kept (the
        product of the request's acceptance rates up to it, smoothed toward a prior:
        `(accepted + 2·prior)/(tried + 2)` per position, the prior being all requests'
        rate at that position, or where none was tried the rate at the one before), and T/N
        the latest step's time per token emitted.
        With a draft model (`num_drafting` requests drafting this step) ΔT also holds the
        draft's share of one more sequential draft pass: `pass(m)/m` over those requests.
        A request whose drafts keep failing early gets shorter drafts, or none."""
        seconds, tokens = self.last_step
        if not tokens:
            return most  # nothing measured yet
        ctx = req.num_tokens
        row = self.estimate(1, causal_pairs(1, ctx), ctx) - self.estimate(0, 0, 0)
        if num_drafting and self.draft_estimate is not None:
            row += self.draft_estimate(num_drafting) / num_drafting
        per_token = seconds / tokens
        accepted, tried = self.acceptance.get(req.request_id, ((), ()))
        spec = self.spec
        keep, prior = 1.0, 0.5
        for i in range(most):
            # The prior for position i: every request's rate there, else the rate at i − 1.
            # (A fixed 1/2 for untried positions never lets a short draft grow: a position
            # that is never drafted is never tried.)
            if spec.drafts_per_pos[i]:
                prior = (spec.accepted_per_pos[i] + 1) / (spec.drafts_per_pos[i] + 2)
            a, t = (accepted[i], tried[i]) if i < len(tried) else (0, 0)
            rate = (a + 2 * prior) / (t + 2)
            keep *= rate
            prior = rate
            if row / keep >= per_token:
                return i
        return most

    def on_verified(self, request_id: str, num_draft: int, accepted: int) -> None:
        """A speculating request's draft of `num_draft` tokens kept `accepted` of them."""
        acc, tried = self.acceptance.setdefault(request_id, ([0] * MAX_POSITIONS,
                                                             [0] * MAX_POSITIONS))
        for i in range(min(accepted + 1, num_draft)):  # positions actually judged
            tried[i] += 1
            acc[i] += i < accepted

    def forget(self, request_id: str) -> None:
        self.acceptance.pop(request_id, None)
