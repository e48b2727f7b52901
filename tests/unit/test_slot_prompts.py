"""The calls `benchmarks.slot_prompts` prices a group of slots' prompts as: llama-server's
checkpoint cuts (516 and 4 tokens before a prompt's end) and micro-batches of neighbouring
slots, beside a decode row in slot 7 in every call."""

from __future__ import annotations

import pytest

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
    # Four 768-token prompts: 128 tokens each a micro-batch, so 252 take two; then the
    # batch of 2,048 holds the decode row and 512 + 512 + 512 + 511 (four micro-batches of
    # 128, one of 127, one of the three slots' last token), slot 3's last token before
    # its cut goes beside the others' last 4 (one token each, then 3), and its own 4 last.
    assert group_seconds(per(fixed=1.0), 4, 768)[1] == [3.0, 6.0, 3.0, 2.0]


def test_attention_is_priced_per_piece_over_its_own_history() -> None:
    # Two 256-token prompts, the decode row at 16 then 17 positions: pairs 17 + 2 × 252·253/2
    # in the first call, 18 + 2 × (4·252 + 4·5/2) in the second.
    assert group_seconds(StepFit(0.0, 0.0, 1.0), 2, 256)[0] == 17 + 2 * 31_878 + 18 + 2 * 1_018
    # Positions read: 17 + 2 × 252, then 18 + 2 × 256.
    assert group_seconds(StepFit(0.0, 0.0, 0.0, per_context_s=1.0), 2, 256)[0] == 1_051


def test_the_decode_row_keeps_its_slot() -> None:
    with pytest.raises(ValueError, match="slots must be 1 to 6, got 7"):
        group_seconds(per(fixed=1.0), 7, 256)


def test_every_token_is_priced_once_and_each_prompt_sampled_at_its_end() -> None:
    total, calls = group_seconds(per(token=1.0), 6, 768)
    assert total == 6 * 768 + len(calls)  # the prompts' tokens and one decode row a call
    total, calls = group_seconds(per(sample=1.0), 6, 768)
    assert total == len(calls) + 6
