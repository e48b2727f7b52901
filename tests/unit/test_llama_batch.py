"""How the llama_cpp executor lays out one step's rows for llama.cpp: one batch in slot
order, because with a KV stream per slot llama.cpp cuts a batch into micro-batches of
consecutive, increasing sequence ids (`runtime/executors/llama_cpp_context.py`)."""

from __future__ import annotations

from kvdeck.runtime.executors.llama_cpp_context import one_batch


def micro_batches(rows: list[tuple[int, int, int, int]]) -> list[list[int]]:
    """The slots of each micro-batch llama.cpp's sequential equal split makes of `rows`:
    it takes the next unused token of each slot whose id follows the previous one's, one
    token per slot while every slot in the set has tokens left."""
    left = [list(r) for r in rows]
    out = []
    while left:
        slots: list[int] = []
        for r in left:
            if r[2] not in slots and (not slots or r[2] == slots[-1] + 1):
                slots.append(r[2])
        out.append(slots)
        for s in slots:
            left.remove(next(r for r in left if r[2] == s))
    return out


def test_decode_rows_of_eight_slots_share_one_micro_batch_in_slot_order() -> None:
    decodes = [[(7, 40 + s, s, s)] for s in (3, 0, 5, 1, 7, 2, 6, 4)]  # the scheduler's order
    assert len(micro_batches([g[0] for g in decodes])) > 1
    (batch,) = one_batch(decodes)
    assert [r[2] for r in batch] == list(range(8))
    assert micro_batches(batch)[0] == list(range(8))


def test_a_prefill_chunk_keeps_its_positions_in_order_beside_decode_rows() -> None:
    prefill = [(9, p, 2, 0 if p == 19 else -1) for p in range(10, 20)]
    decodes = [[(7, 50, s, 1 + s)] for s in (1, 0, 3)]
    (batch,) = one_batch([*decodes, prefill])
    assert [(r[2], r[1]) for r in batch] == [(0, 50), (1, 50), *((2, p) for p in range(10, 20)),
                                            (3, 50)]
    assert sorted(batch) == sorted([*prefill, *(g[0] for g in decodes)])
    assert micro_batches(batch)[0] == [0, 1, 2, 3]
    assert one_batch([]) == []
