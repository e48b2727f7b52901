"""The `draft` proposer for the `llama_cpp` executor: a second GGUF, sharing the target's
tokenizer, in a llama.cpp context of its own with the same slots as the target's.

Slot `s` of the draft's context holds the draft model's KV of the request the target runs
in slot `s`, valid up to `length[s]` positions. The target tells the draft what happens to
its streams (a slot cleared, a prefix copied from a holder slot, positions rolled back), so
the two stay aligned. Under `speculative_method = draft` every chunk the target computes is
also run through the draft in the same step, so a request's draft KV is ready when it first
drafts; where it is behind (a prefix that was recomputed, a KV-format switch, speculation
switched on mid-run) it catches up in the first draft pass.

Drafting follows `runtime/spec/draft_model.py`: pass 1 carries each speculating request's
catch-up rows and its last known token and samples draft token 1; pass `j` carries draft
token `j − 1`. Greedy requests draft the argmax; sampling requests draw from the draft's
distribution `q` (kept for verification) from a generator seeded per request. The pool's
memory is accounted as in the torch executor: the engine sizes blocks from the target's and
the draft's bytes per token together, and the draft's context has as many cells as the
target's.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from kvdeck.runtime.core.step_data import SchedulerOutput
from kvdeck.runtime.executors.llama_cpp_context import LlamaContext, LlamaModel, Row, one_batch
from kvdeck.runtime.executors.online_fit import OnlineFit
from kvdeck.runtime.models.gguf import read_gguf
from kvdeck.runtime.models.info import model_info_from_gguf
from kvdeck.runtime.planning.profiles import StepFit
from kvdeck.runtime.spec.draft_model import check_vocabulary, draft_generators, drafting_state
from kvdeck.runtime.text.sampling import draw, sampling_probs


class LlamaDraft:
    """A draft model in its own llama.cpp context, slot for slot beside the target's."""

    def __init__(self, path: str | Path, target_path: Path, n_gpu_layers: int,
                 base_seed: int = 0, *, repack: bool):
        self.path = Path(path)
        g, t = read_gguf(self.path), read_gguf(target_path)
        try:
            check_vocabulary(g, t)
            self.info = model_info_from_gguf(g)
        finally:
            g.close()
            t.close()
        self.name = self.info.name
        self.model = LlamaModel(self.path, n_gpu_layers, repack)
        self.weight_bytes = self.model.weight_bytes
        self.base_seed = base_seed
        self.ctx: LlamaContext | None = None
        self.length: dict[int, int] = {}
        """Slot -> positions its draft stream holds."""
        self.timing = OnlineFit(StepFit(self.weight_bytes / 12e9,
                                        2.0 * self.weight_bytes / 0.6 / 50e9, 0.0))
        """Time of one draft pass by rows (learned from measured passes)."""
        self.last_passes = 0

    def kv_bytes_per_token(self, kv_format: str) -> int:
        return self.info.kv_bytes_per_token(kv_format)

    def bind(self, n_ctx: int, n_parallel: int, threads: int, n_batch: int,
             kv_format: str) -> None:
        """(Re)create the draft's context like the target's; every stream starts empty."""
        self.close_context()
        self.ctx = LlamaContext(self.model, n_ctx, n_parallel, threads, n_batch, kv_format)
        self.length.clear()

    # -- what the target did to its streams ---------------------------------------------

    def cleared(self, seq: int) -> None:
        if self.length.pop(seq, 0):
            self.ctx.remove(seq)

    def copied(self, src: int, dst: int, start: int) -> None:
        """The target copied `src`'s stream into `dst`, cut at `start`: so does the draft,
        as far as `src`'s draft stream goes."""
        have = min(self.length.get(src, 0), start)
        self.cleared(dst)
        if have:
            self.ctx.copy_stream(src, dst, have)
            self.length[dst] = have

    def cut(self, seq: int, start: int) -> None:
        """The target dropped positions `start`.. of slot `seq`."""
        if self.length.get(seq, 0) > start:
            self.ctx.remove(seq, start)
            self.length[seq] = start

    # -- drafting ---------------------------------------------------------------------------

    def pass_seconds(self, rows: int) -> float:
        return self.timing.seconds(rows, rows)

    def run(self, plan: SchedulerOutput, slots: dict[str, int], batch_invariant: bool
            ) -> tuple[float, dict[str, torch.Tensor]]:
        """Fill `draft` of every chunk that plans draft positions without tokens (their
        requests run in `slots`), keeping up with the plan's other chunks under
        `speculative_method = draft`. Returns the seconds spent and, per sampling request,
        the draft's distributions `q` [k, vocab]."""
        t0 = time.perf_counter()
        self.last_passes = 0
        drafting = [c for c in plan.chunks if c.num_draft and not c.draft
                    and c.request_id in slots]
        keep_up = plan.speculative_method == "draft"
        if not drafting and not keep_up:
            return 0.0, {}
        by_id = {c.request_id: c for c in drafting}
        groups: list[list[Row]] = []
        order: list[str] = []
        for c in plan.chunks:
            wants = c.request_id in by_id
            seq = slots.get(c.request_id)
            if seq is None or not (wants or keep_up):
                continue
            self.cut(seq, c.start)
            have = self.length.get(seq, 0)
            end = c.start + 1 if c.num_draft else c.start + c.num_new_tokens
            tokens = c.request.token_slice(have, end)
            rows = [(t, pos, seq, -1) for pos, t in enumerate(tokens, have)]
            if wants:
                rows[-1] = (*rows[-1][:3], len(order))
                order.append(c.request_id)
            self.length[seq] = end
            if rows:
                groups.append(rows)
        if not batch_invariant:
            groups = one_batch(groups)
        drafts, q = drafting_state(by_id)
        gens = draft_generators(by_id, q, self.base_seed)
        j = 1
        while groups:
            logits = self._pass(groups, len(order))
            for rid, row in zip(order, logits, strict=True):
                drafts[rid].append(self._pick(rid, row, by_id, q, gens))
            j += 1
            rows = []
            for rid in order:
                c = by_id[rid]
                if c.num_draft >= j:
                    seq = slots[rid]
                    pos = c.start + j - 1
                    rows.append((drafts[rid][-1], pos, seq, len(rows)))
                    self.length[seq] = pos + 1
            order = [rid for rid in order if by_id[rid].num_draft >= j]
            groups = [[r] for r in rows] if batch_invariant else one_batch([rows])
        for rid, c in by_id.items():
            c.draft = tuple(drafts[rid])
        return time.perf_counter() - t0, {rid: torch.stack(v) for rid, v in q.items()}

    def _pass(self, groups: list[list[Row]], num_out: int) -> torch.Tensor:
        t0 = time.perf_counter()
        logits = self.ctx.decode(groups, num_out)
        n = sum(map(len, groups))
        self.timing.observe(n, n, time.perf_counter() - t0)
        self.last_passes += 1
        return logits

    def _pick(self, rid: str, row: torch.Tensor, by_id: dict, q: dict, gens: dict) -> int:
        """A greedy request's argmax, or a sampling request's draw from `q`."""
        if rid not in q:
            return int(row.argmax())
        probs = sampling_probs(row, by_id[rid].request.sampling)
        q[rid].append(probs)
        return draw(probs, gens[rid])

    def close_context(self) -> None:
        if self.ctx is not None:
            self.ctx.close()
            self.ctx = None

    def close(self) -> None:
        self.close_context()
        self.model.close()
