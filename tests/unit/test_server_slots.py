"""llama-server's slots in the sim (`executors/server_slots.py`): which slot a request
takes, and a step priced as a pass per micro-batch llama.cpp cuts its batch into — decode
rows of neighbouring slots together, a prompt beside decode rows after theirs."""

from __future__ import annotations

import pytest

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import Request, SamplingParams
from kvdeck.runtime.core.step_data import ScheduledChunk
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.server_slots import ServerSlots, micro_batches, pass_seconds
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor


def request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4))


def test_slots_are_taken_by_shared_prefix_else_least_recently_used() -> None:
    slots = ServerSlots(4)
    # Never used: llama-server's least-recently-used loop keeps the last of equals.
    assert slots.slot(request("a", list(range(100)))) == 3
    assert slots.slot(request("b", list(range(500, 600)))) == 2
    assert slots.slot(request("a", [1])) == 3  # a request keeps its slot
    slots.release("a")
    # Sharing 20 of 100 tokens with slot 3's last prompt (over a tenth): that slot.
    assert slots.slot(request("c", list(range(20)) + [9_999] * 80)) == 3
    slots.release("b")
    # Sharing 5 of 100 with slot 2's (not over a tenth): the least recently used, 1.
    assert slots.slot(request("d", list(range(500, 505)) + [7] * 95)) == 1


def test_micro_batches_take_runs_of_neighbouring_slots_and_equal_tokens_of_each() -> None:
    """llama.cpp's `split_equal`, sequential: decode rows of slots 1–3 in one micro-batch,
    slot 6's in another; a prompt in the slot after a decode row's shares one token with
    it."""
    assert micro_batches([(1, 1), (2, 1), (3, 1), (6, 1)]) == [
        [(0, 0, 1), (1, 0, 1), (2, 0, 1)], [(3, 0, 1)]]
    assert micro_batches([(3, 1), (4, 40)]) == [[(0, 0, 1), (1, 0, 1)], [(1, 1, 39)]]
    assert micro_batches([(3, 1), (2, 40)]) == [[(0, 0, 1)], [(1, 0, 40)]]
    # One prompt of 1,200 tokens: 512 at most a pass.
    assert [b[0][2] for b in micro_batches([(0, 1200)])] == [512, 512, 176]


def test_a_batch_of_unequal_prompts_runs_in_six_micro_batches() -> None:
    """The first burst of the Mooncake excerpt on llama-server's eight slots, as its log
    gave the batch of one call (2,048 tokens, 2.97 s): six prompts' first 252 tokens,
    slot 5's next 512 and slot 7's first 24. Every slot gives 24 tokens, slots 0–6 then
    73 three times and 9, and slot 5's last 260 run alone."""
    pieces = [(0, 252), (1, 252), (2, 252), (3, 252), (4, 252), (5, 512), (6, 252), (7, 24)]
    batches = micro_batches(pieces)
    assert [sum(k for _, _, k in b) for b in batches] == [192, 511, 511, 511, 63, 260]
    assert [len(b) for b in batches] == [8, 7, 7, 7, 7, 1]
    assert batches[-1] == [(5, 252, 260)]


