"""The calls `benchmarks.slot_prompts` prices a group of slots' prompts as: llama-server's
checkpoint cuts (516 and 4 tokens before a prompt's end) and micro-batches of neighbouring
slots, beside a decode row in slot 7 in every call."""

from __future__ import annotations

from benchmarks.slot_prompts import group_seconds
from kvdeck.runtime.planning.profiles import StepFit


def per(fixed: float = 0.0, token: float = 0.0, sample: float = 0.0) -> StepFit:
    return StepFit(fixed, token, 0.0, sample)


def test_one_prompt_runs_in_three_calls_of_two_passes() -> None:
    # 768 tokens: 252, then 512 (one micro-batch), then 4; the decode row a pass of its own.
    total, calls = group_seconds(per(fixed=1.0), 1, 768)
    assert calls == [2.0, 2.0, 2.0] and total == 6.0


def test_neighbouring_slots_share_micro_batches_of_equal_pieces() -> None:
    # Two 256-token prompts: 252 each in one micro-batch (2 × 252 ≤ 512), then 4 each.
    assert group_seconds(per(fixed=1.0), 2, 256)[1] == [2.0, 2.0]
    # Four 768-token prompts: 128 tokens each a micro-batch, so 252 take two and 512 four.
    assert group_seconds(per(fixed=1.0), 4, 768)[1] == [3.0, 5.0, 2.0]


def test_every_token_is_priced_once_and_each_prompt_sampled_at_its_end() -> None:
    total, calls = group_seconds(per(token=1.0), 6, 768)
    assert total == 6 * 768 + len(calls)  # the prompts' tokens and one decode row a call
    total, calls = group_seconds(per(sample=1.0), 6, 768)
    assert total == len(calls) + 6
