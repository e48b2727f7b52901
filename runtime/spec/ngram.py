"""The n-gram proposer: guess the next tokens by looking the recent context up in itself.

Prompt lookup decoding: find the most recent earlier occurrence of the request's last `n`
tokens (trying `n = n_max` down to `n_min`) and propose the up to `k` tokens that followed
it. No model and no device memory; it pays off where outputs repeat their input — code
edits, quoting, extraction, and a model's own loops.

The search runs once per speculating request per step, so it is done at C speed: the
window's token ids as 4-byte words, searched backwards with `bytes.rfind` (a hit not on a
word boundary is skipped).
"""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: list[int], k: int, n_max: int = 3, n_min: int = 1,
                  window: int = 4096) -> list[int]:
    """Up to `k` tokens that followed the latest earlier match of the last `n` tokens of
    `tokens`, longest `n` first; [] when nothing matches. Only the last `window` tokens are
    searched (a bounded cost per step)."""
    ctx = tokens[-window:]
    size = len(ctx)
    if k <= 0 or size < 2:
        return []
    words = np.asarray(ctx, dtype=np.uint32).tobytes()
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        needle = words[4 * (size - n):]
        # A match at token i must end before the last token: 4i + 4n <= 4(size - 1).
        end = 4 * (size - 1)
        while (pos := words.rfind(needle, 0, end)) >= 0:
            if pos % 4 == 0:
                i = pos // 4
                return ctx[i + n:i + n + k]
            end = pos + len(needle) - 1  # a hit across word boundaries: look further back
    return []


def propose_for(req, k: int, knobs, window: int = 4096) -> list[int]:
    """`propose_ngram` over a request's latest `window` tokens with the knobs'
    `prompt_lookup_max`: the real executors' `propose`."""
    n = req.num_tokens
    return propose_ngram(req.token_slice(max(n - window, 0), n), k, knobs.prompt_lookup_max,
                         window=window)
