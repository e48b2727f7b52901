"""The `draft` proposer: a second, smaller GGUF model that shares the target's tokenizer
and drafts `k` tokens for each speculating request at the start of the step, before the
target verifies them in its one forward pass (`TorchExecutor`). Its time is part of the
step's measured time.

**KV.** The draft's KV is paged in the engine's block manager: every block id names a
target block and its *twin* in the draft's own pool (the draft's layers, heads and head
size; the target's KV format). The block manager allocates, shares, copies on write,
truncates and frees one id for both, and the engine sizes the pool from their summed bytes
per token, so the draft's KV is accounted (and shown in the KV map) beside the target's.
Transfers to the host tier move the target's part only; a swapped request's draft KV is
recomputed on its return.

**Keeping up.** The draft's KV of a request is valid up to `done[request]` positions. Under
`speculative_method = draft` every chunk the target computes is also run through the draft
in the same step (a prefill chunk's tokens, a decode row), so a request's draft KV is ready
when it first drafts; where it is behind (a prefix-cache hit, a preemption, speculation
switched on mid-run) it catches up in the first draft pass. Rejected drafts are rolled back
by clamping `done` to the tokens the target kept. Catching up over a block shared with
another request rewrites the same tokens' KV (same values, up to floating-point order).

**Drafting.** Pass 1 carries each speculating request's catch-up rows and its last known
token, and samples draft token 1; pass `j` carries draft token `j − 1` of the requests
drafting at least `j`, and samples token `j`. Greedy requests draft the argmax; sampling
requests draw from the draft's distribution `q` under their temperature, top-k and top-p
(from a generator seeded per request and position), and `q` goes to verification
(`verify.py`), which keeps the output distribution the target's.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from kvdeck.runtime.core.step_data import SchedulerOutput
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.kv_codecs import get_codec
from kvdeck.runtime.executors.online_fit import OnlineFit
from kvdeck.runtime.executors.paged_kv import BatchRow, PagedBatch, PagedKVCache, paged_attention
from kvdeck.runtime.models.architectures import model_config
from kvdeck.runtime.models.gguf import GGUFFile, read_gguf
from kvdeck.runtime.models.transformer import Transformer
from kvdeck.runtime.models.weights import load_tensors
from kvdeck.runtime.planning.profiles import StepFit
from kvdeck.runtime.text.sampling import draw, request_generator, sampling_probs

DRAFT_SALT = 0x5DEECE66D
"""Keeps the draft's random draws apart from the verifier's for the same request."""


def drafting_state(by_id: dict) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
    """For the drafting chunks `by_id` (request id -> chunk): each request's draft tokens so
    far (none), and, for sampling requests only, the draft's distributions `q` so far."""
    drafts: dict[str, list[int]] = {rid: [] for rid in by_id}
    q: dict[str, list[torch.Tensor]] = {rid: [] for rid, c in by_id.items()
                                       if c.request.sampling.temperature > 0}
    return drafts, q


def draft_generators(by_id: dict, q: dict, base_seed: int) -> dict[str, torch.Generator]:
    """A generator per sampling request, seeded per request and kept apart from the
    verifier's draws (`DRAFT_SALT`)."""
    return {rid: request_generator(by_id[rid].request, base_seed, DRAFT_SALT) for rid in q}


def check_vocabulary(draft: GGUFFile, target: GGUFFile) -> None:
    """Refuse a draft whose tokenizer differs from the target's, in one sentence naming both
    (speculation compares token ids, so the two vocabularies must be the same list)."""
    def name(g: GGUFFile) -> str:
        return f"{g.get('general.name', g.path.stem)} ({g.path.name})"
    a, b = draft.strings("tokenizer.ggml.tokens"), target.strings("tokenizer.ggml.tokens")
    if a == b and draft.get("tokenizer.ggml.model") == target.get("tokenizer.ggml.model"):
        return
    if len(a) != len(b):
        why = f"{len(a):,} tokens against {len(b):,}"
    elif a != b:
        i = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        why = f"token {i:,} is {a[i]!r} in one and {b[i]!r} in the other"
    else:
        why = (f"tokenizer {draft.get('tokenizer.ggml.model')!r} against "
               f"{target.get('tokenizer.ggml.model')!r}")
    raise ConfigError(f"The draft model {name(draft)} and the target {name(target)} have "
                      f"different vocabularies ({why}); a draft model must share the "
                      "target's tokenizer.")


