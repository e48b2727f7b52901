"""Speculative verification is lossless: emitted tokens are distributed exactly as the
target's, which a chi-square test over 20,000 draws cannot tell apart — and it does tell a
deliberately broken acceptance rule apart. Greedy verification emits what greedy decoding
would. The n-gram proposer proposes what followed the latest match."""

from __future__ import annotations

import torch

from kvdeck.runtime.spec.ngram import propose_ngram
from kvdeck.runtime.spec.verify import verify_greedy, verify_sampled

P = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
Q = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])  # a poor draft: mostly wrong
K = 3
DRAWS = 20_000
# Chi-square critical value, 5 degrees of freedom, significance 0.001.
CRITICAL = 20.515


def chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def emitted(verify, q: torch.Tensor | None, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the first emitted token over all rounds, and of the second over the rounds
    that emitted at least two, with drafts drawn from `q` (None: always token 4)."""
    g = torch.Generator().manual_seed(seed)
    p = P.expand(K + 1, -1)
    qs = q.expand(K, -1) if q is not None else None
    first, second = torch.zeros(6), torch.zeros(6)
    for _ in range(DRAWS):
        draft = torch.multinomial(q, K, replacement=True, generator=g).tolist() \
            if q is not None else [4] * K
        tokens, _ = verify(p, draft, qs, g)
        first[tokens[0]] += 1
        if len(tokens) > 1:
            second[tokens[1]] += 1
    return first, second


def test_sampled_verification_reproduces_the_target_distribution() -> None:
    for q in (Q, None):  # a draft model's distribution, and a deterministic proposer
        first, second = emitted(verify_sampled, q)
        assert chi_square(first, P) < CRITICAL
        assert second.sum() > 1000 and chi_square(second, P) < CRITICAL


def broken(p, draft, q, g):
    """Accepts by the right rule but, on rejection, samples from the target instead of the
    residual (p − q)⁺ — a classic mistake that over-weights the draft's tokens."""
    out = []
    for i, x in enumerate(draft):
        if float(torch.rand((), generator=g)) < min(1.0, float(p[i, x] / q[i, x])):
            out.append(x)
            continue
        out.append(int(torch.multinomial(p[i], 1, generator=g)))
        return out, i
    out.append(int(torch.multinomial(p[-1], 1, generator=g)))
    return out, len(draft)


def test_a_broken_acceptance_rule_is_detected() -> None:
    first, _ = emitted(broken, Q)
    assert chi_square(first, P) > 10 * CRITICAL


def test_a_draft_equal_to_the_target_is_always_accepted() -> None:
    g = torch.Generator().manual_seed(1)
    p = P.expand(K + 1, -1)
    accepted = [verify_sampled(p, torch.multinomial(P, K, True, generator=g).tolist(),
                               P.expand(K, -1), g)[1] for _ in range(200)]
    assert accepted == [K] * 200  # p/q = 1 everywhere: every draft token kept, plus a bonus


def test_greedy_keeps_the_matching_prefix_and_the_targets_token() -> None:
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == ([5, 6, 7, 8], 3)  # all + bonus
    assert verify_greedy([5, 6, 7, 8], [5, 9, 7]) == ([5, 6], 1)  # the target's 6 replaces 9
    assert verify_greedy([5, 6], [4]) == ([5], 0)


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 1, 2, 3]
    assert propose_ngram(tokens, 2, n_max=3) == [5, 6]  # latest "1 2 3" was followed by 5 6
    assert propose_ngram([1, 2, 3, 4], 3) == []  # nothing repeats
    assert propose_ngram([7, 8, 7], 4, n_max=2) == [8, 7]  # falls back to a 1-gram
    assert propose_ngram(tokens, 0) == []


def test_adaptive_draft_length_follows_the_marginal_cost_rule() -> None:
    """ΔT/ΔN < T/N with hand-worked numbers: a step of 10 ms that emitted 10 tokens (1 ms a
    token); a verify row costs 0.2 ms (the fitted model's per-token time)."""
    from kvdeck.runtime.core.config import EngineConfig, Knobs
    from kvdeck.runtime.core.request import Request, SamplingParams
    from kvdeck.runtime.core.scheduler import Scheduler
    from kvdeck.runtime.kv.manager import BlockManager

    def estimate(new: int, pairs: int, ctx: int) -> float:
        return 0.005 + 0.0002 * new

    s = Scheduler(EngineConfig(knobs=Knobs(speculative_method="ngram")), BlockManager(8, 4),
                  estimate, 1024)
    s.drafts.last_step = (0.010, 10)
    req = Request("r", [1, 2, 3], SamplingParams())
    # Unmeasured: each position is kept with (0 + 2·½)/(0 + 2) = 1/2, so ΔN = 1/2, 1/4, 1/8,
    # 1/16 and ΔT/ΔN = 0.4, 0.8, 1.6, 3.2 ms: lengthen while below 1 ms — two tokens.
    assert s.drafts.length(req, 6) == 2
    # A request whose first draft token failed 8 times in 8: ΔN = (0 + 2·½)/10 = 1/10,
    # ΔT/ΔN = 2 ms: none.
    s.drafts.acceptance["r"] = ([0] * 16, [8] + [0] * 15)
    assert s.drafts.length(req, 6) == 0
    # 9 of 10 at position 1 and nothing tried past it: untried positions take the rate
    # before them, (9 + 1)/(10 + 2) = 5/6, so ΔN = (5/6)^i and ΔT/ΔN = 0.24 … 0.60 ms:
    # all six (a fixed ½ for them would stop at three, and never learn more).
    s.drafts.acceptance["r"] = ([9] + [0] * 15, [10] + [0] * 15)
    assert s.drafts.length(req, 6) == 6
    # Other requests' drafts failed 20 times in 20 at position 2: the prior there is
    # 1/22, its rate 2·(1/22)/2 ≈ 0.045, ΔT/ΔN ≈ 5.3 ms: one token.
    s.spec.drafts_per_pos[1] = 20
    assert s.drafts.length(req, 6) == 1
    s.spec.drafts_per_pos[1] = 0
    # One that keeps succeeding at every position: 40/40 → ΔN ≈ 0.98^i, always worth it.
    s.drafts.acceptance["r"] = ([40] * 16, [40] * 16)
    assert s.drafts.length(req, 6) == 6
    # A slower step (40 ms for 10 tokens, 4 ms a token) makes longer drafts worth it.
    s.drafts.last_step = (0.040, 10)
    s.drafts.acceptance.clear()
    assert s.drafts.length(req, 6) == 4


def test_ngram_search_agrees_with_a_plain_scan() -> None:
    """The byte search (C speed) against the obvious loop, on random contexts where hits
    across 4-byte word boundaries occur (small and large token ids)."""
    import random

    def scan(tokens: list[int], k: int, n_max: int) -> list[int]:
        for n in range(min(n_max, len(tokens) - 1), 0, -1):
            tail = tokens[len(tokens) - n:]
            for i in range(len(tokens) - n - 1, -1, -1):
                if tokens[i:i + n] == tail:
                    return tokens[i + n:i + n + k]
        return []

    rng = random.Random(0)
    for _ in range(2000):
        vocab = rng.choice((2, 3, 5, 300, 70_000, 262_144))
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        k, n = rng.randrange(1, 5), rng.randrange(1, 4)
        assert propose_ngram(tokens, k, n) == scan(tokens, k, n), (tokens, k, n)
