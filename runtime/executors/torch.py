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

from kvdeck.runtime.core.config import check_int
from kvdeck.runtime.core.step_data import Conversion, SchedulerOutput, StepResult, StepTiming
from kvdeck.runtime.errors import ConfigError, StepError
from kvdeck.runtime.executors.base import WeightsView
from kvdeck.runtime.executors.kv_codecs import get_codec, kv_formats_for
from kvdeck.runtime.executors.link import measure_link
from kvdeck.runtime.executors.online_fit import OnlineFit
from kvdeck.runtime.executors.paged_kv import PagedBatch, PagedKVCache, paged_attention
from kvdeck.runtime.kv.groups import LayerGroups, layer_groups
from kvdeck.runtime.kv.transfers import Transfer
from kvdeck.runtime.models.arch import ModelConfig
from kvdeck.runtime.models.architectures import model_config
from kvdeck.runtime.models.gguf import read_gguf
from kvdeck.runtime.models.kernels import (
    FLOAT,
    KernelTable,
    cpu_compute_dtype,
    describe,
    load_or_measure,
)
from kvdeck.runtime.models.linear import (
    INT4_GROUP_SIZES,
    AutoMatrix,
    pack_matrix,
)
from kvdeck.runtime.models.offload import FFNOffload
from kvdeck.runtime.models.transformer import GROUP_MATRICES, Transformer
from kvdeck.runtime.models.weight_formats import format_weight_format, parse_weight_format
from kvdeck.runtime.models.weights import load_tensors
from kvdeck.runtime.planning.profiles import StepFit
from kvdeck.runtime.resources import cache_dir
from kvdeck.runtime.spec.draft_model import DraftModel
from kvdeck.runtime.spec.ngram import propose_for
from kvdeck.runtime.spec.verify import sample_draft, verify_greedy
from kvdeck.runtime.text.guided import MaskJob
from kvdeck.runtime.text.quality import QualityCache
from kvdeck.runtime.text.sampling import (
    TokenLogprobs,
    sample,
    sample_branches,
    score_tokens,
)

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


