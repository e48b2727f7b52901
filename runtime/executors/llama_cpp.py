"""The `llama_cpp` executor: llama.cpp's kernels (CPU, CUDA, Metal) under kvdeck's scheduler.

One llama.cpp context holds every request, each as a *sequence id*; each engine step is one
`llama_batch` mixing decode rows, prefill chunks and speculative verify chunks across
sequences, with logits requested only for the rows that sample (or verify). kvdeck's shared
sampler (`runtime/sampling.py`) picks tokens from those logits, so seeds, stop strings,
logprobs and speculation behave as with the torch executor.

**KV: blocks and cells.** kvdeck's block manager stays the source of truth for admission,
capacity, sharing and the block map; llama.cpp keeps K and V in *cells*, one per (token
position, set of sequences), in one unified buffer. The context is sized from the pool:
`n_ctx = num_blocks × block_size` cells, so whatever the block manager admits fits (a
token the manager counts occupies at most one cell, and shared blocks share cells). Block
`b` of a request's table covers positions `[b·p, (b+1)·p)` of its sequence. The executor
remembers, per block id, the sequence whose cells hold that block's positions (its
*holder*):

- A request that starts past position 0 (a prefix-cache hit, a fork, a resumed request)
  gets those positions from the holders of its table's blocks with `llama_memory_seq_cp`,
  which shares the cells (no copy). Positions with no holder left are recomputed in the
  same batch (rows without logits), as a recompute would.
- Writing positions into a block makes the writing sequence its holder; a stale holder's
  cells for that block are dropped first (`llama_memory_seq_rm`), so dead cells never
  take room the manager has handed out again.
- A finished or preempted request's sequence is *retired*, not cleared: it holds the
  blocks the prefix cache may still hand out. It is cleared and its id reused once it
  holds no block; when ids run out, the retired sequence holding fewest blocks goes
  first (a later hit on its blocks recomputes them).
- Rolled-back speculative positions, and anything past a chunk's `start`, are removed
  from the sequence before the step writes there.

Sliding-window models keep full-length KV in every layer (`swa_full`), so a cached
prefix's cells stay valid for any request that shares it.

**KV formats** map to llama.cpp's `type_k`/`type_v`: `fp16` (F16), `q8_0`, `q4_0`
(quantized V needs flash attention, which is switched on for them). Changing the format
recreates the context; every sequence is then recomputed by its next step (the pause shows
as that step's time).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

from runtime.errors import ConfigError, ModelFileError, StepError
from runtime.executors.online_fit import OnlineFit
from runtime.models.gguf import read_gguf
from runtime.models.info import model_info_from_gguf
from runtime.plan import Conversion, SchedulerOutput, StepResult, StepTiming
from runtime.profiles import StepFit
from runtime.sampling import sample, sample_draft
from runtime.snapshot import WeightsView
from runtime.spec.ngram import propose_ngram
from runtime.spec.verify import verify_greedy
from runtime.tokenizer import quiet_stderr

log = logging.getLogger("kvdeck.llama_cpp")

KV_TYPES = {"fp16": "GGML_TYPE_F16", "q8_0": "GGML_TYPE_Q8_0", "q4_0": "GGML_TYPE_Q4_0"}
"""kvdeck KV format -> llama.cpp ggml type of K and V."""
SWA_FULL = True
"""Keep every layer's KV at full length, so a cached prefix's cells stay valid in
sliding-window layers for any request that shares it."""
EXTRA_BUFTS = True
KV_UNIFIED = True
MAX_SEQUENCES = 256
"""llama.cpp's limit on sequence ids in one context (LLAMA_MAX_SEQ)."""


def _lib():
    import llama_cpp  # imported here: loading the shared library takes a moment

    return llama_cpp


