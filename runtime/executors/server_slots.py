"""llama-server's slots, for the sim to run requests as that server does (`--server-slots
N`): which slot each takes, what its slot kept of the last prompt (`reuse`, asked by the
scheduler on admission, which also fills a step's prompts in slot order), and a step
priced as a pass per micro-batch llama.cpp cuts it into (`micro_batches`). `pass_seconds`
prices a step for the sim's `--prompt-pass` (kvdeck's own llama_cpp executor: its decode
rows in one pass, its prompts in another).

llama-server started with `-np N` (and no `--kv-unified`) keeps one KV stream per slot, and
llama.cpp then cuts a batch into micro-batches whose sequences have consecutive ids
(`llama_batch_allocr::split_equal`, sequential): the decode rows of slots 2, 3 and 4 run as
one micro-batch, those of slots 2 and 5 as two, one after the other, each a whole pass
over the weights. Measured on Gemma 3 270M (2 cores, 8 slots), in a trace's token
streams: one request decoding took 22 ms a step, two 45 and three 67; two and three sent
at once (neighbouring slots) took 28 and 42. Pinned with `id_slot`, two requests decoding
in slots 0 and 2 took 44 ms a step, in slots 0 and 1 or 3 and 4, 28.

Which slot a request takes is llama-server's choice, and this follows it: the idle slot
whose last prompt shares the longest prefix with the new one, where that prefix is over a
tenth of the new prompt (`--slot-prompt-similarity`, default 0.1; the lowest-numbered of
equals); else the idle slot used longest ago (the highest-numbered of equals: its loop
keeps the last). A request beyond the slots waits for one in llama-server; run the sim
with `--max-num-seqs` no more than N (past it, requests share a slot here).

Before a new request's first step, llama-server saves every idle slot whose tokens its host
prompt cache does not hold yet (`--cache-ram`, 8 GiB by default), and its loop waits for
that: the state of a slot of 799 tokens on Gemma 3 270M (9.9 MiB: every token's KV in the
global layers, the window's in the sliding ones) took 15–16 ms on a 2-core CPU, and a burst
that found four such slots held the loop 64 ms, in which the burst's next three requests
came in and ran their prompts in one step with the first. With a profile that times a save
(`[slot_save.<hw>]`, `kvdeck calibrate --url`), `launch_hold` gives that hold; which states
the cache holds, and which it drops past its limits: `server_prompt_cache.py`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvdeck.runtime.core.policies.prompt_cuts import cut_points
from kvdeck.runtime.core.request import Request
from kvdeck.runtime.core.step_data import ScheduledChunk, causal_pairs, common_prefix
from kvdeck.runtime.executors.server_prompt_cache import PromptCache
from kvdeck.runtime.planning.slot_save import save_seconds

if TYPE_CHECKING:
    from kvdeck.runtime.planning.profiles import ModelProfile

StepEstimate = Callable[[int, int, int, int, str], float]
"""(new tokens, causal pairs, positions read, rows sampled, shape) -> seconds of one pass
(`SimExecutor.estimate_step_seconds`)."""

SIMILARITY = 0.1
"""llama-server's default `--slot-prompt-similarity`."""


