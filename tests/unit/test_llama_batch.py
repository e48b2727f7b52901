"""How the llama_cpp executor lays out one step's rows for llama.cpp: one batch in slot
order, because with a KV stream per slot llama.cpp cuts a batch into micro-batches of
consecutive, increasing sequence ids (`runtime/executors/llama_cpp_context.py`)."""

from __future__ import annotations

from kvdeck.runtime.executors.llama_cpp_context import one_batch
from kvdeck.runtime.executors.server_slots import micro_batches


def first_micro_batch(rows: list[tuple[int, int, int, int]]) -> list[int]:
    """The slots of the first micro-batch llama.cpp's sequential equal split makes of
    `rows` (one per token: its slot third), as `server_slots.micro_batches` cuts them."""
    pieces: list[tuple[int, int]] = []
    for r in rows:
        if pieces and pieces[-1][0] == r[2]:
            pieces[-1] = (r[2], pieces[-1][1] + 1)
        else:
            pieces.append((r[2], 1))
    return [pieces[i][0] for i, _, _ in micro_batches(pieces)[0]]


def test_decode_rows_of_eight_slots_share_one_micro_batch_in_slot_order() -> None:
    decodes = [[(7, 40 + s, s, s)] for s in (3, 0, 5, 1, 7, 2, 6, 4)]  # the scheduler's order
    assert first_micro_batch([g[0] for g in decodes]) == [3, 4]  # then 0–2, 5–6 and 7
    (batch,) = one_batch(decodes)
    assert [r[2] for r in batch] == list(range(8))
    assert first_micro_batch(batch) == list(range(8))


def test_a_prefill_chunk_keeps_its_positions_in_order_beside_decode_rows() -> None:
    prefill = [(9, p, 2, 0 if p == 19 else -1) for p in range(10, 20)]
    decodes = [[(7, 50, s, 1 + s)] for s in (1, 0, 3)]
    (batch,) = one_batch([*decodes, prefill])
    assert [(r[2], r[1]) for r in batch] == [(0, 50), (1, 50), *((2, p) for p in range(10, 20)),
                                            (3, 50)]
    assert sorted(batch) == sorted([*prefill, *(g[0] for g in decodes)])
    assert first_micro_batch(batch) == [0, 1, 2, 3]
    assert one_batch([]) == []