class DraftModel:
    """A draft model on the target executor's device, with its twin KV pool."""

    holes = False
    """Its tables have holes where token-level eviction dropped blocks (`kv/eviction.py`)."""

    def __init__(self, path: str | Path, target: GGUFFile, device: torch.device,
                 dtype: torch.dtype, base_seed: int = 0):
        self.path = Path(path)
        g = read_gguf(self.path)
        try:
            check_vocabulary(g, target)
            self.cfg = model_config(g)
            self.model = Transformer(self.cfg, load_tensors(g, dtype, device))
        finally:
            g.close()
        # Greedy drafts take the int8-shortlisted argmax, as the target's decoding does.
        self.model.update_shortlist(device.type == "cpu")
        self.device = device
        self.base_seed = base_seed
        info = self.cfg.info
        self.name = info.name
        self.weight_bytes = self.model.matrix_weight_bytes
        self._windows = {self.cfg.window(i) for i in range(info.num_layers)}
        self.kv: PagedKVCache | None = None
        self.done: dict[str, int] = {}
        """Request id -> positions whose draft KV is valid."""
        self.timing = OnlineFit(StepFit(self.weight_bytes / 12e9,
                                        2.0 * self.model.matrix_params / 50e9, 0.0))
        """Time of one draft pass by rows (learned from measured passes)."""
        self.last_passes = 0
        self.last_seconds = 0.0

    def kv_bytes_per_token(self, kv_format: str) -> int:
        """Bytes of the twin KV per token in `kv_format` (refusing one the draft's head
        size cannot store)."""
        get_codec(kv_format, self.cfg.info.head_dim, self.device)
        return self.cfg.info.kv_bytes_per_token(kv_format)

    def bind(self, num_blocks: int, block_size: int, kv_format: str) -> None:
        """(Re)create the twin pool: `num_blocks` blocks like the target's, in `kv_format`;
        draft progress is forgotten (block ids no longer mean what they did)."""
        info = self.cfg.info
        self.kv = None
        self.kv = PagedKVCache(info.num_layers, num_blocks, block_size, info.num_kv_heads,
                               info.head_dim, get_codec(kv_format, info.head_dim, self.device),
                               self.device)
        self.done.clear()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of the twins of the target's copied blocks."""
        assert self.kv is not None
        self.kv.copy_blocks(pairs)

    def forget(self, request_id: str) -> None:
        self.done.pop(request_id, None)

    def pass_seconds(self, rows: int) -> float:
        """Predicted time of one draft pass over `rows` rows (short contexts)."""
        return self.timing.seconds(rows, rows)

    @torch.inference_mode()
    def run(self, plan: SchedulerOutput) -> tuple[float, dict[str, torch.Tensor]]:
        """Fill `draft` of every chunk that plans draft positions without tokens, keeping
        up with the plan's other chunks under `speculative_method = draft`. Returns the
        seconds spent and, per sampling request, the draft's distributions `q` [k, vocab]."""
        assert self.kv is not None, "bind must run before run"
        t0 = time.perf_counter()
        for rid in plan.preempted:  # recomputed or swapped: the twins are gone
            self.done.pop(rid, None)
        drafting = [c for c in plan.chunks if c.num_draft and not c.draft]
        keep_up = plan.speculative_method == "draft"
        self.last_passes = 0
        if not drafting and not keep_up:
            self.last_seconds = 0.0
            return 0.0, {}
        rows: list[BatchRow] = []
        for c in plan.chunks:
            wants = c.num_draft and not c.draft
            if not (wants or keep_up):
                continue
            rid = c.request_id
            done = min(self.done.get(rid, 0), c.start)
            end = c.start + 1 if c.num_draft else c.start + c.num_new_tokens
            if end > done:
                rows.append(BatchRow(c.request.token_slice(done, end), done, c.block_table,
                                     rid if wants else None))
            self.done[rid] = end
        if not rows:
            self.last_seconds = 0.0
            return 0.0, {}
        by_id = {c.request_id: c for c in drafting}
        drafts, q = drafting_state(by_id)
        gens = draft_generators(by_id, q, self.base_seed)
        j = 1
        while rows:
            ids, hidden = self._forward(rows)
            for rid, token in zip(ids, self._pick(ids, hidden, by_id, q, gens), strict=True):
                drafts[rid].append(token)
            j += 1
            rows = []
            for rid in ids:
                c = by_id[rid]
                if c.num_draft >= j:
                    pos = c.start + j - 1
                    rows.append(BatchRow([drafts[rid][-1]], pos, c.block_table, rid))
                    self.done[rid] = pos + 1
        for rid, c in by_id.items():
            c.draft = tuple(drafts[rid])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_seconds = time.perf_counter() - t0
        return self.last_seconds, {rid: torch.stack(rows_q) for rid, rows_q in q.items()}

    def _forward(self, rows: list[BatchRow]) -> tuple[list[str], torch.Tensor]:
        """One draft pass: (ids of the rows that sample, their final hidden states)."""
        t0 = time.perf_counter()
        batch = PagedBatch.from_rows(rows, self.kv.block_size, self._windows, self.device,
                                     holes=self.holes)
        cfg, kv = self.cfg, self.kv

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
            return paged_attention(kv, batch, layer, cfg.window(layer), cfg.attn_scale, q, k, v)

        hidden = self.model.forward(batch.tokens, batch.positions, attend)[batch.sample_rows]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        n = batch.tokens.numel()
        self.timing.observe(n, n, time.perf_counter() - t0)
        self.last_passes += 1
        return batch.sample_ids, hidden

    def _pick(self, ids: list[str], hidden: torch.Tensor, by_id: dict, q: dict,
              gens: dict) -> list[int]:
        """Each row's draft token: the argmax for greedy requests, a draw from `q` (kept
        for verification) for sampling ones."""
        greedy = [i for i, rid in enumerate(ids) if rid not in q]
        out = [0] * len(ids)
        if greedy:
            for i, t in zip(greedy, self.model.argmax_tokens(hidden[greedy]), strict=True):
                out[i] = t
        sampling = [i for i, rid in enumerate(ids) if rid in q]
        if sampling:
            logits = self.model.logits(hidden[sampling]).float().cpu()
            for row, i in zip(logits, sampling, strict=True):
                rid = ids[i]
                sp = by_id[rid].request.sampling
                probs = sampling_probs(row, sp)
                out[i] = draw(probs, gens[rid])
                q[rid].append(probs)
        return out