class TorchExecutor:
    """Executor protocol implementation on a real model."""

    name = "torch"
    virtual_time = False
    computes_logits = True
    max_sequences = 1 << 30

    def __init__(self, model_path: str | Path, *, device: str = "auto", dtype: str | None = None,
                 threads: int | None = None, seed: int = 0, record_logits: bool = False,
                 greedy_shortlist: bool = True, int4_group_size: int = 32,
                 int8_group_size: int = 64, weight_activations: str = "measured",
                 kernel_cache: Path | None = None, draft_model: str | Path | None = None):
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
        draft` (`runtime/spec/draft_model.py`)."""
        self.device = pick_device(device)
        dtype = dtype or default_dtype(self.device, kernel_cache if kernel_cache is not None
                                       else cache_dir() / "kernels")
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
            self.greedy_shortlist = greedy_shortlist
            self._update_shortlist()
            if self.device.type != "cpu":
                self._masters_to_host()
            self.draft = DraftModel(draft_model, g, self.device, DTYPES[dtype], seed) \
                if draft_model is not None else None
            self.load_seconds = time.perf_counter() - t0
        finally:
            g.close()
        self.draft_model_name = self.draft.name if self.draft is not None else ""
        info = self.cfg.info
        self.model_name = info.name
        self.max_model_len = info.context_length
        self.eos_token_ids = self.cfg.eos_token_ids
        self.vocab_size = info.vocab_size
        if int4_group_size not in INT4_GROUP_SIZES:
            raise ConfigError(f"int4_group_size must be one of "
                              f"{', '.join(map(str, INT4_GROUP_SIZES))}, got {int4_group_size}.")
        self.int4_group_size = int4_group_size
        check_int("int8_group_size", int8_group_size, 0, 1 << 16)
        self.int8_group_size = int8_group_size
        if weight_activations not in ("measured", *FLOAT):
            raise ConfigError(f"weight_activations must be measured, {', '.join(FLOAT)}; got "
                              f"{weight_activations!r}.")
        self.weight_activations = weight_activations
        self.kernel_cache = kernel_cache if kernel_cache is not None else \
            cache_dir() / "kernels"
        self._kernels: KernelTable | None = None
        self._auto_rules: dict[str, list[tuple[int, str]]] = {}
        self.weight_formats = dict(self.model.weight_formats)
        """The weight format of each group now (`weight_formats.py`)."""
        self.kv_formats = tuple(kv_formats_for(self.cfg.info.head_dim, self.device))
        """The KV formats this model's pool can use on this device."""
        self.kv: PagedKVCache | None = None
        self.host_kv: PagedKVCache | None = None
        """The host tier's bytes (`bind_host_kv`), same format and layout as the pool."""
        self.groups: LayerGroups | None = None
        """The page layout the pool was bound with (`free_window_kv`); None: a block holds
        every layer."""
        self.kv_format = "fp16"
        self.num_layers = info.num_layers
        self.link = measure_link(self.device)
        self.link_bandwidth = self.link.bandwidth
        """Bytes/s one way between device and host (measured at start-up)."""
        self.link_detail = self.link.describe()
        log.info("host link %s", self.link.describe())
        self.offload: FFNOffload | None = None
        self._windows = {self.cfg.window(i) for i in range(info.num_layers)}
        # A prior until the executor's own steps pin the model down (`online_fit.py`):
        # weights read once at ~12 GB/s plus a compute term at ~50 GFLOP/s.
        flops_per_token = 2.0 * self.model.matrix_params
        pair_flops = 4.0 * info.num_heads * info.head_dim * info.num_layers
        self.timing = OnlineFit(StepFit(self.model.matrix_weight_bytes / 12e9,
                                        flops_per_token / 50e9, pair_flops / 50e9))

    # -- weight formats ---------------------------------------------------------------------

    @property
    def kernels(self) -> KernelTable:
        """The kernel micro-benchmark for this machine and model (measured on first use,
        then cached on disk)."""
        if self._kernels is None:
            m = self.model
            shapes = {"attn": tuple(m.masters[0]["wq"][0].shape),
                      "ffn": tuple(m.masters[0]["w_up"][0].shape),
                      "head": tuple(m.head_master.shape)}
            self._kernels = load_or_measure(shapes, self.device, self.compute, self.kernel_cache,
                                            self.int4_group_size, self.int8_group_size)
            verb = "read from cache" if self._kernels.cached else \
                f"measured in {self._kernels.seconds_spent:.1f} s"
            log.info("kernel table %s: %s", verb, "; ".join(describe(self._kernels)))
        return self._kernels

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
            formats = self.kernels.measured_choice(self.activations_for)
        if "int4" in formats.values():
            gs = self.int4_group_size
            for group, fmt in formats.items():
                if fmt != "int4":
                    continue
                bad = [tuple(m.shape) for m in self._masters(group) if m.shape[1] % gs]
                if bad:
                    raise ConfigError(f"int4 weights for {group} need inputs that are a "
                                      f"multiple of the group size {gs}; a matrix there is "
                                      f"{bad[0][0]} × {bad[0][1]}. Use int4_group_size "
                                      "that divides it, or int8.")
        return formats

    def _masters_to_host(self) -> None:
        """On an accelerator the master copies that re-packing starts from live in host
        memory, so a compact format frees device memory (the dense matrices on the device
        are dropped when their group is re-packed)."""
        m = self.model
        for layer in m.masters:
            for name, (w, b) in layer.items():
                layer[name] = (w.cpu(), b.cpu() if b is not None else None)
        m.head_master = m.head_master.cpu()

    def _masters(self, group: str) -> list[torch.Tensor]:
        if group == "head":
            return [self.model.head_master]
        return [layer[n][0] for layer in self.model.masters for n in GROUP_MATRICES[group]]

    def _pack(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, group: str):
        compute = DTYPES[self.dtype_name]
        weight = weight.to(self.device)  # from a host master copy on an accelerator
        bias = bias.to(self.device) if bias is not None else None
        if fmt == "dense":
            return pack_matrix(weight, bias, "dense", compute)
        if fmt in FLOAT:
            return pack_matrix(weight, bias, "dense", FLOAT[fmt])
        if fmt == "auto":
            return AutoMatrix([(limit, f, self._pack(weight, bias, f, group))
                               for limit, f in self.auto_segments(group)])
        return pack_matrix(weight, bias, fmt, FLOAT[self.activations_for(fmt)],
                           self.int4_group_size, self.int8_group_size)

    def activations_for(self, fmt: str) -> str:
        """The activation dtype a quantized format's products take here."""
        if self.weight_activations != "measured":
            return self.weight_activations
        return self.kernels.best_act(fmt)

    AUTO_MAX_ROWS = 4096

    @property
    def compute(self) -> str:
        """The float dtype activations are in (fp32 under the int8 FBGEMM dtypes)."""
        return self.dtype_name if self.dtype_name in FLOAT else "fp32"

    def auto_segments(self, group: str) -> list[tuple[int, str]]:
        """`auto`'s rule for a group: (most rows, format) ranges, by measured time — at each
        row count the fastest of dense (compute dtype), bf16 and int8."""
        rule = self._auto_rules.get(group)
        if rule is None:
            candidates = tuple(dict.fromkeys((self.compute, "bf16", "int8")))
            segments: list[tuple[int, str]] = []
            for rows in range(1, self.AUTO_MAX_ROWS + 1):
                best = self.kernels.fastest(group, candidates, rows, self.activations_for)
                if segments and segments[-1][1] == best:
                    segments[-1] = (rows, best)
                else:
                    segments.append((rows, best))
            segments[-1] = (1 << 62, segments[-1][1])
            # Dense weights in the compute dtype are the loaded ones ("dense").
            rule = [(limit, "dense" if f == self.compute else f) for limit, f in segments]
            self._auto_rules[group] = rule
        return rule

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
        self.model.set_weight_formats(formats, self._pack)
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
        measured = self._kernels is not None or self.weight_activations != "measured"
        parts = []
        if measured and used & {"int8", "auto"}:
            parts.append(f"int8: {self.activations_for('int8')} activations, "
                         f"{self.int8_group_size or 'row'} inputs/scale")
        if measured and "int4" in used:
            parts.append(f"int4: {self.activations_for('int4')} activations, "
                         f"{self.int4_group_size} inputs/scale")
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
        kernels = tuple(describe(self._kernels)) if self._kernels is not None else ()
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
        if not 0 <= num_layers <= self.num_layers:
            raise ConfigError(f"offload_layers must be from 0 to {self.num_layers} (the "
                              f"model's layers), got {num_layers}.")
        before = self.resident_weight_bytes
        t0 = time.perf_counter()
        self._set_offload(num_layers, num_buffers)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return Conversion(time.perf_counter() - t0, True, before, self.resident_weight_bytes)

    def _set_offload(self, num_layers: int, num_buffers: int) -> None:
        if self.offload is not None:
            self.offload.restore()
            self.offload = self.model.offload = None
        if num_layers:
            layers = list(range(self.num_layers - num_layers, self.num_layers))
            self.offload = FFNOffload(self.model.layers, layers, num_buffers, self.device,
                                      self.link_bandwidth)
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
        self.kv = PagedKVCache(slots, num_blocks, block_size, info.num_kv_heads, info.head_dim,
                               codec, self.device)
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
        batch = PagedBatch.build(plan, self.kv.block_size, self._windows, self.device,
                                 self.groups)
        cfg, kv = self.cfg, self.kv

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
            return paged_attention(kv, batch, layer, cfg.window(layer), cfg.attn_scale, q, k, v)

        sampling = [c for c in plan.chunks if c.sample and not c.num_draft]
        reqs = [c.request for c in sampling]
        job = MaskJob(reqs, [(c.request, list(c.draft)) for c in plan.chunks if c.num_draft])
        try:  # the grammar masks are computed while the forward pass runs
            hidden = self.model.forward(batch.tokens, batch.positions, attend)
        finally:
            masks = job.wait()
        sampled: dict[str, int] = {}
        logprobs: dict = {}
        shortlisted = False
        if batch.sample_ids:
            rows = hidden[batch.sample_rows]
            plain_greedy = not self.record_logits and all(
                r.sampling.temperature == 0.0 and r.sampling.logprobs is None
                and not r.sampling.processes_logits for r in reqs)
            tokens = self.model.greedy_tokens(rows, self._allowed(reqs, masks)) \
                if plain_greedy else None
            if tokens is not None:
                sampled = dict(zip(batch.sample_ids, tokens, strict=True))
                shortlisted = True
                for c, t in zip(sampling, tokens, strict=True):  # greedy samples agree
                    sampled.update((b.request_id, t) for b in c.branches)
            else:
                logits = self.model.logits(rows)
                if self.record_logits:
                    for rid, req, row in zip(batch.sample_ids, reqs, logits, strict=True):
                        self.logits_log.append((rid, req.num_tokens, row.cpu().clone()))
                tokens, lps = sample(logits, reqs, self.seed, self.eos_token_ids, masks)
                sampled = dict(zip(batch.sample_ids, tokens, strict=True))
                logprobs = {rid: lp for rid, lp in zip(batch.sample_ids, lps, strict=True)
                            if lp is not None}
                more, more_lps = sample_branches(logits, sampling, self.seed,
                                                 self.eos_token_ids, masks)
                sampled.update(more)
                logprobs.update(more_lps)
        spec = self._verify(plan, batch, hidden, q, masks) if batch.verify else {}
        prompt_logprobs = self._score_prompts(plan, hidden)
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
                            plan.num_pairs, weights + kv_read)
        if not transfers:  # copies would blur the compute model; drafting has its own
            self.timing.observe(batch.tokens.numel(), timing.num_pairs, seconds - draft_seconds)
        return StepResult(sampled, timing, errors=job.errors, logprobs=logprobs,
                          transfers=transfers, draft_seconds=draft_seconds, spec=spec,
                          prompt_logprobs=prompt_logprobs)

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

    SCORE_ROWS = 64
    """Prompt rows turned into logits at a time: a row's logits are a vocabulary of floats
    (1 MiB on Gemma 3), so a long chunk is scored in slices."""

    def _score_prompts(self, plan: SchedulerOutput, hidden: torch.Tensor
                       ) -> dict[str, list[TokenLogprobs]]:
        """Prompt logprobs of every chunk that scores prompt positions
        (`ScheduledChunk.prompt_scored`): each position's logits score the prompt token
        after it. `hidden` holds the chunks' rows in plan order."""
        out: dict[str, list[TokenLogprobs]] = {}
        row = 0
        for c in plan.chunks:
            scored = c.prompt_scored
            if scored:
                req = c.request
                first = row + scored.start - c.start
                lps: list[TokenLogprobs] = []
                for a in range(scored.start, scored.stop, self.SCORE_ROWS):
                    b = min(a + self.SCORE_ROWS, scored.stop)
                    logits = self.model.logits(hidden[first + a - scored.start:
                                                      first + b - scored.start])
                    lps.extend(score_tokens(logits, req.prompt_token_ids[a + 1:b + 1],
                                            req.sampling.prompt_logprobs))
                out[c.request_id] = lps
            row += c.num_new_tokens
        return out

    def _verify(self, plan: SchedulerOutput, batch: PagedBatch, hidden: torch.Tensor,
                q: dict[str, torch.Tensor], masks: dict[str, torch.Tensor]
                ) -> dict[str, list[int]]:
        """Each speculating chunk's emitted tokens: its `1 + k` rows scored, the draft kept
        by the lossless rule (`q`: the draft model's distributions per sampling request;
        `masks`: a guided request's grammar masks per position). Greedy takes the argmax
        exactly as plain decoding does (the int8 shortlist rescored in float where there is
        one; the masked float logits for a guided request)."""
        out: dict[str, list[int]] = {}
        for index, row in batch.verify:
            chunk = plan.chunks[index]
            req, draft = chunk.request, list(chunk.draft)
            rows = hidden[row:row + 1 + len(draft)]
            allowed = masks.get(req.request_id)
            if req.sampling.temperature == 0.0:
                best = self.model.argmax_tokens(rows, allowed)
                out[req.request_id] = verify_greedy(best, draft)[0]
            else:
                out[req.request_id] = sample_draft(self.model.logits(rows), req, draft,
                                                   self.seed, q.get(req.request_id), allowed)
        return out

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
                                seconds, nbytes / self.link_bandwidth, seconds))
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

