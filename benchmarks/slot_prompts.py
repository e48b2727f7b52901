"""Several llama-server slots' prompts in one call against one prompt alone: does the step
model price them alike?

    python -m benchmarks.slot_prompts      # llama-server from .venv-clients/ (make clients)

llama-server (`-np 8`: one KV stream per slot) runs the prompts of the slots it launched
together in one batch a step, cut at its checkpoints and into micro-batches of neighbouring
slots (`runtime/executors/server_slots.py`), and the sim prices each micro-batch with the
step model fitted to probes of one prompt at a time. Whether that holds for several slots'
prompt pieces in one micro-batch is what this measures.

The server is probed as `kvdeck calibrate --url` probes it, and the step model fitted. Then,
in pairs run back to back so that the machine's speed (which moves by tens of per cent
within minutes on a shared 2-core machine) changes little between them: one prompt of `c`
tokens alone, then `b` prompts of `c` tokens pinned to slots 0 to b − 1 (`id_slot`) and
launched together (the second repeat the other way round): a request decoding in slot 7
keeps the server's loop busy while they arrive, so they start in one step (each prompt's
own time is kept: launched over two steps, they would not end together). A group's time
is llama-server's own account, the longest `timings.prompt_ms` in it (from the slot's
first prompt step to its first token);
its prediction sums the fitted step over the calls the sim makes of the same work
(`group_seconds`). Printed per pair: measured over predicted for one prompt and for `b`,
and the second over the first, 1.0 where the fit prices `b` slots' prompts as it prices
one. `bench-results/slot_prompts.json` keeps every figure.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import httpx

from benchmarks import peers
from benchmarks.sim_vs_real import LLAMA_BATCH, THREADS, llama_server_cuts
from kvdeck.runtime.core.policies.prompt_cuts import cut_points
from kvdeck.runtime.core.request import Request
from kvdeck.runtime.core.step_data import ScheduledChunk
from kvdeck.runtime.executors.server_slots import ServerSlots
from kvdeck.runtime.models.registry import DEFAULT_MODEL, resolve_model
from kvdeck.runtime.planning.calibrate import fit_step_model
from kvdeck.runtime.planning.probe import FULL, probe
from kvdeck.runtime.planning.profiles import ModelProfile, StepFit

CASES = ((2, 768), (4, 768), (6, 768), (4, 256), (6, 256))
"""(slots, prompt tokens) of the groups, each run after one prompt of its length alone."""
REPEATS = 2
DECODER_SLOT, DECODER_PROMPT, DECODER_TOKENS = 7, 16, 100
"""The request that holds the loop: a second of decoding before the group is sent, then
one token a call while the group's prompts run (three calls for 768 tokens)."""


def _cuts() -> tuple[int, ...]:
    flags = llama_server_cuts()  # ["--prompt-cuts", "516,4"] on Gemma 3, [] without windows
    return tuple(int(c) for c in flags[1].split(",")) if flags else ()


CUTS = _cuts()
"""llama-server's checkpoints on the model: 516 and 4 tokens before a prompt's end."""
OUT = Path("bench-results/slot_prompts.json")


def group_seconds(fit: StepFit, slots: int, prompt: int, cuts: tuple[int, ...] = CUTS,
                  decoder_context: int = DECODER_PROMPT) -> tuple[float, list[float]]:
    """What the fit prices `slots` prompts of `prompt` tokens launched together in slots
    0 to slots − 1 beside a request decoding in `DECODER_SLOT` (`decoder_context`: its
    positions at the first call, give or take the tokens it decoded before: a few
    nanoseconds each): per call (a step: the decode row, then each prompt's next piece up
    to its next cut while the batch has room), its micro-batches' fitted times summed;
    returns the total and each call's. The raw fit, without the sim's corrections by
    measured decode steps: both sides of a pair are priced alike."""
    if not 0 < slots < DECODER_SLOT:
        raise ValueError(f"slots must be 1 to {DECODER_SLOT - 1}, got {slots}")
    decoder = Request("decoder", [0] * decoder_context)
    prompts = [Request(f"p{s}", [0] * prompt) for s in range(slots)]
    server = ServerSlots(DECODER_SLOT + 1)
    done = [0] * slots
    calls: list[float] = []
    while min(done) < prompt:
        # The decode row first, then the prompts in slot order, each up to its next cut,
        # as many tokens as the batch holds (llama-server's `-b`); priced as the sim's
        # `ServerSlots.step_seconds` prices a step.
        decoder.output_token_ids.append(0)
        chunks = [ScheduledChunk(decoder, 1, decoder.num_tokens - 1, [], True)]
        slot_of = [DECODER_SLOT]
        room = LLAMA_BATCH - 1
        for s, req in enumerate(prompts):
            end = next((p for p in cut_points(prompt, cuts) if done[s] < p), prompt)
            take = min(end - done[s], room)
            if take > 0:
                chunks.append(ScheduledChunk(req, take, done[s], [], done[s] + take == prompt))
                slot_of.append(s)
                room -= take
                done[s] += take
        calls.append(server.step_seconds(
            chunks, slot_of, lambda new, pairs, context, sampled, _shape:
            fit.seconds(new, pairs, sampled, context)))
    return sum(calls), calls


