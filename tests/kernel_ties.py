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
    sequence split before each of its last `SPLITS` tokens, and the speculative output's
    token must come within `tol` of the plain output's in one of them. On an AVX2-only
    EPYC those splits move a logit by up to 0.84 and flipped which of two tokens won,
    where the AVX-512 machines' kernels stayed within 0.05. `tol` covers what rounds
    outside llama.cpp's kernels (torch's bf16), which these references cannot reproduce.
    A grammar's mask leaves the allowed tokens' logits as they are, so the same test holds
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
        gaps = [float(row[a[i]] - row[b[i]]) for row in rows]
        assert min(gaps) < tol, (rid, i, a[i], b[i], gaps)
    del llm
    gc.collect()


def last_row(llm, *pieces: list[int]):
    """The logits of the last token of `pieces`, evaluated from an empty context one piece
    per call."""
    import numpy as np

    llm.reset()
    for piece in pieces:
        llm.eval(piece)
    return np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
