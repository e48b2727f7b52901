"""Comparing outputs that may differ at kernel ties (llama.cpp's batched rows, bf16 rows)."""

from __future__ import annotations

import gc

SPLITS = 8
"""The reference computes a position's logits with the last 1 to `SPLITS` tokens in a call
of their own, as a decode row or a verify chunk of that many rows would."""


def assert_equal_up_to_kernel_ties(path, prompts: dict[str, str], expected: dict,
                                   got: dict, tol: float = 0.05) -> None:
    """Outputs (request id → token ids) equal, or each request's first differing token a
    near-tie of the target's logits after the tokens both agree on. `prompts`: request id
    → prompt text. llama.cpp's kernels are not batch-invariant: a verify chunk's rows are
    computed with other row counts than a lone decode row, and a tie can break either way
    (see docs/llama_cpp.md); a wrong verify, rollback or draft stream would diverge at a
    clear winner. So the same position's logits are computed as one prefill and with the
    sequence split before each of its last `SPLITS` tokens (9 samples of how llama.cpp may
    split it, not every way a run did), and each of the two tokens must win, or come
    within `tol`, in one of them. On an AVX2-only EPYC those splits moved a logit by up to
    0.84 and flipped which of two tokens won; the prefill alone had kept such ties within
    0.05 on the AVX-512 machines. A wider `tol` is for what rounds elsewhere (torch's bf16)
    or for a caller's measured near-ties (a phone number's digits under a grammar). A
    grammar's mask leaves the allowed tokens' logits as they are, so the same test holds
    for constrained outputs."""
    from kvdeck.runtime.executors.llama_cpp_probe import open_llama
    from kvdeck.runtime.text.tokenizer import Tokenizer, quiet_stderr

    differing = [rid for rid in expected if got[rid] != expected[rid]]
    if not differing:
        return
    tok = Tokenizer(path)
    with quiet_stderr():
        llm = open_llama(path, n_ctx=512, n_threads=2, verbose=False, logits_all=True)
    for rid in differing:
        a, b = expected[rid], got[rid]
        i = next(j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        seq = tok.encode(prompts[rid]) + a[:i]
        rows = [last_row(llm, seq)] + [last_row(llm, seq[:-k], seq[-k:])
                                       for k in range(1, min(SPLITS, len(seq) - 1) + 1)]
        gaps = [float(row[a[i]] - row[b[i]]) for row in rows]  # plain's token over spec's
        # Each token wins, or comes within `tol`, in some split: a tie either way. One
        # side alone would pass a speculative token that clearly beats the plain one
        # (a grammar's mask skipped, say).
        assert min(gaps) < tol and max(gaps) > -tol, (rid, i, a[i], b[i], gaps)
    del llm
    gc.collect()


def last_row(llm, *pieces: list[int]):
    """The logits of the last token of `pieces`, evaluated from an empty context one piece
    per call."""
    import numpy as np

    llm.reset()
    for piece in pieces:
        llm.eval(piece)
    # A copy (float64): `scores` is the context's buffer, which the next evaluation reuses.
    return np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