async def measure_group(base: str, slots: int, prompt: int, rng: random.Random
                        ) -> list[float]:
    """Seconds llama-server at `base` (no /v1) took over each of `slots` prompts of `prompt`
    random tokens launched together beside a decoding request (its `prompt_ms`); a
    RuntimeError where that request ended before them (nothing held the loop)."""
    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 32_000) for _ in range(n)]

    async with httpx.AsyncClient(timeout=600) as client:
        decoder = asyncio.create_task(client.post(base + "/completion", json={
            "prompt": tokens(DECODER_PROMPT), "n_predict": DECODER_TOKENS,
            "ignore_eos": True, "id_slot": DECODER_SLOT}))
        await asyncio.sleep(1.0)  # decoding by now: its steps hold the loop
        replies = await asyncio.gather(*[client.post(base + "/completion", json={
            "prompt": tokens(prompt), "n_predict": 1, "ignore_eos": True, "id_slot": s})
            for s in range(slots)])
        held = not decoder.done()
        (await decoder).raise_for_status()
    for r in replies:
        r.raise_for_status()
    if not held:
        raise RuntimeError(f"the decoding request ended before {slots} × {prompt} did: "
                           "raise DECODER_TOKENS for this machine")
    return [r.json()["timings"]["prompt_ms"] / 1e3 for r in replies]


def main() -> None:
    server = peers.llama_server(resolve_model(DEFAULT_MODEL), DEFAULT_MODEL, THREADS,
                                repack=False)
    server.start(DEFAULT_MODEL)
    base = server.url.removesuffix("/v1")
    rows = []
    try:
        fit = fit_step_model(probe(server.url, DEFAULT_MODEL, FULL, progress=lambda m: None,
                                   shape=ModelProfile.load(DEFAULT_MODEL)))
        print(f"{server.version}\nfit: {json.dumps(fit.to_json())}")
        rng = random.Random(0)
        for rep in range(REPEATS):
            for slots, prompt in CASES:
                t0 = time.time()
                # Alone first, then together, then the other way round: a steady drift
                # of the machine's speed leans the two repeats opposite ways.
                order = (1, slots) if rep % 2 == 0 else (slots, 1)
                timed = {n: asyncio.run(measure_group(base, n, prompt, rng)) for n in order}
                alone, together = max(timed[1]), max(timed[slots])
                one = alone / group_seconds(fit, 1, prompt)[0]
                many = together / group_seconds(fit, slots, prompt)[0]
                rows.append({"repeat": rep, "slots": slots, "prompt": prompt,
                             "alone_s": alone, "together_s": together,
                             "together_each_s": timed[slots], "alone_ratio": one,
                             "together_ratio": many, "quotient": many / one,
                             "wall_s": time.time() - t0})
                print(f"{slots} × {prompt}: measured/predicted alone {one:.2f}, together "
                      f"{many:.2f}; quotient {many / one:.2f}", flush=True)
    finally:
        server.stop()
    quotients = [r["quotient"] for r in rows]
    print(f"quotient median {statistics.median(quotients):.2f} "
          f"({min(quotients):.2f}–{max(quotients):.2f}) over {len(rows)} pairs")
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"server": server.version, "fit": fit.to_json(), "pairs": rows},
                              indent=1))


if __name__ == "__main__":
    main()
