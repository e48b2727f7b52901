"""What admission refuses: a request the pool can never hold, and (with
`admission_control`) one whose admission the finish-time forecast says would make it or a
running request miss a deadline (`core/forecast.py`)."""

from __future__ import annotations

from kvdeck.runtime.core.config import Knobs
from kvdeck.runtime.core.forecast import Job, forecast
from kvdeck.runtime.core.request import Request
from kvdeck.runtime.core.step_data import Estimator
from kvdeck.runtime.kv.manager import BlockManager


def never_fits(req: Request, full: bool, kv: BlockManager, chunk_size: int) -> str | None:
    """A reason the request can never be admitted with this pool, or None (`full`: the
    pool reserves prompt + max_tokens at admission)."""
    tokens = req.max_total_tokens if full else req.num_tokens
    need = kv.pages_for(tokens, chunk_size, full)
    if need > kv.num_blocks:
        what = "prompt + max_tokens − 1" if full else "its prompt"
        unit = "pages (full-attention and window blocks)" if kv.groups else "blocks"
        hint = "" if full or kv.groups else \
            f" (under {kv.eviction.policy.mode} eviction it holds what is kept and a chunk of "\
            f"{chunk_size:,} tokens: lower --kv-recent-tokens or --chunk-size)" \
            if kv.eviction.on else \
            " (token-level eviction, --kv-eviction sink-window, would run it lossily)"
        return (f"needs {need:,} KV {unit} for {what} ({tokens:,} tokens) but the pool "
                f"has {kv.num_blocks:,} {unit.split()[0]} of {kv.block_size} tokens{hint}")
    return None


def lora_slot_limit(req: Request, running: list[Request], max_loras: int) -> str | None:
    """Why `req` must wait, when its LoRA adapter would take a slot and the running
    requests' adapters hold all `max_loras` of them (vLLM's rule: at most that many adapters
    in one batch); None when it may go on (no adapter, no limit, or its adapter's slot)."""
    lora = req.sampling.lora
    if not lora or not max_loras:
        return None
    held = {r.sampling.lora for r in running if r.sampling.lora}
    if lora in held or len(held) < max_loras:
        return None
    return f"LoRA slots (max_loras {max_loras}): {lora} waits for one"


def job(r: Request, computed: int | None = None) -> Job:
    """`r` as the forecast sees it (`computed`: its tokens reused at admission)."""
    return Job(r.request_id, r.num_computed_tokens if computed is None else computed,
               r.num_tokens, r.sampling.max_tokens - r.num_output_tokens, r.deadline)


class DeadlineAdmission:
    """Admission control's forecast: runs the batch forward on the timing model."""

    def __init__(self, estimate: Estimator, block_size: int):
        self.estimate = estimate
        self.block_size = block_size

    def _forecast(self, jobs: list[Job], now: float, k: Knobs) -> dict[str, float]:
        return forecast(jobs, now, self.estimate, token_budget=k.max_num_batched_tokens,
                        chunk_size=k.chunk_size, max_num_seqs=k.max_num_seqs,
                        itl_target_s=k.itl_target_ms / 1e3, block_size=self.block_size)

    def judge(self, req: Request, hit: int, running: list[Request], now: float, k: Knobs
              ) -> tuple[dict[str, float], str | None]:
        """(predicted finish of every running request and `req` if it is admitted now, why
        it may not be — None when it and every running request with a deadline are
        forecast to finish in time). The forecast runs the running batch, this step's
        admissions included, plus `req` forward on the timing model. A running request
        forecast to miss even without the newcomer (admitted before admission control was
        on) does not block admissions."""
        jobs = [job(r) for r in running]
        finish = self._forecast([*jobs, job(req, hit)], now, k)
        mine = finish.get(req.request_id, now)
        if req.deadline is not None and mine > req.deadline:
            return finish, (f"cannot meet its deadline: forecast finish "
                            f"{mine - req.arrival_time:.2f} s after arrival, deadline "
                            f"{req.deadline - req.arrival_time:.2f} s")
        late = [j for j in jobs if j.deadline is not None and
                finish.get(j.request_id, now) > j.deadline]
        if late:
            alone = self._forecast(jobs, now, k)
            for j in late:
                if alone.get(j.request_id, now) <= j.deadline:
                    return finish, (f"admitting it would make {j.request_id} miss its "
                                    f"deadline (forecast finish {finish[j.request_id] - now:.2f}"
                                    f" s from now, deadline in {j.deadline - now:.2f} s)")
        return finish, None