def test_a_step_is_priced_by_its_micro_batches_and_only_sampled_rows_read_the_head() -> None:
    """Each micro-batch is one estimate: its tokens, causal pairs and positions, and the
    rows whose logits llama.cpp computes (a decode row; a prompt chunk's last token only
    when it ends the prompt)."""
    slots = ServerSlots(4)
    rows = [Request(f"d{i}", list(range(10)), SamplingParams(max_tokens=4)) for i in range(2)]
    for r in rows:
        r.output_token_ids.append(7)
    prompt = Request("p", list(range(100)), SamplingParams(max_tokens=4))
    chunks = [ScheduledChunk(rows[0], 1, 10, [], True), ScheduledChunk(rows[1], 1, 10, [], True),
              ScheduledChunk(prompt, 60, 0, [], False)]
    calls = []

    def estimate(new: int, pairs: int, context: int, sampled: int, shape: str) -> float:
        calls.append((new, pairs, context, sampled, shape))
        return 1.0

    # Decode rows in slots 0 and 1, the prompt (not ending: no logits) in slot 2.
    assert slots.step_seconds(chunks, [1, 0, 2], estimate) == 2.0
    assert calls == [(3, 11 + 11 + 1, 11 + 11 + 1, 2, ""), (59, 59 + 59 * 60 // 2, 60, 0,
                                                          "prefill")]
    # A prompt of 600 tokens in one chunk: 512 at most a pass, its logits row in the last.
    calls.clear()
    long = Request("l", list(range(600)), SamplingParams(max_tokens=4))
    last = ScheduledChunk(long, 600, 0, [], True)
    assert slots.step_seconds([last], [2], estimate) == 2.0
    assert [(c[0], c[3], c[4]) for c in calls] == [(512, 0, "prefill"), (88, 1, "prefill")]
    # A chunk verifying drafts scores every position, and is no prefill.
    calls.clear()
    drafting = ScheduledChunk(rows[0], 3, 10, [], True, draft=(5, 6), num_draft=2)
    assert slots.step_seconds([drafting], [0], estimate) == 1.0
    assert [(c[0], c[3], c[4]) for c in calls] == [(3, 3, "")]


def test_the_prompt_pass_reads_the_head_only_for_rows_that_sample() -> None:
    """`--prompt-pass`: the decode rows' pass, then the prompts' — where a prompt chunk
    that does not end its prompt computes no logits."""
    row = Request("d", list(range(10)), SamplingParams(max_tokens=4))
    row.output_token_ids.append(7)
    prompts = [Request(r, list(range(100)), SamplingParams(max_tokens=4)) for r in "pq"]
    chunks = [ScheduledChunk(row, 1, 10, [], True), ScheduledChunk(prompts[0], 50, 0, [], False),
              ScheduledChunk(prompts[1], 100, 0, [], True)]
    calls = []

    def estimate(new: int, pairs: int, context: int, sampled: int, shape: str) -> float:
        calls.append((new, sampled, shape))
        return 1.0

    assert pass_seconds(chunks, estimate) == 2.0
    assert calls == [(1, 1, "decode"), (150, 1, "")]


def engine(server_slots: int, prompt_pass: bool = False) -> Engine:
    # Every row 1 ms over a fixed 20 ms: b rows in one pass take 20 + b ms.
    sim = SimExecutor(SimConfig(model_profile="qwen3-8b", hardware="h100-sxm", timing="fit",
                                fixed_ms=20, per_token_us=1000, per_pair_ns=0,
                                server_slots=server_slots, prompt_pass=prompt_pass))
    return Engine(EngineConfig(kv_memory_bytes=1 << 30, knobs=Knobs(max_num_seqs=4)), sim)


@pytest.mark.parametrize("server_slots", [0, 4])
def test_decode_rows_of_slots_apart_run_in_passes_of_their_own(server_slots: int) -> None:
    """A, B and C take slots 3, 2 and 1; once B has ended, A and C decode in slots that
    are not neighbours: two passes of one row with slots, one pass of two without."""
    e = engine(server_slots)
    e.add_request(list(range(10, 26)), SamplingParams(max_tokens=12), request_id="A")
    e.add_request(list(range(30, 46)), SamplingParams(max_tokens=3), request_id="B")
    e.add_request(list(range(50, 66)), SamplingParams(max_tokens=12), request_id="C")
    times: dict[tuple[str, ...], float] = {}
    while e.has_work:
        step = e.step()
        if step.num_decode == len(step.plan):
            times[tuple(sorted(c.request_id for c in step.plan))] = step.dt
        e.check_integrity()
    assert times[("A", "B", "C")] == pytest.approx(0.023)  # slots 1–3: one pass
    assert times[("A", "C")] == pytest.approx(0.042 if server_slots else 0.022)
    assert len(e.completed) == 3


def test_server_slots_must_be_a_count() -> None:
    with pytest.raises(ConfigError, match="server_slots must be an integer from 0"):
        SimConfig(server_slots=-1)


