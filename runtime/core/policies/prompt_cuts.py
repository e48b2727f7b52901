"""Where a prompt's prefill chunks end besides the budgets (`prompt_cuts`).

llama-server, on a model whose state it checkpoints (sliding-window layers, as Gemma 3's,
or recurrent ones), ends a prompt's batch `4 + n_ubatch` and 4 tokens before the prompt's
end (each offset at most `n_batch`), so that it can save the state there and restore it
when the slot's next prompt shares the prefix (its `server-context.cpp`, "process the last
few tokens of the prompt separately"; seen in its log at `-v`). Its prompts then advance
in pieces, and one sent while another runs catches up with it: measured on Gemma 3 270M
(2 cores, 8 slots), two 768-token prompts sent at once got their first tokens together
after 2.58 s, one alone after 1.32 s, and the second of two sent 300 ms apart 65 ms after
the first. `--prompt-cuts 516,4` makes kvdeck's scheduler cut the same way; the sim then
predicts those cases (`tests/unit/test_scheduler.py`).
"""

from __future__ import annotations


def cut_points(end: int, cuts: tuple[int, ...]) -> list[int]:
    """Where a prompt of `end` tokens is cut, ascending: `end - c` for each offset `c` of
    `cuts` (largest first) that falls inside it. llama-server checkpoints there."""
    return [end - c for c in cuts if c < end]


def cut_chunk(start: int, end: int, n: int, cuts: tuple[int, ...]) -> int:
    """A chunk of `n` tokens from `start` of a prompt ending at `end`, shortened to end at
    the first cut it would cross. With cuts 516 and 4, a lone 768-token prompt runs as 252,
    512 and 4 tokens."""
    return next((p - start for p in cut_points(end, cuts) if start < p < start + n), n)
