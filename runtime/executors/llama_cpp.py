"""The `llama_cpp` executor: llama.cpp's kernels (CPU, CUDA, Metal) under kvdeck's scheduler.

One llama.cpp context holds every request, each as a *sequence id*; each engine step is one
`llama_batch` mixing decode rows, prefill chunks and speculative verify chunks across
sequences, with logits requested only for the rows that sample (or verify, or score prompt
tokens). kvdeck's shared sampler (`runtime/text/sampling.py`) picks tokens from those logits, so
seeds, stop strings, logprobs, prompt logprobs and speculation behave as with the torch
executor.

**KV: blocks, slots and cells.** kvdeck's block manager stays the source of truth for
admission, capacity, sharing and the block map. llama.cpp keeps K and V in *cells*, one
per token position of a sequence. The context is laid out as llama.cpp's own server lays
it out: `n_parallel` *slots*, each a sequence id with a stream of its own, and sized from
the pool: `n_ctx = num_blocks × block_size` cells in all, `n_ctx / n_parallel` per slot,
which becomes the engine's context limit. A running request owns one slot (so
`max_num_seqs` may not exceed `n_parallel`); block `b` of its table covers positions
`[b·p, (b+1)·p)` of its slot's stream.

Why one stream per sequence, not one pool for all (`kv_unified`): llama.cpp's CPU kernels
are not batch-invariant. In a unified pool a sequence's logits depend on where its cells
sit among other sequences' cells (by up to half a logit on Gemma 3 270M); with a stream per
sequence, a request decoded in a `llama_decode` of its own gives exactly the logits it
gives alone, which `batch_invariant` uses (every request's rows in a call of their own,
exact and as slow as one request after another). By default a step is one `llama_decode`
of all its rows, as llama-server batches its slots: decode rows then differ from a row
alone by up to ~0.02 nats at the first step with 8 rows, and prefill rows by the grouping
of the matmul (ggml-org/llama.cpp#6583; `docs/llama_cpp.md`). The rows go in slot order
(`one_batch`): with a stream per slot llama.cpp splits a batch into micro-batches of
consecutive, increasing sequence ids only.

- The executor remembers, per slot, the block ids its stream holds; any slot holding a
  block is one of its *holders* (several slots may hold copies of a shared prefix).
- A request that starts past position 0 (a prefix-cache hit, a fork, a resumed request)
  takes a holder's whole stream (`llama_memory_seq_cp`; llama.cpp copies whole streams
  only) and cuts it at its start, when one slot holds every block it shares; otherwise it
  recomputes those positions in the step (as a recompute would).
- A finished or preempted request's slot is *retired*, not cleared: it holds the blocks the
  prefix cache may hand out, until a new request needs the slot (a new request takes the
  lowest slot no request runs in, free or retired, sparing the holders the step copies
  from, so the running slots stay one run of consecutive ids). The blocks a cleared slot
  held that no other slot holds go back to the engine as `StepResult.lost_blocks`, and
  leave the prefix cache: a hit on them would recompute them outside the token budget.
- Rolled-back speculative positions, and anything past a chunk's `start`, are removed
  from the stream before the step writes there.

- A slot's length counts only positions already decoded, and every rollback is cut
  before any copy, so a request never copies positions that another request's chunk in
  the same step has yet to write.

Sliding-window models keep full-length KV in every layer (`swa_full`), so a cached
prefix's cells stay valid for any request that shares it.

**Speculation.** n-gram drafts and a draft model's (`runtime/executors/llama_cpp_draft.py`:
a second GGUF in a context of its own, slot for slot beside this one, following this
context's copies, cuts and cleared slots) are verified as chunks in this context's step.

**KV formats** map to llama.cpp's `type_k`/`type_v`: `fp16` (F16), `q8_0`, `q4_0`
(quantized V needs flash attention, which is switched on for them). Changing the format
live recreates the context and re-prefills every running request's tokens into its new
slot before the next step; that time is the switch's (the console's notice of the switch
shows the pause). Retired slots are not re-prefilled: their prefixes recompute when hit.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

from kvdeck.runtime.core.step_data import (
    Conversion,
    ScheduledChunk,
    SchedulerOutput,
    StepResult,
    StepTiming,
)
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.base import ExecutorInfo, WeightsView
from kvdeck.runtime.executors.llama_cpp_context import (
    KV_TYPES,
    LlamaContext,
    LlamaModel,
    Row,
    lib,
)
from kvdeck.runtime.executors.llama_cpp_draft import LlamaDraft
from kvdeck.runtime.executors.llama_cpp_lora import LlamaAdapters
from kvdeck.runtime.executors.llama_cpp_probe import resolve_repack
from kvdeck.runtime.executors.online_fit import OnlineFit
from kvdeck.runtime.executors.outputs import LogitsStage
from kvdeck.runtime.kv.groups import LayerGroups
from kvdeck.runtime.models.gguf import read_gguf
from kvdeck.runtime.models.info import model_info_from_gguf
from kvdeck.runtime.planning.profiles import StepFit
from kvdeck.runtime.settings import SessionOptions
from kvdeck.runtime.spec.ngram import propose_for
from kvdeck.runtime.text.guided import MaskJob

log = logging.getLogger("kvdeck.llama_cpp")

MAX_SLOTS = 256
"""llama.cpp's limit on sequence ids in one context (LLAMA_MAX_SEQ)."""