class ServerSlots:
    """Slot numbers of the running requests, and what each slot last held."""

    def __init__(self, num_slots: int, save_seconds: Callable[[int], float] | None = None,
                 cache: PromptCache | None = None):
        """`save_seconds`: what saving a slot's state of n tokens to the prompt cache takes
        (None: the server saves nothing); `cache`: the prompt cache (None: one without
        limits)."""
        self.num_slots = num_slots
        self.save_seconds = save_seconds
        self._saved = [True] * num_slots
        """Whether the prompt cache has been offered each slot's tokens since they
        changed."""
        self.cache = cache or PromptCache()
        self.of: dict[str, int] = {}
        """Slot of each request holding one."""
        self._holder: dict[str, Request] = {}
        self._last: list[tuple[int, ...]] = [()] * num_slots
        """Each slot's tokens when its request ended (llama-server keeps them cached)."""
        self._prompt = [0] * num_slots
        """The length of each slot's last prompt (where its checkpoints were)."""
        self._used = [-1] * num_slots
        self._clock = itertools.count()

    @classmethod
    def of_profile(cls, num_slots: int, model: ModelProfile, hardware: str,
                   cache_ram_mib: int) -> ServerSlots:
        """The slots of a server of `model` on `hardware`, its saves as the profile times
        them (none where it does not, or under `--cache-ram 0`); its prompt cache's state
        bytes and context are bound with the KV pool (`SimExecutor.bind_kv`)."""
        saves = model.slot_saves.get(hardware) if cache_ram_mib else None
        return cls(num_slots, save_seconds(model, saves) if saves else None,
                   PromptCache(cache_ram_mib=cache_ram_mib))

    def slot(self, req: Request) -> int:
        """`req`'s slot, taken now if it has none."""
        s = self.of.get(req.request_id)
        if s is None:
            s = self._pick(req)[0]
            self.of[req.request_id] = s
            self._holder[req.request_id] = req
        return s

    def reuse(self, req: Request, cuts: tuple[int, ...]) -> int:
        """Takes `req`'s slot (on admission, as llama-server launches a task into a slot) and
        returns the prompt tokens that slot still holds for it: the prefix its last tokens
        share with `req`'s prompt, at most all but the prompt's last token. With `cuts`
        (`prompt_cuts`: a model with sliding-window layers) only up to the last of the
        slot's checkpoints within that prefix, taken where its last prompt was cut: the
        window's KV before them is gone, and llama-server restores the checkpoint and
        computes its last token again (measured: 251 tokens kept of a checkpoint at 252, 59
        of one at 60); none within it, the prompt is computed whole. A request the pool
        then cannot take keeps its slot while it waits."""
        s = self.slot(req)
        prompt = req.prompt_token_ids
        shared = min(common_prefix(self._last[s], prompt), len(prompt) - 1)
        if cuts:
            shared = max((p - 1 for p in cut_points(self._prompt[s], cuts) if p <= shared),
                         default=0)
        return shared

    def _pick(self, req: Request) -> tuple[int, bool]:
        """The slot llama-server gives `req`, and whether for the prefix they share."""
        busy = set(self.of.values())
        idle = [s for s in range(self.num_slots) if s not in busy]
        if not idle:  # more requests than slots: llama-server would queue it; share one
            return len(self.of) % self.num_slots, False
        prompt = req.prompt_token_ids
        best, best_len = None, 0
        for s in idle:
            n = common_prefix(self._last[s], prompt)
            if n > best_len:
                best, best_len = s, n
        if best is not None and best_len > SIMILARITY * len(prompt):
            return best, True
        return min(idle, key=lambda s: (self._used[s], -s)), False

    def release(self, request_id: str) -> None:
        """`request_id` ended: its slot is idle and keeps its tokens."""
        s = self.of.pop(request_id, None)
        req = self._holder.pop(request_id, None)
        if s is None or req is None:
            return
        self._last[s] = tuple(req.prompt_token_ids) + tuple(req.output_token_ids)
        self._saved[s] = False
        self._prompt[s] = len(req.prompt_token_ids)
        self._used[s] = next(self._clock)

    def launch_hold(self, waiting: Sequence[Request]) -> float:
        """Seconds llama-server's loop holds before a step that launches one of `waiting`
        (a request without a slot, while a slot is idle): the saves of the idle slots whose
        tokens are not in its prompt cache yet, which are then — but for the slot the
        launch takes for the prefix it shares, whose tokens it reuses (in llama-server's
        log, a slot chosen by its prefix is not saved, one chosen as the least recently
        used is). A state the cache holds within one it has is not saved again (its
        `alloc`: "prompt is already in the cache, skipping"), and one it dropped past its
        limits is saved again (`PromptCache`)."""
        if self.save_seconds is None:
            return 0.0
        busy = set(self.of.values())
        # Called before every step: most find nothing to save, and stop here.
        unsaved = [s for s in range(self.num_slots)
                   if s not in busy and not self._saved[s] and self._last[s]]
        first = next((r for r in waiting if r.request_id not in self.of), None) \
            if unsaved else None
        if first is None:
            return 0.0
        taken, similar = self._pick(first)
        if similar:
            self._saved[taken] = True  # its tokens give way to the new request's
        hold = 0.0
        for s in unsaved:
            if similar and s == taken:
                continue
            self._saved[s] = True
            # Its last sampled token never ran through the model: the state is the rest
            # (llama-server saves 799 tokens of a 768-token prompt and 32 outputs).
            if self.cache.save(self._last[s][:-1]):
                hold += self.save_seconds(len(self._last[s]) - 1)
        return hold

    def step_seconds(self, chunks: list[ScheduledChunk], slots: list[int],
                     estimate: StepEstimate) -> float:
        """A step as llama-server runs it: one batch, its decode rows and then its prompt
        chunks, each in slot order (its `update_slots` adds them so), that llama.cpp cuts
        into micro-batches (`micro_batches`), each a pass over the weights, one after
        another; `slots` are the chunks' slots."""
        rows = set(decode_rows(chunks))
        # A slot's drafts follow its sampled token in llama-server's batch: with the rows.
        generating = rows | {i for i, c in enumerate(chunks) if c.num_draft}
        order = sorted(range(len(chunks)), key=lambda i: (i not in generating, slots[i]))
        total = 0.0
        for batch in micro_batches([(slots[i], chunks[i].num_new_tokens) for i in order]):
            new = pairs = context = sampled = 0
            members = [order[j] for j, _, _ in batch]
            for i, (_, done, k) in zip(members, batch, strict=True):
                c = chunks[i]
                h = c.start + done
                new, pairs, context = new + k, pairs + causal_pairs(k, h), context + h + k
                sampled += c.logits_rows(done, k)
            total += estimate(new, pairs, context, sampled,
                              shape([chunks[i] for i in members], rows.issuperset(members)))
        return total


