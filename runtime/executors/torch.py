"""The `torch` executor: a GGUF model's forward pass in PyTorch over a paged KV pool.

Runs on CUDA when present (bf16 compute), else on the CPU (fp32: on CPUs without native
bf16 matmul — AVX2 machines — bf16 measured 8× slower than fp32), best-effort on MPS.
Every step reports its measured wall time (CUDA-synchronized) and the bytes it read: matrix
weights once plus each row's KV context, for comparison with the machine's bandwidth.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from runtime.errors import ConfigError, StepError
from runtime.executors.kv_codecs import get_codec, kv_formats_for
from runtime.executors.paged_kv import PagedBatch, PagedKVCache, paged_attention
from runtime.models.arch import ModelConfig, model_config
from runtime.models.gguf import read_gguf
from runtime.models.linear import Int8Linear, Linear
from runtime.models.transformer import Transformer
from runtime.models.weights import load_tensors
from runtime.plan import Conversion, SchedulerOutput, StepResult, StepTiming
from runtime.profiles import StepFit
from runtime.sampling import sample

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "int8": torch.float32, "int8-head": torch.float32}
"""Compute dtypes. `int8` keeps fp32 activations with int8 matrices (CPU, FBGEMM);
`int8-head` does so for the output head only."""


def pick_device(name: str = "auto") -> torch.device:
    """'auto' takes CUDA, then MPS, then the CPU; a named device that is missing is refused."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA device is available; "
                          "use --device cpu or auto.")
    if name not in ("cpu", "mps") and not name.startswith("cuda"):
        raise ConfigError(f"Unknown device {name!r}; devices are auto, cpu, cuda, cuda:N, mps.")
    return torch.device(name)


def default_dtype(device: torch.device) -> str:
    return "bf16" if device.type == "cuda" else "fp32"


