"""Choosing tokens from logits: greedy, temperature, top-k, top-p, per-request seeds, and
optional logprobs. One implementation shared by every executor that returns logits.

Reproducibility: a request with a seed draws its n-th token from a generator seeded with
(seed, n), so its output does not depend on what else is in the batch or on preemption.
Requests without a seed are seeded from the executor's seed and the request id — also
deterministic, but different per request.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from runtime.request import Request


@dataclass(frozen=True)
class TokenLogprobs:
    """The sampled token's log-probability and the most likely alternatives."""

    logprob: float
    top: tuple[tuple[int, float], ...]


def request_generator(req: Request, base_seed: int, salt: int = 0) -> torch.Generator:
    """The generator a request's draws come from at its current position: seeded from its
    seed (or `base_seed` and its id), its output length and `salt` (a draft model's draws
    use their own)."""
    seed = req.sampling.seed if req.sampling.seed is not None \
        else base_seed ^ zlib.crc32(req.request_id.encode())
    g = torch.Generator()
    g.manual_seed(((seed ^ salt) * 1_000_003 + req.num_output_tokens) & ((1 << 63) - 1))
    return g


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float
                  ) -> torch.Tensor:
    """Temperature-scaled logits with everything outside top-k / top-p set to -inf."""
    x = logits / temperature
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
    return x


def sampling_probs(logits: torch.Tensor, sp) -> torch.Tensor:
    """The distribution a sampling request draws from: softmax of its filtered logits."""
    return torch.softmax(filter_logits(logits, sp.temperature, sp.top_k, sp.top_p), dim=-1)


def sample(logits: torch.Tensor, requests: list[Request], base_seed: int = 0
           ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """One token per row of `logits` [N, vocab] (float32) for the matching request."""
    logits = logits.float().cpu()
    greedy = logits.argmax(dim=-1).tolist()
    tokens: list[int] = []
    logprobs: list[TokenLogprobs | None] = []
    for row, req in enumerate(requests):
        sp = req.sampling
        if sp.temperature == 0.0:
            token = greedy[row]
        else:
            probs = sampling_probs(logits[row], sp)
            token = int(torch.multinomial(probs, 1, generator=request_generator(req, base_seed)))
        tokens.append(token)
        if sp.logprobs is None:
            logprobs.append(None)
            continue
        lp = torch.log_softmax(logits[row], dim=-1)
        alts: tuple[tuple[int, float], ...] = ()
        if sp.logprobs:
            top = torch.topk(lp, sp.logprobs)
            alts = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        logprobs.append(TokenLogprobs(float(lp[token]), alts))
    return tokens, logprobs


def sample_draft(logits: torch.Tensor, req: Request, draft: list[int], base_seed: int = 0,
                 q: torch.Tensor | None = None) -> list[int]:
    """The tokens a speculating request emits: `logits` [1 + len(draft), vocab] score its
    last token and each draft token; a sampling request keeps draft tokens by speculative
    sampling under its temperature, top-k and top-p (`runtime/spec/verify.py`), drawing from
    its own generator, so a seeded request stays reproducible. `q` [len(draft), vocab]: the
    draft model's distributions the draft was drawn from (None: a deterministic proposer).
    Greedy requests are verified by the caller from the same argmax plain decoding uses."""
    from runtime.spec.verify import verify_sampled

    sp = req.sampling
    logits = logits.float().cpu()
    p = torch.stack([sampling_probs(row, sp) for row in logits])
    tokens, _ = verify_sampled(p, draft, q, request_generator(req, base_seed))
    return tokens