class NoSlotError(Exception):
    """A request needed a slot and every slot runs a request."""


class LlamaCppExecutor:
    """Executor protocol implementation over llama-cpp-python's low-level API."""

    def __init__(self, model_path: str | Path, *, threads: int | None = None,
                 n_gpu_layers: int = 0, n_parallel: int = SessionOptions.n_parallel,
                 batch_invariant: bool = False,
                 seed: int = 0, n_batch: int = 2048, draft_model: str | Path | None = None,
                 repack: str = "auto"):
        """`n_gpu_layers`: layers offloaded to the GPU (Metal or CUDA builds; -1 all);
        `n_parallel`: slots, the most requests running at once; `batch_invariant`: decode
        each request in a call of its own, so its output is exactly what it gives alone
        (at the cost of batching: see the module docstring); `threads`: CPU threads
        (default: the machine's cores); `n_batch`: most tokens in one llama_batch (a chunk
        with more is decoded in several); `draft_model`: a smaller GGUF sharing the
        model's tokenizer, in a context of its own, for `speculative_method = draft`
        (`runtime/executors/llama_cpp_draft.py`); `repack`: llama.cpp's re-packed weights
        (extra buffer types) `on`, `off`, or `auto`, as the start-up probe found them to
        work on this machine (`runtime/executors/llama_cpp_probe.py`)."""
        if not 1 <= n_parallel <= MAX_SLOTS:
            raise ConfigError(f"n_parallel must be from 1 to {MAX_SLOTS} (llama.cpp's "
                              f"sequences), got {n_parallel}.")
        self.n_parallel = n_parallel
        self.batch_invariant = batch_invariant
        model_path = Path(model_path)
        g = read_gguf(model_path)
        try:
            info = model_info_from_gguf(g)
            eos = [g.get("tokenizer.ggml.eos_token_id"), g.get("tokenizer.ggml.eot_token_id")]
        finally:
            g.close()
        self.model_info = info
        self.model_context = info.context_length or 4096
        self.seed = seed
        self.threads = threads or os.cpu_count() or 1
        self.n_batch = n_batch
        self.n_gpu_layers = n_gpu_layers
        self.repack, repack_note = resolve_repack(repack, model_path)
        """Whether the weights are re-packed (the start-up note says why not)."""
        self._model = LlamaModel(model_path, n_gpu_layers, self.repack)
        self.load_seconds = self._model.load_seconds
        L, vocab = lib(), self._model.vocab
        ids = [int(t) for t in eos if t is not None]
        ids += [t for t in (L.llama_vocab_eos(vocab), L.llama_vocab_eot(vocab)) if t >= 0]
        self.weight_bytes = self._model.weight_bytes
        self.adapters = LlamaAdapters(self._model, info.architecture)  # llama_cpp_lora.py
        self.draft: LlamaDraft | None = None
        if draft_model is not None:
            try:
                self.draft = LlamaDraft(draft_model, model_path, n_gpu_layers, seed,
                                        repack=self.repack)
            except BaseException:
                self._model.close()
                raise
        self.info = ExecutorInfo(
            "llama_cpp", info.name, model_path, self._model.vocab_size, self.model_context,
            tuple(dict.fromkeys(ids)), info.num_layers, tuple(KV_TYPES),
            1e12 if n_gpu_layers == 0 else 25e9, "none (llama.cpp keeps KV in its context)",
            max_sequences=n_parallel, slots=n_parallel,
            draft_model_name=self.draft.name if self.draft is not None else "",
            start_note=repack_note, device="cpu" if n_gpu_layers == 0 else "gpu")
        """The context limit is the model's until `bind_kv` sets it to a slot's cells."""
        self._ctx: LlamaContext | None = None
        self.kv_format = "fp16"
        self.block_size = 16
        self.num_blocks = 0
        self._seq_of: dict[str, int] = {}
        """Request id -> its slot (sequence id)."""
        self._length: dict[int, int] = {}
        """Slot -> positions its stream holds."""
        self._blocks: dict[int, list[int]] = {}
        """Slot -> the block ids it wrote, by table index."""
        self._retired: set[int] = set()
        """Slots of finished or preempted requests: their streams stay until a new request
        needs the slot (a prefix-cache hit may copy from them meanwhile)."""
        self._lost: set[int] = set()
        """Blocks whose positions were in a slot cleared since the last step ended: the
        step reports those no slot holds any more (`StepResult.lost_blocks`)."""
        self._free_ids: list[int] = []
        self._running: dict[str, tuple[object, list[int]]] = {}
        """Request id -> (request, block table) as of its latest chunk, for re-prefilling
        after a KV-format switch."""
        self.timing = OnlineFit(StepFit(self.weight_bytes / 12e9,
                                        2.0 * self.weight_bytes / 0.6 / 50e9, 1e-9))

    # -- LoRA adapters (`llama_cpp_lora.py`) --------------------------------------------------

    def load_adapter(self, name: str, path: str | Path, max_loras: int = 0) -> int:
        """Serve the adapter at `path` as `name` (every adapter stays loaded in llama.cpp:
        `max_loras` bounds only the adapters in one batch, which the scheduler enforces)."""
        return self.adapters.load(name, path)

    def describe_adapters(self) -> str:
        return self.adapters.describe()

    @property
    def adapter_reserve_bytes(self) -> int:
        return sum(self.adapters.num_bytes.values())

    # -- context ----------------------------------------------------------------------------

    def kv_bytes_per_token(self, kv_format: str) -> int:
        if kv_format not in KV_TYPES:
            raise ConfigError(f"kv_format {kv_format!r} is not one llama.cpp stores; the "
                              f"llama_cpp executor takes {', '.join(KV_TYPES)}.")
        return self.model_info.kv_bytes_per_token(kv_format)

    def draft_kv_bytes_per_token(self, kv_format: str) -> int:
        """Bytes of the draft model's KV per token (0 without a draft model)."""
        return self.draft.kv_bytes_per_token(kv_format) if self.draft is not None else 0

    def estimate_draft_seconds(self, num_rows: int) -> float:
        """One draft pass over `num_rows` rows (0 without a draft model)."""
        return self.draft.pass_seconds(num_rows) if self.draft is not None else 0.0

    def bind_kv(self, num_blocks: int, block_size: int, kv_format: str,
                groups: LayerGroups | None = None) -> None:
        """(Re)create the context: `num_blocks × block_size` cells of `kv_format` in
        `n_parallel` streams; every slot starts empty. A slot's cells cap a request's
        tokens (`info.max_model_len`). `groups` is always None here (llama.cpp lays out
        its own KV cells: no `WindowGroups`)."""
        assert groups is None, "llama.cpp has no layer groups"
        self.kv_bytes_per_token(kv_format)  # refuses what llama.cpp cannot store
        self._free_context()
        per_slot = num_blocks * block_size // self.n_parallel
        if per_slot < 2 * block_size:
            raise ConfigError(f"The KV budget holds {num_blocks * block_size:,} tokens, "
                              f"{per_slot:,} for each of {self.n_parallel} slots; raise "
                              "--kv-memory-gib or lower --n-parallel.")
        n_ctx = per_slot * self.n_parallel
        self._ctx = LlamaContext(self._model, n_ctx, self.n_parallel, self.threads,
                                 self.n_batch, kv_format)
        if self.draft is not None:
            self.draft.bind(n_ctx, self.n_parallel, self.threads, self.n_batch, kv_format)
        self.kv_format, self.block_size, self.num_blocks = kv_format, block_size, num_blocks
        self._seq_of.clear()
        self._running.clear()
        self._length.clear()
        self._blocks.clear()
        self._retired.clear()
        self._free_ids = list(range(self.n_parallel - 1, -1, -1))
        self.info = dataclasses.replace(self.info,
                                        max_model_len=min(self.model_context, per_slot))

    def _free_context(self) -> None:
        if self.draft is not None:
            self.draft.close_context()
        if self._ctx is not None:
            self._ctx.close()
            self._ctx = None

    def convert_kv(self, kv_format: str, num_blocks: int, src: list[int], dst: list[int]
                   ) -> Conversion:
        """A new context in `kv_format`, and every running request's tokens re-prefilled
        into it (llama.cpp cannot re-encode cells in place); the seconds include both."""
        t0 = time.perf_counter()
        running = [(rid, *self._running[rid], self._length[seq])
                   for rid, seq in self._seq_of.items() if rid in self._running]
        before = sum(n for *_, n in running) * self.model_info.kv_bytes_per_token(self.kv_format)
        self.bind_kv(num_blocks, self.block_size, kv_format)
        moved = dict(zip(src, dst, strict=True))  # the pool's new block ids
        groups, names = [], []
        for rid, req, old, n in running:
            if not all(b in moved for b in old[:-(-n // self.block_size)]):
                continue  # preempted by the switch (its blocks were freed): recomputes later
            table = [moved[b] for b in old[:-(-n // self.block_size)]]
            seq = self._new_seq()
            self._seq_of[rid] = seq
            self._running[rid] = (req, table)
            groups.append([(t, pos, seq, -1) for pos, t in enumerate(req.token_slice(0, n))])
            names.append(req.sampling.lora)
            self._write(seq, table, 0, n)
            self._length[seq] = n
        regrouped, adapters = self.adapters.group(groups, names, False)  # each its adapter
        self._ctx.decode(regrouped, 0, adapters)
        after = sum(map(len, groups)) * self.model_info.kv_bytes_per_token(kv_format)
        return Conversion(time.perf_counter() - t0, True, before, after)

    def describe_weights(self, kv_format: str) -> WeightsView:
        types = ", ".join(t.type_name for t in self.model_info.tensor_types[:3])
        where = "CPU" if self.n_gpu_layers == 0 else f"{self.n_gpu_layers} layers on the GPU"
        packed = "re-packed" if self.repack else "not re-packed"
        return WeightsView("dense", self.weight_bytes, f"llama.cpp, the GGUF's own {types} "
                           f"({packed}); {where}", (), ())

    def estimate_step_seconds(self, num_new_tokens: int, num_pairs: int,
                              num_context_tokens: int) -> float:
        return self.timing.seconds(num_new_tokens, num_pairs)

    @property
    def fit(self) -> StepFit:
        return self.timing.fit

    # -- sequences --------------------------------------------------------------------------

    def _new_seq(self, keep: set[int] = frozenset()) -> int | None:
        """The lowest slot no request runs in, free or retired, sparing the retired slots
        in `keep` (holders this step copies from) while another one will do; None when
        every slot runs a request.

        Lowest, not least recently used: llama.cpp batches only runs of consecutive slot
        ids, so a gap among the running slots costs every step another pass over the
        weights for as long as it lasts (at concurrency 8 in 16 slots, taking free slots
        past the retired ones dropped throughput by a fifth); a retired slot's prompt is
        worth one prefill at most."""
        idle = sorted({*self._free_ids, *self._retired})
        if not idle:
            return None
        seq = next((s for s in idle if s not in keep), idle[0])
        if seq in self._retired:
            self._drop(seq)
        self._free_ids.remove(seq)
        self._length[seq] = 0
        return seq

    def _drop(self, seq: int) -> None:
        """Clear a retired slot's stream and free it."""
        self._ctx.remove(seq)
        if self.draft is not None:
            self.draft.cleared(seq)
        self._lost.update(self._blocks.pop(seq, ()))
        self._retired.discard(seq)
        self._length.pop(seq, None)
        self._free_ids.append(seq)

    def _retire(self, request_id: str) -> None:
        self._running.pop(request_id, None)
        seq = self._seq_of.pop(request_id, None)
        if seq is not None:
            self._retired.add(seq)

    def _write(self, seq: int, table: list[int], start: int, end: int) -> None:
        """`seq` wrote positions `[start, end)`: it now holds their blocks."""
        p = self.block_size
        held = self._blocks.setdefault(seq, [])
        first = start // p
        del held[first:]
        for b in range(first, -(-end // p)):
            held.append(table[b])

    def _prepare(self, chunk, keep: set[int]) -> tuple[int, list[int]]:
        """Bring the chunk's slot to exactly `chunk.start` positions (`execute` has cut it
        back to there): take a holder's stream, or recompute. Returns (slot, the tokens it
        must recompute first, which end at `chunk.start`)."""
        rid = chunk.request_id
        seq = self._seq_of.get(rid)
        if seq is None:
            seq = self._new_seq(keep)
            if seq is None:
                raise NoSlotError(f"all {self.n_parallel} llama.cpp slots are running "
                                  "requests (max_num_seqs may not exceed n_parallel)")
            self._seq_of[rid] = seq
        start = chunk.start  # `execute` cut every slot back to its chunk's start first
        have = self._length[seq]
        if 0 == have < start:
            holder = self._holder_of(chunk.block_table, start)
            if holder is not None:
                self._ctx.copy_stream(holder, seq, start)
                if self.draft is not None:
                    self.draft.copied(holder, seq, start)
                self._write(seq, chunk.block_table, 0, start)
                self._length[seq] = have = start
        redo = chunk.request.token_slice(have, start) if have < start else []
        if redo:
            self._write(seq, chunk.block_table, have, start)
        return seq, redo

    def _cut(self, seq: int, start: int) -> None:
        """Drop positions `start`.. of slot `seq` (rolled-back speculation, or a request
        recomputing from earlier), and its claim on the blocks past them."""
        if self._length[seq] > start:
            self._ctx.remove(seq, start)
            self._length[seq] = start
            keep = -(-start // self.block_size)
            held = self._blocks.get(seq, [])
            self._lost.update(held[keep:])
            del held[keep:]
        if self.draft is not None:
            self.draft.cut(seq, start)

    def _holder_of(self, table: list[int], start: int) -> int | None:
        """A slot holding every block of `table` up to position `start`, if one does (a
        running one first: several may hold copies of a shared prefix). `_length` counts
        only positions already decoded, so a slot this step writes is a holder only for
        what it held before the step."""
        nb = -(-start // self.block_size)
        want = table[:nb]
        found = None
        for seq, held in self._blocks.items():
            if self._length.get(seq, 0) >= start and held[:nb] == want:
                if seq not in self._retired:
                    return seq
                found = seq if found is None else found
        return found

    # -- the step ---------------------------------------------------------------------------

    def execute(self, plan: SchedulerOutput) -> StepResult:
        """One `llama_decode` of every row of the step in slot order (each chunk with the
        positions its slot must recompute first), or one per request under
        `batch_invariant`: see the module docstring. Logits come back only for rows that
        sample, verify or score prompt tokens."""
        assert self._ctx is not None, "bind_kv must run before execute"
        t0 = time.perf_counter()
        for rid in plan.preempted:
            self._retire(rid)
        errors: dict[str, str] = {}
        prepared = self._take_slots(plan, errors)
        draft_seconds, q = 0.0, {}
        if self.draft is not None:  # fills `draft` of the chunks that plan draft positions
            draft_seconds, q = self.draft.run(plan, {c.request_id: seq for c, seq, _ in
                                                     prepared}, self.batch_invariant)
        groups, wants, scoring, num_out = self._lay_out(prepared)
        num_rows = sum(map(len, groups))
        # One llama_decode for the whole step (one per LoRA adapter in it).
        groups, adapters = self.adapters.group(
            groups, [c.request.sampling.lora for c, _, _ in prepared], not self.batch_invariant)
        job = MaskJob([c.request for c, _, _ in wants if not c.num_draft],
                      [(c.request, list(c.draft)) for c, _, _ in wants if c.num_draft])
        try:  # the grammar masks are computed while llama.cpp decodes
            logits = self._ctx.decode(groups, num_out, adapters)
        finally:
            masks = job.wait()
        errors.update(job.errors)
        for chunk, seq, _ in prepared:  # decoded: the slots now hold these positions
            self._length[seq] = chunk.start + chunk.num_new_tokens
        out = self._outputs(logits, wants, scoring, q, masks)
        seconds = time.perf_counter() - t0
        context = sum(c.start + c.num_new_tokens for c in plan.chunks)
        weights = self.weight_bytes
        if draft_seconds:
            weights += self.draft.weight_bytes * self.draft.last_passes
        timing = StepTiming(seconds, True, plan.num_prefill_tokens, plan.num_decode_tokens,
                            plan.num_pairs,
                            weights + context * self.kv_bytes_per_token(self.kv_format))
        self.timing.observe(num_rows, timing.num_pairs, seconds - draft_seconds)
        held = {b for blocks in self._blocks.values() for b in blocks}
        lost = tuple(sorted(self._lost - held))
        self._lost.clear()
        return StepResult(out.sampled, timing, errors=errors, logprobs=out.logprobs,
                          spec=out.spec, draft_seconds=draft_seconds,
                          prompt_logprobs=out.prompt_logprobs, lost_blocks=lost)

    def _take_slots(self, plan: SchedulerOutput, errors: dict[str, str]
                    ) -> list[tuple[ScheduledChunk, int, list[int]]]:
        """(chunk, its slot, the tokens its slot must recompute first) per chunk that got a
        slot; a chunk that did not gets a line in `errors`. Every rollback is cut first, so
        no copy takes stale positions."""
        for chunk in plan.chunks:
            seq = self._seq_of.get(chunk.request_id)
            if seq is not None:
                self._cut(seq, chunk.start)
        keep = {h for c in plan.chunks if c.start and c.request_id not in self._seq_of
                and (h := self._holder_of(c.block_table, c.start)) is not None}
        prepared = []
        for chunk in plan.chunks:
            try:
                prepared.append((chunk, *self._prepare(chunk, keep)))
            except NoSlotError as e:
                errors[chunk.request_id] = str(e)
        return prepared

    def _lay_out(self, prepared: list[tuple[ScheduledChunk, int, list[int]]]
                 ) -> tuple[list[list[Row]], list[tuple[ScheduledChunk, int, int]],
                            list[tuple[ScheduledChunk, int, range]], int]:
        """The step's rows, one group per chunk, and where their logits land: (groups,
        wants: (chunk, its first logits row, rows) per chunk that samples or verifies,
        scoring: (chunk, its first logits row, the positions) per chunk that scores prompt
        positions, logits rows in all). Records what each slot will hold."""
        groups: list[list[Row]] = []
        wants: list[tuple[ScheduledChunk, int, int]] = []
        scoring: list[tuple[ScheduledChunk, int, range]] = []
        num_out = 0
        for chunk, seq, redo in prepared:
            start, n, req = chunk.start, chunk.num_new_tokens, chunk.request
            tokens = [*req.token_slice(start, start + 1), *chunk.draft] if chunk.num_draft \
                else req.token_slice(start, start + n)
            outputs = n if chunk.num_draft else (1 if chunk.sample else 0)
            # Prompt positions to score come before the rows that sample (which sit at or
            # past the prompt's last token), so their logits rows come first.
            scored = chunk.prompt_scored
            if scored:
                scoring.append((chunk, num_out, scored))
            rows = [(t, pos, seq, -1) for pos, t in enumerate(redo, start - len(redo))]
            for i, tok in enumerate(tokens):
                pos = start + i
                if i >= n - outputs:
                    out = num_out + len(scored) + i - (n - outputs)
                elif pos in scored:
                    out = num_out + pos - scored.start
                else:
                    out = -1
                rows.append((tok, pos, seq, out))
            num_out += len(scored)
            if outputs:
                wants.append((chunk, num_out, outputs))
                num_out += outputs
            self._write(seq, chunk.block_table, start, start + n)
            self._running[chunk.request_id] = (req, chunk.block_table)
            groups.append(rows)
        return groups, wants, scoring, num_out

    def _outputs(self, logits, wants: list[tuple[ScheduledChunk, int, int]],
                 scoring: list[tuple[ScheduledChunk, int, range]], q: dict,
                 masks: dict) -> LogitsStage:
        """The step's sampled, verified and scored tokens from its logits rows."""
        out = LogitsStage(self.seed, self.info.eos_token_ids)
        plain = [(c, i) for c, i, _ in wants if not c.num_draft]
        if plain:
            at = [i for _, i in plain]
            # The usual step's rows lie in order: a view, not a 16 MB copy of Gemma's rows.
            out.sample(logits[at[0]:at[-1] + 1] if at == list(range(at[0], at[-1] + 1))
                       else logits[at], [c for c, _ in plain], masks)
        for c, i, k in wants:
            if c.num_draft:
                out.verify(c, logits[i:i + k], q.get(c.request_id), masks.get(c.request_id))
        for c, i, r in scoring:  # position q's logits score prompt token q + 1
            out.score(c, logits[i:i + len(r)])
        return out

    def propose(self, req, k: int, knobs) -> list[int]:
        """n-gram prompt lookup over the request's latest tokens (as the torch executor)."""
        return propose_for(req, k, knobs)

    def forget(self, request_id: str) -> None:
        """A finished request's sequence is retired: its cells stay while they hold blocks
        the prefix cache may hand out."""
        self._retire(request_id)

    def close(self) -> None:
        self._free_context()
        if self.draft is not None:
            self.draft.close()
        self._model.close()