@pytest.mark.parametrize(("server_slots", "prompt_pass", "ms"),
                         [(4, False, 21 + 52), (0, True, 21 + 52), (0, False, 53)])
def test_a_prompt_beside_decode_rows_runs_after_their_passes(server_slots: int,
                                                             prompt_pass: bool,
                                                             ms: int) -> None:
    """With slots or `prompt_pass`, a step carrying a prompt and decode rows is the decode
    rows' pass, then the prompt's (a decode row and a prompt share a micro-batch for one
    token at most); without either, one step of all its tokens."""
    e = engine(server_slots, prompt_pass)
    e.add_request(list(range(10, 26)), SamplingParams(max_tokens=8), request_id="A")
    e.step()  # A's prompt; A then decodes (in slot 3, with slots)
    e.add_request(list(range(30, 62)), SamplingParams(max_tokens=2), request_id="B")
    step = e.step()
    assert sorted((c.request_id, c.num_new_tokens) for c in step.plan) == [("A", 1), ("B", 32)]
    # A's row: 20 + 1 ms; B's 32 prompt tokens: 20 + 32 ms; or one step of 33 rows.
    assert step.dt == pytest.approx(ms / 1e3)
    e.run_until_idle()
    e.close()


def test_a_slot_keeps_its_last_prompt_whole_or_up_to_a_checkpoint() -> None:
    """A slot keeps the prefix its last prompt shares with the next, all of it; with
    prompt cuts (a sliding-window model) only up to a checkpoint llama-server took at a
    cut of that prompt, less the token it computes again."""
    slots = ServerSlots(2)
    assert slots.reuse(request("a", list(range(768))), ()) == 0  # a fresh slot: nothing
    slots.release("a")
    assert slots.reuse(request("b", list(range(512)) + [9_999] * 256), ()) == 512
    slots.release("b")
    # b's prompt (768) was cut 516 and 4 tokens before its end: checkpoints at 252 and
    # 764; the 512 shared tokens reach the first.
    assert slots.reuse(request("c", list(range(512)) + [7_777] * 256), (516, 4)) == 251
    slots.release("c")
    # Sharing 200 tokens (over a tenth: the same slot), short of any checkpoint: none kept.
    assert slots.reuse(request("d", list(range(200)) + [5_555] * 568), (516, 4)) == 0
    assert slots.of["d"] == slots.of.get("d") == 1


def test_the_sim_reuses_slots_and_fills_prompts_in_slot_order() -> None:
    """Through the engine: a request that follows another with the same first 512 tokens
    starts computing at the slot's checkpoint (251 tokens cached); two prompts running at
    once take the budget in slot order, the later (a lower slot) first."""
    sim = SimExecutor(SimConfig(server_slots=4))
    knobs = Knobs(max_num_batched_tokens=300, chunk_size=200, enable_prefix_caching=False)
    e = Engine(EngineConfig(num_blocks=512, prompt_cuts="516,4", knobs=knobs), sim)
    e.add_request(list(range(768)), SamplingParams(max_tokens=2), request_id="A")
    while e.has_work:
        e.step()
    e.add_request(list(range(512)) + [9_999] * 256, SamplingParams(max_tokens=2),
                  request_id="B")
    first = e.step()
    assert [(c.request_id, c.start) for c in first.plan] == [("B", 251)]
    while e.has_work:
        e.step()
    assert e.completed[-1].num_cached_tokens == 251
    e.add_request([3] * 400, SamplingParams(max_tokens=2), request_id="C")
    e.add_request([4] * 400, SamplingParams(max_tokens=2), request_id="D")
    assert [(c.request_id, c.num_new_tokens) for c in e.step().plan] == [("C", 200),
                                                                         ("D", 100)]
    assert sim.slots.of["D"] < sim.slots.of["C"]
    assert [(c.request_id, c.num_new_tokens) for c in e.step().plan] == [("D", 200),
                                                                         ("C", 100)]
    while e.has_work:
        e.step()
        e.check_integrity()
    assert len(e.completed) == 4


