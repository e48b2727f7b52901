"""Verifying a draft against the target model: which proposed tokens to keep, lossless.

A speculating request's step scores its last token and `k` draft tokens in one pass, giving
the target's distribution `p_i` at each of the `k + 1` positions. The emitted tokens are:

- **greedy** (temperature 0): the longest prefix of the draft equal to the target's argmax at
  each position, then the target's own argmax at the first mismatch — or, when every draft
  token matched, at position `k` (the bonus token). Token for token what plain greedy
  decoding would have produced from the same logits (logits computed in a chunk of other
  shape can differ in the last bits, so a near-tie may break the other way, as it can
  between batch compositions without speculation).
- **sampling**: draft token `x_i` (drawn from the proposer's `q_i`) is accepted with
  probability `min(1, p_i(x_i)/q_i(x_i))`; at the first rejection the token is drawn from the
  normalized positive part `(p_i − q_i)⁺` and verification stops; when all are accepted a
  bonus token is drawn from `p_k`. Each emitted token is then distributed exactly as `p`
  (speculative sampling; Leviathan et al. 2023, Chen et al. 2023). A proposer without a
  distribution (n-gram lookup) proposes deterministically: `q_i` is a point mass on `x_i`.

Random draws come from the generator the caller passes (seeded per request and position),
so a seeded request is reproducible.
"""

from __future__ import annotations

import torch

from kvdeck.runtime.core.request import Request
from kvdeck.runtime.text.guided import apply_mask
from kvdeck.runtime.text.sampling import draw, request_generator, sampling_probs


def verify_greedy(target_argmax: list[int], draft: list[int]) -> tuple[list[int], int]:
    """(tokens to emit, draft tokens accepted) for greedy decoding; `target_argmax` has one
    entry per scored position (`len(draft) + 1`)."""
    out: list[int] = []
    for i, x in enumerate(draft):
        best = target_argmax[i]
        out.append(best)
        if best != x:
            return out, i
    out.append(target_argmax[len(draft)])
    return out, len(draft)


def verify_sampled(p: torch.Tensor, draft: list[int], q: torch.Tensor | None,
                   generator: torch.Generator) -> tuple[list[int], int]:
    """(tokens to emit, draft tokens accepted) for sampling.

    `p`: the target's probabilities `[k + 1, vocab]` (after temperature, top-k, top-p);
    `q`: the proposer's `[k, vocab]`, or None for a deterministic proposer (point masses).
    """
    out: list[int] = []
    for i, x in enumerate(draft):
        px = float(p[i, x])
        qx = float(q[i, x]) if q is not None else 1.0
        u = float(torch.rand((), generator=generator))
        if qx > 0 and u < min(1.0, px / qx):
            out.append(x)
            continue
        residual = p[i] - (q[i] if q is not None else _point(p[i], x))
        residual = residual.clamp_min(0)
        total = float(residual.sum())
        # (p − q)⁺ sums to 0 only where p = q, and then rejection has probability 0.
        dist = residual / total if total > 0 else p[i]
        out.append(draw(dist, generator))
        return out, i
    out.append(draw(p[len(draft)], generator))
    return out, len(draft)


def _point(row: torch.Tensor, x: int) -> torch.Tensor:
    q = torch.zeros_like(row)
    q[x] = 1.0
    return q


def sample_draft(logits: torch.Tensor, req: Request, draft: list[int], base_seed: int = 0,
                 q: torch.Tensor | None = None, allowed: torch.Tensor | None = None
                 ) -> list[int]:
    """The tokens a speculating request emits: `logits` [1 + len(draft), vocab] score its
    last token and each draft token; a sampling request keeps draft tokens by speculative
    sampling under its temperature, top-k and top-p (`verify_sampled`), drawing from
    its own generator, so a seeded request stays reproducible. `q` [len(draft), vocab]: the
    draft model's distributions the draft was drawn from (None: a deterministic proposer).
    Greedy requests are verified by the caller from the same argmax plain decoding uses.
    `allowed` [1 + len(draft), vocab]: a guided request's grammar masks per position
    (`guided.Guide.draft_allowed`); a draft token the grammar refuses has probability 0 and
    is rejected, so the result follows the constrained distribution exactly."""
    sp = req.sampling
    logits = logits.float().cpu()
    if allowed is not None:
        logits = apply_mask(logits, allowed)
    p = torch.stack([sampling_probs(row, sp) for row in logits])
    tokens, _ = verify_sampled(p, draft, q, request_generator(req, base_seed))
    return tokens