UBATCH = 512
"""llama-server's default micro-batch (`-ub`, `n_ubatch`), with which the benchmark and the
probes run it."""


def micro_batches(pieces: list[tuple[int, int]], size: int = UBATCH
                  ) -> list[list[tuple[int, int, int]]]:
    """How llama.cpp's `split_equal` (sequential: one KV stream per slot) cuts a batch of
    `pieces`, (slot, tokens) in the batch's order, one per slot: each micro-batch takes the
    first piece with tokens left and every later one whose slot follows the one before it,
    and as many tokens from each as the shortest has left, at most `size` in all (one each
    at least). Returns each micro-batch's (index into `pieces`, tokens taken before it,
    tokens taken). Slots 2, 3 and 4 decoding run as one micro-batch, slots 2 and 5 as two;
    prompts of 252 tokens in slots 0–7 as four, 64 tokens of each (60 in the last)."""
    taken = [0] * len(pieces)
    out: list[list[tuple[int, int, int]]] = []
    while True:
        run: list[int] = []
        for i, (slot, n) in enumerate(pieces):
            if taken[i] < n and (not run or slot == pieces[run[-1]][0] + 1):
                run.append(i)
        if not run:
            return out
        k = min(min(pieces[i][1] - taken[i] for i in run), max(1, size // len(run)))
        out.append([(i, taken[i], k) for i in run])
        for i in run:
            taken[i] += k


def shape(chunks: list[ScheduledChunk], decode: bool) -> str:
    """The shape of one pass of `chunks` that the profile's measured steps correct
    (`SimExecutor.estimate_step_seconds`): "decode" for decode rows alone (`decode`: they
    are), "prefill" for one prompt chunk alone, else "" (the fit's alone)."""
    if decode:
        return "decode"
    return "prefill" if len(chunks) == 1 and not chunks[0].num_draft else ""


def decode_rows(chunks: list[ScheduledChunk]) -> list[int]:
    """Indices of the chunks that are one decode row each (no draft, no prompt token)."""
    return [i for i, c in enumerate(chunks)
            if c.num_new_tokens == 1 and c.start + 1 == c.request.num_tokens
            and not c.num_draft and c.request.output_token_ids]


def pass_seconds(chunks: list[ScheduledChunk], estimate: StepEstimate) -> float:
    """A step as kvdeck's llama_cpp executor runs it (the sim's `--prompt-pass`): its decode
    rows in one pass, then the other chunks in another (a decode row and a prompt share a
    micro-batch for one token at most: `micro_batches`)."""
    rows = set(decode_rows(chunks))
    total = 0.0
    if rows:
        ctx = sum(chunks[i].start + 1 for i in rows)  # each row's pairs, positions
        total += estimate(len(rows), ctx, ctx, len(rows), "decode")
    others = [c for i, c in enumerate(chunks) if i not in rows]
    if others:
        total += estimate(sum(c.num_new_tokens for c in others),
                          sum(c.num_pairs for c in others),
                          sum(c.start + c.num_new_tokens for c in others),
                          sum(c.logits_rows() for c in others), shape(others, False))
    return total