class TorchExecutor:
    """Executor protocol implementation on a real model."""

    name = "torch"
    virtual_time = False

    def __init__(self, model_path: str | Path, *, device: str = "auto", dtype: str | None = None,
                 threads: int | None = None, seed: int = 0, record_logits: bool = False,
                 greedy_shortlist: bool = True):
        self.device = pick_device(device)
        dtype = dtype or default_dtype(self.device)
        if dtype not in DTYPES:
            raise ConfigError(f"Unknown dtype {dtype!r}; dtypes are {', '.join(DTYPES)}.")
        if dtype.startswith("int8") and self.device.type != "cpu":
            raise ConfigError("dtype int8 (FBGEMM dynamic quantization) runs on the CPU only; "
                              "use bf16 on GPUs.")
        if threads is not None:
            if threads < 1:
                raise ConfigError(f"threads must be at least 1, got {threads}.")
            torch.set_num_threads(threads)
        self.dtype_name = dtype
        self.seed = seed
        self.record_logits = record_logits
        self.logits_log: list[tuple[str, int, torch.Tensor]] = []
        """With `record_logits`: (request id, position of the sampled token, logits) per
        sampled token — for tests and numerics inspection, not for serving."""
        self.model_path = Path(model_path)
        g = read_gguf(self.model_path)
        try:
            self.cfg: ModelConfig = model_config(g)
            t0 = time.perf_counter()
            self.model = Transformer(self.cfg, load_tensors(g, DTYPES[dtype], self.device),
                                     int8=dtype == "int8", int8_head=dtype == "int8-head")
            if greedy_shortlist and self.device.type == "cpu" and dtype == "fp32" \
                    and self.model.head.weight.shape[0] >= Linear.WIDE:
                self.model.shortlist_head = Int8Linear(self.model.head.weight)
            self.load_seconds = time.perf_counter() - t0
        finally:
            g.close()
        info = self.cfg.info
        self.model_name = info.name
        self.max_model_len = info.context_length
        self.eos_token_ids = self.cfg.eos_token_ids
        self.vocab_size = info.vocab_size
        self.kv: PagedKVCache | None = None
        self.kv_format = "fp16"
        self._windows = {self.cfg.window(i) for i in range(info.num_layers)}
        # Until `kvdeck calibrate` supplies a fit: weights read once at ~12 GB/s plus a
        # compute term at ~50 GFLOP/s — rough, used only for admission estimates.
        flops_per_token = 2.0 * self.model.matrix_params
        pair_flops = 4.0 * info.num_heads * info.head_dim * info.num_layers
        self.fit = StepFit(self.model.matrix_weight_bytes / 12e9, flops_per_token / 50e9,
                           pair_flops / 50e9)

    # -- protocol ---------------------------------------------------------------------------

    @property
    def kv_formats(self) -> list[str]:
        """The KV formats this model's pool can use on this device."""
        return kv_formats_for(self.cfg.info.head_dim, self.device)

    def kv_bytes_per_token(self, kv_format: str) -> int:
        get_codec(kv_format, self.cfg.info.head_dim, self.device)  # refuses what cannot be
        return self.cfg.info.kv_bytes_per_token(kv_format)

    def bind_kv(self, num_blocks: int, block_size: int, kv_format: str) -> None:
        info = self.cfg.info
        codec = get_codec(kv_format, info.head_dim, self.device)
        self.kv_format = kv_format
        self.kv = PagedKVCache(info.num_layers, num_blocks, block_size, info.num_kv_heads,
                               info.head_dim, codec, self.device)

    @torch.inference_mode()
    def convert_kv(self, kv_format: str, num_blocks: int, src: list[int], dst: list[int]
                   ) -> Conversion:
        """Build the new pool beside the old one, re-encode the used blocks into it, then
        drop the old one: for the length of the conversion both pools are resident."""
        assert self.kv is not None, "bind_kv must run before convert_kv"
        codec = get_codec(kv_format, self.cfg.info.head_dim, self.device)
        t0 = time.perf_counter()
        old = self.kv
        self.kv = old.convert(codec, num_blocks, src, dst)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        moved = len(src) * old.block_size
        self.kv_format = kv_format
        return Conversion(seconds, True,
                          moved * self.cfg.info.kv_bytes_per_token(old.codec.name),
                          moved * self.cfg.info.kv_bytes_per_token(kv_format))

    def estimate_step_seconds(self, num_new_tokens: int, num_pairs: int,
                              num_context_tokens: int) -> float:
        return self.fit.seconds(num_new_tokens, num_pairs)

    def execute(self, plan: SchedulerOutput) -> StepResult:
        """Run the plan; running out of memory fails this step only (a `StepError`)."""
        try:
            return self._execute(plan)
        except (torch.cuda.OutOfMemoryError, MemoryError) as e:
            raise StepError(f"the step ran out of memory on {self.device} ({e})") from e
        except RuntimeError as e:
            # The CPU allocator reports exhaustion as a plain RuntimeError.
            if "can't allocate memory" in str(e) or "out of memory" in str(e):
                raise StepError(f"the step ran out of memory on {self.device} ({e})") from e
            raise

    @torch.inference_mode()
    def _execute(self, plan: SchedulerOutput) -> StepResult:
        assert self.kv is not None, "bind_kv must run before execute"
        t0 = time.perf_counter()
        self.kv.copy_blocks(plan.cow_copies)
        batch = PagedBatch.build(plan, self.kv.block_size, self._windows, self.device)
        cfg, kv = self.cfg, self.kv

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
            return paged_attention(kv, batch, layer, cfg.window(layer), cfg.attn_scale, q, k, v)

        hidden = self.model.forward(batch.tokens, batch.positions, attend)
        sampled: dict[str, int] = {}
        logprobs: dict = {}
        shortlisted = False
        if batch.sample_ids:
            reqs = [c.request for c in plan.chunks if c.sample]
            rows = hidden[batch.sample_rows]
            plain_greedy = not self.record_logits and all(
                r.sampling.temperature == 0.0 and r.sampling.logprobs is None for r in reqs)
            tokens = self.model.greedy_tokens(rows) if plain_greedy else None
            if tokens is not None:
                sampled = dict(zip(batch.sample_ids, tokens, strict=True))
                shortlisted = True
            else:
                logits = self.model.logits(rows)
                if self.record_logits:
                    for rid, req, row in zip(batch.sample_ids, reqs, logits, strict=True):
                        self.logits_log.append((rid, req.num_tokens, row.cpu().clone()))
                tokens, lps = sample(logits, reqs, self.seed)
                sampled = dict(zip(batch.sample_ids, tokens, strict=True))
                logprobs = {rid: lp for rid, lp in zip(batch.sample_ids, lps, strict=True)
                            if lp is not None}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        kv_read = batch.num_context_tokens * self.cfg.info.kv_bytes_per_token(self.kv_format)
        weights = self.model.matrix_weight_bytes
        if shortlisted:  # the int8 copy of the head was read instead of the float one
            weights += self.model.shortlist_head.num_bytes - self.model.head.num_bytes
        timing = StepTiming(seconds, True, plan.num_prefill_tokens, plan.num_decode_tokens,
                            plan.num_pairs, weights + kv_read)
        return StepResult(sampled, timing, logprobs=logprobs)

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request: KV lives in blocks the engine's tables own, and
        samplers are seeded afresh from (seed, position) for every token."""

    def close(self) -> None:
        self.kv = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

