"""Comparing outputs that may differ at kernel ties (llama.cpp's batched rows, bf16 rows)."""

from __future__ import annotations

import gc


def assert_equal_up_to_kernel_ties(path, prompts: dict[str, str], expected: dict,
                                   got: dict, tol: float = 0.05) -> None:
    """Outputs (request id → token ids) equal, or each request's first differing token a
    near-tie of the target's logits (within `tol`) after the tokens both agree on.
    `prompts`: request id → prompt text. llama.cpp's kernels are not batch-invariant: a
    verify chunk's rows are computed with other row counts than a lone decode row, and a
    tie can break either way (see docs/llama_cpp.md); a wrong verify, rollback or draft
    stream would diverge at a clear winner. A grammar's mask leaves the allowed tokens'
    logits as they are, so the same test holds for constrained outputs."""
    import numpy as np

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
        llm.reset()
        llm.eval(seq)
        row = np.asarray(llm.scores[len(seq) - 1])
        assert abs(row[a[i]] - row[b[i]]) < tol, (rid, i, row[a[i]], row[b[i]])
    del llm
    gc.collect()
