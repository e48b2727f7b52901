"""The n-gram proposer: guess the next tokens by looking the recent context up in itself.

Prompt lookup decoding: find the most recent earlier occurrence of the request's last `n`
tokens (trying `n = n_max` down to `n_min`) and propose the up to `k` tokens that followed
it. No model and no device memory; it pays off where outputs repeat their input — code
edits, quoting, extraction, and a model's own loops.
"""

from __future__ import annotations


def propose_ngram(tokens: list[int], k: int, n_max: int = 3, n_min: int = 1,
                  window: int = 4096) -> list[int]:
    """Up to `k` tokens that followed the latest earlier match of the last `n` tokens of
    `tokens`, longest `n` first; [] when nothing matches. Only the last `window` tokens are
    searched (a bounded cost per step)."""
    if k <= 0:
        return []
    start = max(len(tokens) - window, 0)
    ctx = tokens[start:]
    size = len(ctx)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        tail = ctx[size - n:]
        first = tail[0]
        # Latest occurrence first: the most recent context predicts best.
        for i in range(size - n - 1, -1, -1):
            if ctx[i] == first and ctx[i:i + n] == tail:
                follow = ctx[i + n:i + n + k]
                if follow:
                    return follow
    return []