def test_a_launch_saves_the_idle_slots_first_and_takes_in_what_arrives_meanwhile() -> None:
    """A slot's state is saved (to llama-server's prompt cache) at the next launch, once:
    after A has ended, B's launch holds the loop for A's 18-token state (at 1 ms a token
    here), C comes in 10 ms after B and runs its prompt in B's step; D, launched later,
    finds every idle slot saved and waits for nothing."""
    def run(saves: bool) -> dict[str, Request]:
        sim = SimExecutor(SimConfig(model_profile="qwen3-8b", hardware="h100-sxm",
                                    timing="fit", fixed_ms=20, per_token_us=1000,
                                    per_pair_ns=0, server_slots=4))
        if saves:
            sim.slots = ServerSlots(4, save_seconds=lambda n: n * 1e-3)
        e = Engine(EngineConfig(kv_memory_bytes=1 << 30, knobs=Knobs(max_num_seqs=4)), sim)
        for rid, at in (("A", 0.0), ("B", 1.0), ("C", 1.01), ("D", 2.0)):
            e.add_request(list(range(100, 116)) if rid == "A" else [ord(rid)] * 16,
                          SamplingParams(max_tokens=3), request_id=rid, arrival_time=at)
        while e.has_work:
            e.step()
            e.check_integrity()
        return {r.request_id: r for r in e.completed}

    plain, held = run(False), run(True)
    step = 0.020 + 0.016  # one prompt of 16 tokens alone
    assert plain["B"].first_token_time - 1.0 == pytest.approx(step)
    assert plain["C"].first_token_time > plain["B"].first_token_time  # a step of its own
    assert held["B"].first_token_time - 1.0 == pytest.approx(0.018 + 0.020 + 0.032)
    assert held["C"].first_token_time == held["B"].first_token_time
    # B's and C's slots were idle and unsaved at D's launch: their two 18-token states.
    assert held["D"].first_token_time - 2.0 == pytest.approx(0.036 + step)
    assert plain["D"].first_token_time - 2.0 == pytest.approx(step)


def ended(slots: ServerSlots, rid: str, prompt: list[int]) -> Request:
    """A request of three outputs, run in its slot to its end."""
    r = Request(rid, prompt, SamplingParams(max_tokens=3))
    slots.slot(r)
    r.output_token_ids.extend([7, 8, 9])
    slots.release(rid)
    return r


def test_a_launch_does_not_save_the_slot_it_takes_for_a_shared_prefix() -> None:
    """A and B end in slots 3 and 2; C shares A's first 50 tokens: it takes A's slot to
    reuse them, and its launch saves B's state only (62 tokens: prompt and outputs but the
    last), not A's (102)."""
    slots = ServerSlots(4, save_seconds=lambda n: n * 1e-3)
    ended(slots, "A", list(range(100)))
    ended(slots, "B", list(range(500, 560)))
    c = Request("C", list(range(50)) + [9_999] * 50, SamplingParams(max_tokens=3))
    assert slots.launch_hold([c]) == pytest.approx(0.062)
    assert slots.slot(c) == 3


def test_a_launch_does_not_save_a_state_the_prompt_cache_holds() -> None:
    """A's state is saved at B's launch. A2, A's prompt again, decodes the same outputs
    (greedy); once it and B have ended, D's launch saves B's state (42 tokens) and skips
    A2's: the cache holds it."""
    slots = ServerSlots(4, save_seconds=lambda n: n * 1e-3)
    ended(slots, "A", list(range(100)))
    b = Request("B", [5] * 40, SamplingParams(max_tokens=3))
    assert slots.launch_hold([b]) == pytest.approx(0.102)
    slots.slot(b)
    ended(slots, "A2", list(range(100)))
    b.output_token_ids.extend([7, 8, 9])
    slots.release("B")
    assert slots.launch_hold([Request("D", [6] * 40, SamplingParams(max_tokens=3))]) == \
        pytest.approx(0.042)
