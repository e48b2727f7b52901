"""The `torch` executor: a GGUF model's forward pass in PyTorch over a paged KV pool.

Runs on CUDA when present (bf16 compute), else on the CPU (fp32: on CPUs without native
bf16 matmul — AVX2 machines — bf16 measured 8× slower than fp32), best-effort on MPS.
Every step reports its measured wall time (CUDA-synchronized) and the bytes it read: matrix
weights once plus each row's KV context, for comparison with the machine's bandwidth.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from kvdeck.runtime.core.step_data import Conversion, SchedulerOutput, StepResult, StepTiming
from kvdeck.runtime.errors import ConfigError, StepError
from kvdeck.runtime.executors.base import ExecutorInfo, WeightsView
from kvdeck.runtime.executors.kv_codecs import get_codec, kv_formats_for
from kvdeck.runtime.executors.link import measure_link
from kvdeck.runtime.executors.online_fit import OnlineFit
from kvdeck.runtime.executors.outputs import LogitsStage
from kvdeck.runtime.executors.paged_kv import PagedBatch, PagedKVCache, paged_attention
from kvdeck.runtime.executors.torch_adapters import TorchAdapters
from kvdeck.runtime.executors.torch_graphs import DecodeGraphs
from kvdeck.runtime.executors.torch_weights import WeightPacker
from kvdeck.runtime.kv.groups import LayerGroups, layer_groups
from kvdeck.runtime.kv.transfers import Transfer
from kvdeck.runtime.models.arch import ModelConfig
from kvdeck.runtime.models.architectures import model_config
from kvdeck.runtime.models.gguf import read_gguf
from kvdeck.runtime.models.kernels import (
    FLOAT,
    cpu_compute_dtype,
)
from kvdeck.runtime.models.lora import load_adapter, merge
from kvdeck.runtime.models.offload import FFNOffload
from kvdeck.runtime.models.transformer import Transformer
from kvdeck.runtime.models.weight_formats import format_weight_format, parse_weight_format
from kvdeck.runtime.models.weights import load_tensors
from kvdeck.runtime.planning.profiles import StepFit
from kvdeck.runtime.planning.step_time import parse_buckets
from kvdeck.runtime.resources import cache_dir
from kvdeck.runtime.spec.draft_model import DraftModel
from kvdeck.runtime.spec.ngram import propose_for
from kvdeck.runtime.text.guided import MaskJob
from kvdeck.runtime.text.quality import QualityCache

log = logging.getLogger("kvdeck.torch")

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


def default_dtype(device: torch.device, kernel_cache: Path | None = None) -> str:
    """bf16 on CUDA; on a CPU whichever of fp32 and bf16 a timing on this machine finds
    clearly faster (`kernels.cpu_compute_dtype`: bf16 where AMX or AVX-512 BF16 kernels
    run it at twice fp32's speed, as on the Sapphire Rapids Xeons this project runs on,
    where it serves 2.1x the tokens/s of fp32 at concurrency 8); fp32 elsewhere."""
    if device.type == "cuda":
        return "bf16"
    if device.type == "cpu":
        return cpu_compute_dtype(kernel_cache)
    return "fp32"


def pick_dtype(dtype: str | None, device: torch.device, kernel_cache: Path) -> str:
    """The compute dtype asked for, or this machine's default (`default_dtype`); a
    ConfigError sentence for an unknown one, or int8 off the CPU."""
    dtype = dtype or default_dtype(device, kernel_cache)
    if dtype not in DTYPES:
        raise ConfigError(f"Unknown dtype {dtype!r}; dtypes are {', '.join(DTYPES)}.")
    if dtype.startswith("int8") and device.type != "cpu":
        raise ConfigError("dtype int8 (FBGEMM dynamic quantization) runs on the CPU only; "
                          "use bf16 on GPUs.")
    return dtype


class TorchExecutor(TorchAdapters):
    """Executor protocol implementation on a real model."""

    def __init__(self, model_path: str | Path, *, device: str = "auto", dtype: str | None = None,
                 threads: int | None = None, seed: int = 0, record_logits: bool = False,
                 greedy_shortlist: bool = True, int4_group_size: int = 32,
                 int8_group_size: int = 64, weight_activations: str = "measured",
                 kernel_cache: Path | None = None, draft_model: str | Path | None = None,
                 merge_adapter: str | Path | None = None, graph_buckets: str = ""):
        """`int4_group_size`: inputs per scale/zero pair of int4 weights (32, 64, 128 or
        256); `int8_group_size`: inputs per scale of int8 weights (0: one per output channel;
        see `WeightOnlyInt8` for why 64). `weight_activations`: the dtype int8/int4 matrices
        take their activations in — `measured` (the fastest here, `kernels.py`) or fp32, bf16,
        fp16 (fp32 is the most accurate: on Gemma 3 270M int8 agrees with fp32 weights on
        97.0 % of top-1 tokens with fp32 activations, 95.5 % with bf16). `kernel_cache`:
        where the kernel micro-benchmark is cached (default
        `$KVDECK_CACHE/kernels`). Weights start dense in the compute dtype; the engine
        applies its `weight_format` knob through `set_weight_formats`. `draft_model`: a
        GGUF with the same tokenizer, loaded beside the target for `speculative_method =
        draft` (`runtime/spec/draft_model.py`). `merge_adapter`: a LoRA adapter added into
        the weights at load (the merged model batched adapters must agree with).
        `graph_buckets`: on CUDA, decode steps replay CUDA graphs of these row counts
        (`torch_graphs.py`); elsewhere they run eagerly, as without it."""
        self.device = pick_device(device)
        self.graphs = DecodeGraphs(parse_buckets(graph_buckets), self.device)
        kernel_cache = kernel_cache if kernel_cache is not None else cache_dir() / "kernels"
        dtype = pick_dtype(dtype, self.device, kernel_cache)
        if threads is not None:
            if threads < 1:
                raise ConfigError(f"threads must be at least 1, got {threads}.")
            torch.set_num_threads(threads)
        self.dtype_name = dtype
        self.seed = seed
        self.record_logits = record_logits
        self.logits_log: list[tuple[str, int, torch.Tensor]] = []
        """With `record_logits`: (request id, position of the sampled token, logits) per
        sampled token, and (request id, first position, logits [n, vocab]) per chunk's
        scored prompt positions — for tests and quality figures, not for serving."""
        g = read_gguf(Path(model_path))
        try:
            self.cfg: ModelConfig = model_config(g)
            t0 = time.perf_counter()
            tensors = load_tensors(g, DTYPES[dtype], self.device)
            if merge_adapter is not None:
                merge(tensors, load_adapter("merged", merge_adapter))
            self.model = Transformer(self.cfg, tensors, int8=dtype == "int8",
                                     int8_head=dtype == "int8-head")
            self.greedy_shortlist = greedy_shortlist
            self._update_shortlist()
            self.draft = DraftModel(draft_model, g, self.device, DTYPES[dtype], seed) \
                if draft_model is not None else None
            self.load_seconds = time.perf_counter() - t0
        finally:
            g.close()
        info = self.cfg.info
        self.packer = WeightPacker(
            self.model, self.device, dtype if dtype in FLOAT else "fp32",
            int4_group_size, int8_group_size, weight_activations, kernel_cache)
        if self.device.type != "cpu":
            self.packer.masters_to_host()
        self.weight_formats = dict(self.model.weight_formats)
        """The weight format of each group now (`weight_formats.py`)."""
        self.kv: PagedKVCache | None = None
        self.host_kv: PagedKVCache | None = None
        """The host tier's bytes (`bind_host_kv`), same format and layout as the pool."""
        self.groups: LayerGroups | None = None
        """The page layout the pool was bound with (`free_window_kv`); None: a block holds
        every layer."""
        self.kv_format = "fp16"
        link = measure_link(self.device)
        log.info("host link %s", link.describe())
        self.info = ExecutorInfo(
            "torch", info.name, Path(model_path), info.vocab_size, info.context_length,
            self.cfg.eos_token_ids, info.num_layers,
            tuple(kv_formats_for(info.head_dim, self.device)), link.bandwidth, link.describe(),
            draft_model_name=self.draft.name if self.draft is not None else "",
            device=str(self.device))
        """The KV formats are those this model's pool can use on this device; the host
        link is measured at start-up."""
        self.offload: FFNOffload | None = None
        self._windows = {self.cfg.window(i) for i in range(info.num_layers)}
        self.timing = OnlineFit(self._prior_fit())
        self.token_eviction = "off"  # `set_token_eviction`

    def set_token_eviction(self, mode: str) -> None:
        """Read tables with holes unless `mode` is 'off' (`kv/eviction.py`); report the
        attention on each block with every step under 'heavy-hitter'."""
        self.token_eviction = mode
        if self.draft is not None:
            self.draft.holes = mode != "off"

    def _prior_fit(self) -> StepFit:
        """The step-time model until the executor's own steps pin it down (`online_fit.py`):
        weights read once at ~12 GB/s plus a compute term at ~50 GFLOP/s."""
        info = self.cfg.info
        flops_per_token = 2.0 * self.model.matrix_params
        pair_flops = 4.0 * info.num_heads * info.head_dim * info.num_layers
        return StepFit(self.model.matrix_weight_bytes / 12e9, flops_per_token / 50e9,
                       pair_flops / 50e9)

    # -- weight formats ---------------------------------------------------------------------

    def resolve_weight_formats(self, text: str, current: dict[str, str] | None = None
                               ) -> dict[str, str]:
        """The formats per group a `weight_format` knob value names (groups it leaves out
        keep `current`, default the formats now), `measured` resolved; a ConfigError
        sentence for one this model cannot take."""
        formats = parse_weight_format(text, current or self.weight_formats)
        if self.dtype_name.startswith("int8"):
            if set(formats.values()) <= {"dense", "measured"}:
                return dict(self.weight_formats)  # the dtype's own int8 matrices stay
            raise ConfigError(f"dtype {self.dtype_name} already quantizes matrices (FBGEMM "
                              "dynamic int8); other weight formats need a float dtype "
                              "(fp32, bf16 or fp16).")
        if "measured" in formats.values():
            formats = self.packer.kernels.measured_choice(self.packer.activations_for)
        if "int4" in formats.values():
            gs = self.packer.int4_group_size
            for group, fmt in formats.items():
                if fmt != "int4":
                    continue
                bad = [tuple(m.shape) for m in self.packer.masters(group) if m.shape[1] % gs]
                if bad:
                    raise ConfigError(f"int4 weights for {group} need inputs that are a "
                                      f"multiple of the group size {gs}; a matrix there is "
                                      f"{bad[0][0]} × {bad[0][1]}. Use int4_group_size "
                                      "that divides it, or int8.")
        return formats

    @torch.inference_mode()
    def set_weight_formats(self, formats: dict[str, str]) -> Conversion:
        """Re-pack the groups whose format changes from the host master copies (between
        iterations); the pause and the weight bytes before and after are returned. Offloaded
        layers are offloaded again in the new format."""
        before = self.resident_weight_bytes
        t0 = time.perf_counter()
        offload = self.offload
        if offload is not None and formats.get("ffn") != self.weight_formats.get("ffn"):
            self._set_offload(0, 1)
        self.model.set_weight_formats(formats, self.packer.pack)
        self.graphs.reset()
        if offload is not None and self.offload is None:
            self._set_offload(len(offload.offloaded), offload.num_buffers)
        self.weight_formats = dict(self.model.weight_formats)
        self._update_shortlist()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return Conversion(time.perf_counter() - t0, True, before, self.resident_weight_bytes)

    def describe_weights(self, kv_format: str) -> WeightsView:
        """The weights as snapshots show them, with cached quality figures for the current
        weight and KV formats (never computed here: `kvdeck quality` or `make bench` do)."""
        used = set(self.weight_formats.values())
        pk = self.packer
        measured = pk.measured
        parts = []
        if measured and used & {"int8", "auto"}:
            parts.append(f"int8: {pk.activations_for('int8')} activations, "
                         f"{pk.int8_group_size or 'row'} inputs/scale")
        if measured and "int4" in used:
            parts.append(f"int4: {pk.activations_for('int4')} activations, "
                         f"{pk.int4_group_size} inputs/scale")
        detail = "; ".join(parts)
        quality: list[tuple[str, str]] = []
        kv = QualityCache.for_executor(self, "kv").get(f"kv {kv_format}")
        if kv is not None:
            quality.append(("kv_format", kv.short()))
        if measured and len(used) == 1:
            (fmt,) = used
            q = QualityCache.for_executor(self, "weights").get(f"weights {fmt}")
            if q is not None:
                quality.append(("weight_format", q.short()))
        kernels = pk.kernel_lines() + self.graphs.lines()
        return WeightsView(format_weight_format(self.weight_formats), self.resident_weight_bytes,
                           detail, kernels, tuple(quality))

    def auto_choice(self) -> str:
        """What `auto` groups used in the latest step ("" when no group is `auto`)."""
        chosen = {g: getattr(self.model.group_matrices(g)[0], "last_format", None)
                  for g in self.weight_formats if self.weight_formats[g] == "auto"}
        return ",".join(f"{g}={f}" for g, f in chosen.items() if f)

    @property
    def resident_weight_bytes(self) -> int:
        """Bytes of every packed matrix held on the device (all of `auto`'s packings;
        offloaded layers count only their buffers)."""
        total = sum(getattr(m, "resident_bytes", m.num_bytes) for m in self.model.matrices())
        if self.offload is not None:
            total -= self.offload.offloaded_bytes - self.offload.buffer_bytes
        return total

    # -- weight offload ---------------------------------------------------------------------

    @property
    def offload_gain_bytes(self) -> int:
        """Device bytes weight offload frees for KV: offloaded minus buffer bytes."""
        if self.offload is None:
            return 0
        return self.offload.offloaded_bytes - self.offload.buffer_bytes

    @torch.inference_mode()
    def set_offload(self, num_layers: int, num_buffers: int) -> Conversion:
        """Offload the FFN weights of the last `num_layers` layers to host memory, prefetched
        into `num_buffers` device buffers (0 layers: everything back on the device).
        Between iterations; returns the pause and the device weight bytes before and
        after."""
        if not 0 <= num_layers <= self.info.num_layers:
            raise ConfigError(f"offload_layers must be from 0 to {self.info.num_layers} (the "
                              f"model's layers), got {num_layers}.")
        before = self.resident_weight_bytes
        t0 = time.perf_counter()
        self._set_offload(num_layers, num_buffers)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return Conversion(time.perf_counter() - t0, True, before, self.resident_weight_bytes)

    def _set_offload(self, num_layers: int, num_buffers: int) -> None:
        self.graphs.reset()
        if self.offload is not None:
            self.offload.restore()
            self.offload = self.model.offload = None
        if num_layers:
            layers = list(range(self.info.num_layers - num_layers, self.info.num_layers))
            self.offload = FFNOffload(self.model.layers, layers, num_buffers, self.device,
                                      self.info.link_bandwidth)
            self.model.offload = self.offload

    def describe_offload(self) -> str:
        """Weight offload in a line for the transfers panel ("; " separates its parts)."""
        off = self.offload
        if off is None:
            return ""
        return (f"layers {off.offloaded[0]}–{off.offloaded[-1]} FFN; "
                f"{off.offloaded_bytes / 2**20:,.1f} MiB per step; {off.num_buffers} "
                f"buffer{'s' if off.num_buffers > 1 else ''} × {off.layer_bytes / 2**20:,.1f} MiB")

    def _update_shortlist(self) -> None:
        """Greedy decoding over a wide fp32 head shortlists with an int8 copy on the CPU
        (`Transformer.update_shortlist`)."""
        self.model.update_shortlist(self.greedy_shortlist and self.device.type == "cpu")

    # -- protocol ---------------------------------------------------------------------------

    def kv_bytes_per_token(self, kv_format: str) -> int:
        get_codec(kv_format, self.cfg.info.head_dim, self.device)  # refuses what cannot be
        return self.cfg.info.kv_bytes_per_token(kv_format)

    def draft_kv_bytes_per_token(self, kv_format: str) -> int:
        """Bytes of the draft model's twin KV per token (0 without a draft model)."""
        return self.draft.kv_bytes_per_token(kv_format) if self.draft is not None else 0

    def estimate_draft_seconds(self, num_rows: int) -> float:
        """One draft-model pass over `num_rows` rows (0 without a draft model)."""
        return self.draft.pass_seconds(num_rows) if self.draft is not None else 0.0

    def layer_groups(self) -> LayerGroups:
        info = self.cfg.info
        return layer_groups(info.num_layers, info.sliding_window_layers, info.sliding_window,
                            info.name)

    def bind_host_kv(self, num_blocks: int) -> None:
        """(Re)create the host tier's storage, `num_blocks` blocks in the pool's format and
        layout (pinned beside a CUDA pool); its contents start empty."""
        assert self.kv is not None, "bind_kv must run before bind_host_kv"
        info = self.cfg.info
        self.host_kv = None
        if num_blocks:
            self.host_kv = PagedKVCache(self.kv.num_layers, num_blocks, self.kv.block_size,
                                        info.num_kv_heads, info.head_dim, self.kv.codec,
                                        torch.device("cpu"), pin=self.device.type == "cuda")

    def bind_kv(self, num_blocks: int, block_size: int, kv_format: str,
                groups: LayerGroups | None = None) -> None:
        """The pool: `num_blocks` blocks of every layer, or with `groups` pages of
        `groups.page_layers` layer slots each (the draft's twins stay one per page id)."""
        info = self.cfg.info
        assert groups is None or groups == self.layer_groups(), \
            "the layer groups bound are not this model's"
        codec = get_codec(kv_format, info.head_dim, self.device)
        self.kv_format = kv_format
        self.groups = groups
        slots = groups.page_layers if groups is not None else info.num_layers
        self.kv = None  # what a pool bound before held is gone: free it before the new one
        self.kv = PagedKVCache(slots, num_blocks, block_size, info.num_kv_heads, info.head_dim,
                               codec, self.device, spare=int(self.graphs.on))
        self.graphs.reset()
        if self.draft is not None:
            self.draft.bind(num_blocks, block_size, kv_format)

    @torch.inference_mode()
    def convert_kv(self, kv_format: str, num_blocks: int, src: list[int], dst: list[int]
                   ) -> Conversion:
        """Build the new pool beside the old one, re-encode the used blocks into it, then
        drop the old one: for the length of the conversion both pools are resident."""
        assert self.kv is not None, "bind_kv must run before convert_kv"
        codec = get_codec(kv_format, self.cfg.info.head_dim, self.device)
        t0 = time.perf_counter()
        old = self.kv
        self.host_kv = None  # emptied by the engine; re-bound in the new format
        self.kv = old.convert(codec, num_blocks, src, dst)  # same layout: pages stay pages
        self.graphs.reset()
        if self.draft is not None:  # block ids moved: the twins are recomputed as needed
            self.draft.bind(num_blocks, old.block_size, kv_format)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        moved = len(src) * old.block_size
        self.kv_format = kv_format
        return Conversion(seconds, True, moved * self._block_bytes_per_token(old.codec.name),
                          moved * self._block_bytes_per_token(kv_format))

    def _block_bytes_per_token(self, kv_format: str) -> int:
        """Bytes one token of a pool block holds: every layer's, or with groups a page's
        `page_layers` layers (the model's layers are alike, so bytes split evenly)."""
        per_token = self.cfg.info.kv_bytes_per_token(kv_format)
        return per_token if self.groups is None else self.groups.page_share(per_token)

    def estimate_step_seconds(self, num_new_tokens: int, num_pairs: int,
                              num_context_tokens: int) -> float:
        return self.timing.seconds(num_new_tokens, num_pairs)

    @property
    def weight_bytes(self) -> int:
        """Matrix bytes every step reads in the current weight formats."""
        return self.model.matrix_weight_bytes

    @property
    def fit(self) -> StepFit:
        """The step-time model now (learned from measured steps, `online_fit.py`)."""
        return self.timing.fit

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
        transfers = self._transfer_blocks(plan.transfers, t0) if plan.transfers else []
        self.kv.copy_blocks(plan.cow_copies)
        draft_seconds, q = 0.0, {}
        if self.draft is not None:
            self.draft.copy_blocks(plan.cow_copies)
            draft_seconds, q = self.draft.run(plan)
        evicting = self.token_eviction
        batch = PagedBatch.build(plan, self.kv.block_size, self._windows, self.device,
                                 self.groups, evicting != "off", evicting == "heavy-hitter")
        cfg, kv = self.cfg, self.kv

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   b: PagedBatch = batch):  # a CUDA graph passes its static batch
            return paged_attention(kv, b, layer, cfg.window(layer), cfg.attn_scale, q, k, v)

        if self.model.adapters is not None:  # rows in plan order, as the batch packs them
            transfers += self._load_adapters(plan, t0)
            self.model.adapters.begin_step([(c.request.sampling.lora, c.num_new_tokens)
                                            for c in plan.chunks])
        sampling = [c for c in plan.chunks if c.sample and not c.num_draft]
        job = MaskJob([c.request for c in sampling],
                      [(c.request, list(c.draft)) for c in plan.chunks if c.num_draft])
        try:  # the grammar masks are computed while the forward pass runs
            hidden, padded = self.graphs.forward(
                batch, kv, self.model.forward, attend,
                eager=self.offload is not None or self.model.adapters is not None)
        finally:
            masks = job.wait()
        out = LogitsStage(self.seed, self.info.eos_token_ids, self.model.logits,
                          self.model.argmax_tokens)
        shortlisted = False
        if batch.sample_ids:
            shortlisted = self._sample(out, sampling, hidden[batch.sample_rows], masks)
        for index, row in batch.verify:
            chunk = plan.chunks[index]
            out.verify(chunk, hidden[row:row + 1 + len(chunk.draft)], q.get(chunk.request_id),
                       masks.get(chunk.request_id))
        row = 0
        for c in plan.chunks:  # `hidden` holds the chunks' rows in plan order
            if c.prompt_scored:
                first = row + c.prompt_scored.start - c.start
                out.score(c, rows := hidden[first:first + len(c.prompt_scored)])
                if self.record_logits:
                    self.logits_log.append((c.request_id, c.prompt_scored.start,
                                            self.model.logits(rows).float().cpu()))
            row += c.num_new_tokens
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        if self.offload is not None:
            transfers.extend(self.offload.transfers())
        kv_read = self._kv_read_bytes(batch)
        weights = self.model.matrix_weight_bytes
        if shortlisted:  # the int8 copy of the head was read instead of the float one
            weights += self.model.shortlist_head.num_bytes - self.model.head.num_bytes
        if draft_seconds:
            weights += self.draft.weight_bytes * self.draft.last_passes
        timing = StepTiming(seconds, True, plan.num_prefill_tokens, plan.num_decode_tokens,
                            plan.num_pairs, weights + kv_read, padded_rows=padded)
        if not transfers:  # copies would blur the compute model; drafting has its own
            self.timing.observe(batch.tokens.numel(), timing.num_pairs, seconds - draft_seconds)
        return StepResult(out.sampled, timing, errors=job.errors, logprobs=out.logprobs,
                          transfers=transfers, draft_seconds=draft_seconds, spec=out.spec,
                          prompt_logprobs=out.prompt_logprobs,
                          attention=batch.attention([c.request_id for c in plan.chunks]))

    def _sample(self, out: LogitsStage, chunks: list, rows: torch.Tensor,
                masks: dict[str, torch.Tensor]) -> bool:
        """Sample the chunks' rows (hidden states) into `out`. Plain greedy rows take the
        int8 shortlist of the output head where there is one (returns True: the step then
        read that head instead of the float one); the rest go through the float head."""
        reqs = [c.request for c in chunks]
        plain_greedy = not self.record_logits and all(
            r.sampling.temperature == 0.0 and r.sampling.logprobs is None
            and not r.sampling.processes_logits for r in reqs)
        tokens = self.model.greedy_tokens(rows, self._allowed(reqs, masks)) \
            if plain_greedy else None
        if tokens is not None:
            out.take_greedy(chunks, tokens)
            return True
        logits = self.model.logits(rows)
        if self.record_logits:
            for c, row in zip(chunks, logits, strict=True):
                self.logits_log.append((c.request_id, c.request.num_tokens, row.cpu().clone()))
        out.sample(logits, chunks, masks)
        return False

    def _kv_read_bytes(self, batch: PagedBatch) -> int:
        """KV bytes the step's attention read: every layer over each row's context, or with
        groups the local layers over at most their window (the model's layers are alike)."""
        info = self.cfg.info
        per_token = info.kv_bytes_per_token(self.kv_format)
        g = self.groups
        if g is None:
            return batch.num_context_tokens * per_token
        per_layer = per_token // info.num_layers
        return per_layer * (len(g.global_layers) * batch.num_context_tokens
                            + len(g.local_layers) * batch.num_window_tokens)

    def _allowed(self, reqs: list, masks: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The grammar masks of a batch of sampling rows as one [S, vocab] bool tensor (an
        unconstrained row allows everything); None when no row is constrained."""
        rows = [masks.get(r.request_id) for r in reqs] if masks else []
        if not any(m is not None for m in rows):
            return None
        width = next(m for m in rows if m is not None).shape[-1]
        every = torch.ones(width, dtype=torch.bool)
        return torch.stack([every if m is None else m for m in rows])

    def propose(self, req, k: int, knobs) -> list[int]:
        """Draft tokens under the knobs' speculative method: n-gram prompt lookup over the
        request's latest tokens."""
        return propose_for(req, k, knobs)

    def _transfer_blocks(self, copies: list, t0: float) -> list[Transfer]:
        """Perform the plan's tier copies in order (before copy-on-write and the forward
        pass), each timed (CUDA-synchronized) against `bytes / link bandwidth`."""
        assert self.host_kv is not None, "a plan moved KV blocks but no host tier is bound"
        out = []
        for kind, direction, what, pairs in copies:
            src, dst = (self.kv, self.host_kv) if direction == "d2h" else \
                (self.host_kv, self.kv)
            start = time.perf_counter()
            nbytes = src.copy_to(dst, pairs)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - start
            out.append(Transfer(kind, direction, what, len(pairs), nbytes, start - t0,
                                seconds, nbytes / self.info.link_bandwidth, seconds))
        return out

    def forget(self, request_id: str) -> None:
        """KV lives in blocks the engine's tables own, and samplers are seeded afresh from
        (seed, position) for every token; only a draft model's progress is kept."""
        if self.draft is not None:
            self.draft.forget(request_id)

    def close(self) -> None:
        self.kv = None
        if self.draft is not None:
            self.draft.kv = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