class LlamaCppExecutor:
    """Executor protocol implementation over llama-cpp-python's low-level API."""

    name = "llama_cpp"
    virtual_time = False
    draft_model_name = ""
    num_layers: int

    def __init__(self, model_path: str | Path, *, threads: int | None = None,
                 n_gpu_layers: int = 0, seed: int = 0, n_batch: int = 2048):
        """`n_gpu_layers`: layers offloaded to the GPU (Metal or CUDA builds; -1 all);
        `threads`: CPU threads (default: the machine's cores); `n_batch`: most tokens in
        one llama_batch (a step with more is decoded in several)."""
        L = _lib()
        self.model_path = Path(model_path)
        g = read_gguf(self.model_path)
        try:
            info = model_info_from_gguf(g)
            eos = [g.get("tokenizer.ggml.eos_token_id"), g.get("tokenizer.ggml.eot_token_id")]
        finally:
            g.close()
        self.info = info
        self.model_name = info.name
        self.max_model_len = info.context_length or 4096
        self.num_layers = info.num_layers
        self.seed = seed
        self.threads = threads or os.cpu_count() or 1
        self.n_batch = n_batch
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = n_gpu_layers
        mp.use_extra_bufts = EXTRA_BUFTS
        self.n_gpu_layers = n_gpu_layers
        t0 = time.perf_counter()
        with quiet_stderr():
            self._model = L.llama_model_load_from_file(str(self.model_path).encode(), mp)
        if not self._model:
            raise ModelFileError(f"llama.cpp could not load {self.model_path}; is it a GGUF "
                                 "model of an architecture llama.cpp supports?")
        self.load_seconds = time.perf_counter() - t0
        vocab = L.llama_model_get_vocab(self._model)
        self.vocab_size = L.llama_vocab_n_tokens(vocab)
        ids = [int(t) for t in eos if t is not None]
        ids += [t for t in (L.llama_vocab_eos(vocab), L.llama_vocab_eot(vocab)) if t >= 0]
        self.eos_token_ids = tuple(dict.fromkeys(ids))
        self.weight_bytes = int(L.llama_model_size(self._model))
        self.kv_formats = tuple(KV_TYPES)
        self.weight_formats = {"attn": "dense", "ffn": "dense", "head": "dense"}
        """`dense` here means the GGUF's own (quantized) tensors, as llama.cpp runs them."""
        self.link_bandwidth = 1e12 if n_gpu_layers == 0 else 25e9
        self.link_detail = "none (llama.cpp keeps KV in its context)"
        self.offload_gain_bytes = 0
        self._ctx = None
        self._batch = None
        self._mem = None
        self.kv_format = "fp16"
        self.block_size = 16
        self.num_blocks = 0
        # Sequences: request id -> seq id; seq id -> positions held; block id -> holder.
        self._seq_of: dict[str, int] = {}
        self._length: dict[int, int] = {}
        self._holder: dict[int, int] = {}
        """Block id -> the sequence whose cells hold its positions."""
        self._holds: dict[int, set[int]] = {}
        """Seq id -> the block ids it holds (the inverse of `_holder`)."""
        self._retired: dict[int, None] = {}
        """Sequences of finished or preempted requests, oldest first."""
        self._free_ids: list[int] = []
        self.timing = OnlineFit(StepFit(self.weight_bytes / 12e9,
                                        2.0 * self.weight_bytes / 0.6 / 50e9, 1e-9))

    # -- context ----------------------------------------------------------------------------

    def kv_bytes_per_token(self, kv_format: str) -> int:
        if kv_format not in KV_TYPES:
            raise ConfigError(f"kv_format {kv_format!r} is not one llama.cpp stores; the "
                              f"llama_cpp executor takes {', '.join(KV_TYPES)}.")
        return self.info.kv_bytes_per_token(kv_format)

    def draft_kv_bytes_per_token(self, kv_format: str) -> int:
        return 0

    def estimate_draft_seconds(self, num_rows: int) -> float:
        return 0.0

    def bind_kv(self, num_blocks: int, block_size: int, kv_format: str) -> None:
        """(Re)create the context: `num_blocks × block_size` cells of `kv_format`, as many
        sequence ids as llama.cpp allows; every sequence starts empty."""
        L = _lib()
        self.kv_bytes_per_token(kv_format)  # refuses what llama.cpp cannot store
        self._free_context()
        cp = L.llama_context_default_params()
        cp.n_ctx = num_blocks * block_size
        cp.n_batch = cp.n_ubatch = min(self.n_batch, cp.n_ctx)
        cp.n_seq_max = MAX_SEQUENCES
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.kv_unified = KV_UNIFIED  # one pool for all sequences, as kvdeck's block pool is
        cp.swa_full = SWA_FULL
        cp.no_perf = True
        t = getattr(L, KV_TYPES[kv_format])
        cp.type_k = cp.type_v = t
        # Flash attention only where a quantized V cache needs it: llama-cpp-python's own
        # generation runs without it, and greedy outputs then agree token for token.
        cp.flash_attn_type = 0 if kv_format == "fp16" else 1
        with quiet_stderr():
            self._ctx = L.llama_init_from_model(self._model, cp)
        if not self._ctx:
            raise ConfigError(f"llama.cpp could not create a context of {cp.n_ctx:,} cells in "
                              f"{kv_format}; lower the KV budget or use another kv_format.")
        self._mem = L.llama_get_memory(self._ctx)
        self._batch = L.llama_batch_init(cp.n_batch, 0, 1)
        self._batch_size = cp.n_batch
        self.kv_format, self.block_size, self.num_blocks = kv_format, block_size, num_blocks
        self._seq_of.clear()
        self._length.clear()
        self._holder.clear()
        self._holds.clear()
        self._retired.clear()
        self._free_ids = list(range(MAX_SEQUENCES - 1, -1, -1))

    def _free_context(self) -> None:
        L = _lib()
        if self._batch is not None:
            L.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            L.llama_free(self._ctx)
            self._ctx = self._mem = None

    def convert_kv(self, kv_format: str, num_blocks: int, src: list[int], dst: list[int]
                   ) -> Conversion:
        """A new context in `kv_format`; running requests recompute their KV on their next
        step (llama.cpp cannot re-encode cells in place)."""
        t0 = time.perf_counter()
        moved = len(src) * self.block_size
        before = moved * self.info.kv_bytes_per_token(self.kv_format)
        self.bind_kv(num_blocks, self.block_size, kv_format)
        return Conversion(time.perf_counter() - t0, True, before,
                          moved * self.info.kv_bytes_per_token(kv_format))

    def bind_host_kv(self, num_blocks: int) -> None:
        if num_blocks:
            raise ConfigError("The llama_cpp executor has no host KV tier (llama.cpp keeps "
                              "KV in its context); set host_kv_memory_bytes to 0 or use the "
                              "torch executor.")

    def set_offload(self, num_layers: int, num_buffers: int) -> Conversion:
        if num_layers:
            raise ConfigError("offload_layers is a torch-executor knob; with llama_cpp, "
                              "place layers with --n-gpu-layers.")
        return Conversion(0.0, True, self.weight_bytes, self.weight_bytes)

    def describe_offload(self) -> str:
        return ""

    def resolve_weight_formats(self, text: str, current: dict[str, str] | None = None
                               ) -> dict[str, str]:
        if text.strip() in ("dense", "measured"):
            return dict(self.weight_formats)
        raise ConfigError(f"weight_format {text!r}: the llama_cpp executor runs the GGUF's "
                          "own quantized weights (weight_format dense); re-packing them is a "
                          "torch-executor knob.")

    def set_weight_formats(self, formats: dict[str, str]) -> Conversion:
        return Conversion(0.0, True, self.weight_bytes, self.weight_bytes)

    def describe_weights(self, kv_format: str) -> WeightsView:
        types = ", ".join(t.type_name for t in self.info.tensor_types[:3])
        where = "CPU" if self.n_gpu_layers == 0 else f"{self.n_gpu_layers} layers on the GPU"
        return WeightsView("dense", self.weight_bytes, f"llama.cpp, the GGUF's own {types}; "
                           f"{where}", (), ())

    def auto_choice(self) -> str:
        return ""

    def estimate_step_seconds(self, num_new_tokens: int, num_pairs: int,
                              num_context_tokens: int) -> float:
        return self.timing.seconds(num_new_tokens, num_pairs)

    @property
    def fit(self) -> StepFit:
        return self.timing.fit

    # -- sequences --------------------------------------------------------------------------

    def _new_seq(self) -> int:
        if not self._free_ids:
            # Out of ids: give up the retired sequence holding fewest blocks.
            victim = min(self._retired, key=lambda s: len(self._holds.get(s, ())))
            self._drop(victim)
        seq = self._free_ids.pop()
        self._length[seq] = 0
        return seq

    def _drop(self, seq: int) -> None:
        """Clear a retired sequence's cells and free its id."""
        _lib().llama_memory_seq_rm(self._mem, seq, -1, -1)
        for block in self._holds.pop(seq, ()):
            if self._holder.get(block) == seq:
                del self._holder[block]
        self._retired.pop(seq, None)
        self._length.pop(seq, None)
        self._free_ids.append(seq)

    def _retire(self, request_id: str) -> None:
        seq = self._seq_of.pop(request_id, None)
        if seq is None:
            return
        if self._holds.get(seq):
            self._retired[seq] = None
        else:
            self._drop(seq)

    def _hold(self, seq: int, block: int, start: int) -> None:
        """`seq` now holds block `block` (positions from `start`); a stale holder's cells
        for it go first."""
        old = self._holder.get(block)
        if old == seq:
            return
        if old is not None:
            _lib().llama_memory_seq_rm(self._mem, old, start, start + self.block_size)
            held = self._holds[old]
            held.discard(block)
            if not held and old in self._retired:
                self._drop(old)
        self._holder[block] = seq
        self._holds.setdefault(seq, set()).add(block)

    def _prepare(self, chunk, rows: list[tuple[int, int, int, bool]]) -> int:
        """Bring the chunk's sequence to exactly `chunk.start` positions: cut what is past
        it, share what holders have, and queue rows (token, position, seq, no logits) for
        what nobody has. Returns the seq id."""
        L = _lib()
        rid = chunk.request_id
        seq = self._seq_of.get(rid)
        if seq is None:
            seq = self._seq_of[rid] = self._new_seq()
        have, start, p = self._length[seq], chunk.start, self.block_size
        if have > start:  # rolled back (speculation) or recomputing from earlier
            L.llama_memory_seq_rm(self._mem, seq, start, -1)
            have = start
        table = chunk.block_table
        while have < start:
            b = have // p
            holder = self._holder.get(table[b])
            end = min((b + 1) * p, start)
            if holder is None or holder == seq or self._length.get(holder, 0) < end:
                break
            L.llama_memory_seq_cp(self._mem, holder, seq, have, end)
            have = end
        if have < start:  # nobody holds these positions any more: recompute them
            tokens = chunk.request.token_slice(have, start)
            rows.extend((t, pos, seq, False) for pos, t in enumerate(tokens, have))
            for b in range(have // p, -(-start // p)):
                self._hold(seq, table[b], b * p)
        self._length[seq] = start
        return seq

    # -- the step ---------------------------------------------------------------------------

    def execute(self, plan: SchedulerOutput) -> StepResult:
        assert self._ctx is not None, "bind_kv must run before execute"
        L = _lib()
        t0 = time.perf_counter()
        for rid in plan.preempted:
            self._retire(rid)
        rows: list[tuple[int, int, int, bool]] = []
        wants: list[tuple[object, int, int]] = []
        """(chunk, first output index, outputs) per chunk that samples or verifies."""
        num_out = 0
        p = self.block_size
        for chunk in plan.chunks:
            seq = self._prepare(chunk, rows)
            start, n = chunk.start, chunk.num_new_tokens
            req = chunk.request
            tokens = [*req.token_slice(start, start + 1), *chunk.draft] if chunk.num_draft \
                else req.token_slice(start, start + n)
            for b in range(start // p, (start + n - 1) // p + 1):
                self._hold(seq, chunk.block_table[b], b * p)
            outputs = n if chunk.num_draft else (1 if chunk.sample else 0)
            for i, tok in enumerate(tokens):
                rows.append((tok, start + i, seq, i >= n - outputs))
            if outputs:
                wants.append((chunk, num_out, outputs))
                num_out += outputs
            self._length[seq] = start + n
        logits = self._decode(rows, num_out)
        sampled: dict[str, int] = {}
        logprobs: dict = {}
        spec: dict[str, list[int]] = {}
        plain = [(c, i) for c, i, _ in wants if not c.num_draft]
        if plain:
            reqs = [c.request for c, _ in plain]
            toks, lps = sample(logits[[i for _, i in plain]], reqs, self.seed)
            for (c, _), tok, lp in zip(plain, toks, lps, strict=True):
                sampled[c.request_id] = tok
                if lp is not None:
                    logprobs[c.request_id] = lp
        for c, i, k in wants:
            if not c.num_draft:
                continue
            rows_logits = logits[i:i + k]
            if c.request.sampling.temperature == 0.0:
                spec[c.request_id] = verify_greedy(rows_logits.argmax(-1).tolist(),
                                                   list(c.draft))[0]
            else:
                spec[c.request_id] = sample_draft(rows_logits, c.request, list(c.draft),
                                                  self.seed)
        seconds = time.perf_counter() - t0
        context = sum(c.start + c.num_new_tokens for c in plan.chunks)
        timing = StepTiming(seconds, True, plan.num_prefill_tokens, plan.num_decode_tokens,
                            plan.num_pairs,
                            self.weight_bytes + context * self.kv_bytes_per_token(self.kv_format))
        self.timing.observe(len(rows), timing.num_pairs, seconds)
        del L
        return StepResult(sampled, timing, logprobs=logprobs, spec=spec)

    def _decode(self, rows: list[tuple[int, int, int, bool]], num_out: int) -> torch.Tensor:
        """Decode `rows` (token, position, seq, logits wanted) in batches of at most
        `n_batch` tokens; the wanted logits, in row order, as a float32 tensor."""
        L = _lib()
        out = np.empty((num_out, self.vocab_size), dtype=np.float32)
        filled = 0
        batch = self._batch
        for first in range(0, len(rows), self._batch_size):
            part = rows[first:first + self._batch_size]
            batch.n_tokens = len(part)
            outs = []
            for i, (tok, pos, seq, want) in enumerate(part):
                batch.token[i] = tok
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = want
                if want:
                    outs.append(i)
            rc = L.llama_decode(self._ctx, batch)
            if rc != 0:
                raise StepError(f"llama.cpp could not decode the step (llama_decode returned "
                                f"{rc}: {'no free cells' if rc == 1 else 'error'}).")
            for i in outs:
                ptr = L.llama_get_logits_ith(self._ctx, i)
                out[filled] = np.ctypeslib.as_array(
                    ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.vocab_size,))
                filled += 1
        return torch.from_numpy(out)

    def propose(self, req, k: int, knobs) -> list[int]:
        """n-gram prompt lookup over the request's latest tokens (as the torch executor)."""
        n = req.num_tokens
        return propose_ngram(req.token_slice(max(n - 4096, 0), n), k, knobs.prompt_lookup_max)

    def forget(self, request_id: str) -> None:
        """A finished request's sequence is retired: its cells stay while they hold blocks
        the prefix cache may hand out."""
        self._retire(request_id)

    def close(self) -> None:
        self._free_context()
        if self._model is not None:
            _lib().llama_model_free(self._model)
            self._model = None
