"""Matrix weights as callables: float (`Linear`), weight-only int8 / int4 (`WeightOnlyInt8`,
`WeightOnlyInt4`: float activations, low-bit weights) or dynamic int8 (`Int8Linear`).

Weight-only formats keep activations in the compute dtype, so accuracy stays close to dense
weights; they pay off where a step is bound by the bytes of weights read (decode at small
batch). They use PyTorch's packed kernels where the device has them (CPU:
`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`; CUDA: `_weight_int4pack_mm` for bf16)
and otherwise dequantize then multiply (int8 also where that is measured faster).

`Int8Linear` stores weights as per-output-channel symmetric int8 and multiplies through
FBGEMM's dynamic-quantization GEMM (activations quantized per call), the same trade llama.cpp
makes with 8-bit activations: on a 2-core AVX2 machine it is 2× faster on FFN shapes and 3×
on Gemma's 262K-wide output head than fp32, at ~2 % relative error per output. CPU only.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F


class Linear:
    """`y = x Wᵀ + b` in the weight's float dtype."""

    WIDE = 32_768

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias
        self.wide = weight.shape[0] >= self.WIDE and weight.device.type == "cpu"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(self.weight.dtype)  # dense weights in another dtype than the activations
        if self.wide and x.dim() == 2:
            # An output head (Gemma: 262,144 × 640) multiplied as W·xᵀ: MKL blocks this
            # tall-skinny product ~1.5× faster than x·Wᵀ at 8–32 rows on a 2-core machine.
            y = torch.mm(self.weight, x.t()).t()
            y = y + self.bias if self.bias is not None else y
        else:
            y = F.linear(x, self.weight, self.bias)
        return y.to(dtype)

    @property
    def num_params(self) -> int:
        return self.weight.numel()

    @property
    def num_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class Int8Linear:
    """`y ≈ x Wᵀ + b` with int8 weights (per output channel) and dynamically quantized x."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        w = weight.float().cpu()
        scale = (w.abs().amax(dim=1).clamp_min(1e-12) / 127.0).double()
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # torch.ao's deprecation notice: the op still ships
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(
                qw, bias.float().cpu() if bias is not None else None)
        self._num_bytes = w.numel() + 4 * w.shape[0]
        self.num_params = w.numel()
        self.out_features = w.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        # reduce_range: 7-bit activations keep AVX2's int8 multiply-add from saturating.
        y = torch.ops.quantized.linear_dynamic(x.reshape(-1, shape[-1]).float(), self._packed,
                                               True)
        return y.reshape(*shape[:-1], self.out_features)

    @property
    def num_bytes(self) -> int:
        return self._num_bytes


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, int8: bool):
    return Int8Linear(weight, bias) if int8 else Linear(weight, bias)


WEIGHT_FORMATS = ("dense", "int8", "int4")
"""Weight formats a matrix can be packed in (`auto` chooses among them per step)."""
INT4_GROUP_SIZES = (32, 64, 128, 256)


class WeightOnlyInt8:
    """`y = Σ_g (x_g · Q_gᵀ) ⊙ s_g + b`: int8 codes with one symmetric scale per output
    channel and per group of `group_size` inputs (`s = max|w| / 127` over the group; 0, or
    a size that does not divide the inputs, = one group spanning the row: per-channel
    scales only). Activations in float.

    Why groups: on Gemma 3 270M (whose GGUF weights sit on Q4_K/Q6_K/Q8_0 grids of 32-value
    groups) one scale per row costs a mean |Δlogit| of 0.23 against fp32 weights and 92–94 %
    top-1 agreement; groups of 64 cost 0.09 and ~98 % (`runtime/text/quality.py`).

    Two kernels, the same sum. `packed`: PyTorch's packed int8 kernel, which takes
    per-channel scales only, so each input group is one call and the partial products are
    summed. `gemm`: a block of output rows at a time is dequantized into the activation
    dtype and multiplied in one dense product. Which is faster depends on the CPU, the
    activation dtype and the rows. On a 2-core AVX2 machine with fp32 activations (groups
    of 32): Gemma's head at one row 86 ms packed, 116 ms gemm, at 512 rows (a prompt) 50 s
    packed, 1.7 s gemm; its FFN up-projection at one row 1.4 ms packed, 0.6 ms gemm. With
    bf16 activations there the packed kernel won at every row count timed (AVX2 has no
    bf16 products). So `gemm_from_rows` (measured, `kernels.py`) says from how many rows
    gemm runs.
    Where the packed kernel is missing (CUDA, old torch) gemm runs at every row count.
    """

    format = "int8"
    GEMM_BLOCK_BYTES = 8 << 20
    """Bytes of dequantized weights one block of the gemm kernel holds at once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 group_size: int = 0, gemm_from_rows: int = 1):
        w = weight.float()
        n, k = w.shape
        gs = group_size if group_size and k % group_size == 0 else k  # else one per row
        g = w.view(n, k // gs, gs)
        scale = g.abs().amax(-1).clamp_min(1e-12) / 127                 # [n, groups]
        codes = torch.round(g / scale[..., None]).clamp(-127, 127).to(torch.int8)
        # [groups, n, gs]: each group's codes contiguous, as the packed kernel takes them.
        self.codes = codes.transpose(0, 1).contiguous()
        self.scales = scale.t().to(dtype).contiguous()                   # [groups, n]
        self.group_size = gs
        self.bias = bias.to(dtype) if bias is not None else None
        self.dtype = dtype
        self.out_features, self.in_features = n, k
        has_packed = w.device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm")
        self.gemm_from_rows = max(1, gemm_from_rows) if has_packed else 1
        self.block = max(1, self.GEMM_BLOCK_BYTES // (k * torch.finfo(dtype).bits // 8))

    def _packed(self, x2: torch.Tensor) -> torch.Tensor:
        gs, y = self.group_size, None
        for i in range(len(self.codes)):
            xi = x2[:, i * gs:(i + 1) * gs].contiguous() if len(self.codes) > 1 else x2
            part = torch.ops.aten._weight_int8pack_mm(xi, self.codes[i], self.scales[i])
            y = part if y is None else y.add_(part)
        return y

    def _gemm(self, x2: torch.Tensor) -> torch.Tensor:
        y = torch.empty(x2.shape[0], self.out_features, dtype=self.dtype, device=x2.device)
        for a in range(0, self.out_features, self.block):
            b = min(a + self.block, self.out_features)
            torch.mm(x2, self._rows(a, b, self.dtype).t(), out=y[:, a:b])
        return y

    def _rows(self, a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
        """Output rows `a` to `b` of the weight these codes stand for, [b − a, in], in
        `dtype`."""
        w = self.codes[:, a:b].to(dtype) * self.scales[:, a:b, None].to(dtype)  # [g, rows, gs]
        return w.transpose(0, 1).reshape(b - a, self.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(self.dtype).contiguous()
        y = self._packed(x2) if x2.shape[0] < self.gemm_from_rows else self._gemm(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight these codes stand for (the reference the packed kernel must equal)."""
        return self._rows(0, self.out_features, torch.float32)

    @property
    def num_params(self) -> int:
        return self.out_features * self.in_features

    @property
    def num_bytes(self) -> int:
        return self.num_params + self.scales.numel() * self.scales.element_size()


class WeightOnlyInt4:
    """Group-wise asymmetric int4: per `group_size` inputs of a row, `scale = (max − min) / 15`
    and `zero = min + 8·scale`, so `w ≈ (q − 8)·scale + zero` with `q` in 0..15 — the layout
    PyTorch's int4 kernels take. Activations in float."""

    format = "int4"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 group_size: int = 32):
        w = weight.float()
        n, k = w.shape
        if group_size not in INT4_GROUP_SIZES or k % group_size:
            raise ValueError(f"int4 group size {group_size} does not divide {k} inputs")
        g = w.view(n, k // group_size, group_size)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-8)
        q = torch.clamp(torch.round((g - lo[..., None]) / scale[..., None]), 0, 15)
        self.group_size = group_size
        self.out_features, self.in_features = n, k
        self.dtype = dtype
        self.bias = bias.to(dtype) if bias is not None else None
        # [k/gs, n, 2]: scale and zero per group, in the activation dtype.
        self.scales_zeros = torch.stack((scale, lo + 8 * scale), -1).transpose(0, 1) \
            .contiguous().to(dtype)
        codes = q.to(torch.int32).view(n, k)
        self.kernel = None
        if w.device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            self.kernel = "cpu"
        elif w.device.type == "cuda" and dtype == torch.bfloat16 and n % 8 == 0 \
                and k % 1024 == 0 and hasattr(torch.ops.aten, "_weight_int4pack_mm"):
            nibbles = codes.to(torch.uint8)
            self.packed = torch.ops.aten._convert_weight_to_int4pack(
                (nibbles[:, ::2] << 4 | nibbles[:, 1::2]).contiguous(), 8)
            self.kernel = "cuda"
        else:  # two codes a byte; dequantized on every call
            nibbles = codes.to(torch.uint8)
            self.packed = (nibbles[:, ::2] | nibbles[:, 1::2] << 4).contiguous()

    def dequantized(self) -> torch.Tensor:
        """The weight these codes stand for, [out, in] float32."""
        if self.kernel is None:
            q = torch.stack((self.packed & 0x0F, self.packed >> 4), -1).view(
                self.out_features, self.in_features)
        else:  # the packed kernel against the identity recovers the weight exactly
            eye = torch.eye(self.in_features, dtype=self.dtype, device=self.packed.device)
            return self._packed_mm(eye).float().t().contiguous()
        n, k, gs = self.out_features, self.in_features, self.group_size
        sz = self.scales_zeros.float().transpose(0, 1)          # [n, k/gs, 2]
        g = (q.view(n, k // gs, gs).float() - 8) * sz[..., :1] + sz[..., 1:]
        return g.view(n, k)

    def _packed_mm(self, x2: torch.Tensor) -> torch.Tensor:
        if self.kernel == "cpu":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size,
                                                              self.scales_zeros)
        return torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.group_size,
                                                  self.scales_zeros)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(self.dtype)
        if self.kernel is not None:
            y = self._packed_mm(x2)
        else:
            y = x2 @ self.dequantized().to(self.dtype).t()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    @property
    def num_params(self) -> int:
        return self.out_features * self.in_features

    @property
    def num_bytes(self) -> int:
        return self.num_params // 2 + self.scales_zeros.numel() * self.scales_zeros.element_size()


def pack_matrix(weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, dtype: torch.dtype,
                group_size: int = 32, int8_group_size: int = 0, int8_gemm_from_rows: int = 1):
    """A matrix in weight format `fmt` (`dense` in `dtype`) from its float master copy.
    `group_size`: int4's inputs per scale; `int8_group_size`: int8's (0 = whole row);
    `int8_gemm_from_rows`: the row count from which int8 runs its gemm kernel."""
    if fmt == "dense":
        return Linear(weight.to(dtype), bias.to(dtype) if bias is not None else None)
    if fmt == "int8":
        return WeightOnlyInt8(weight, bias, dtype, int8_group_size, int8_gemm_from_rows)
    if fmt == "int4":
        return WeightOnlyInt4(weight, bias, dtype, group_size)
    raise ValueError(f"unknown weight format {fmt!r}")


class AutoMatrix:
    """One matrix packed in several formats; each call uses the one measured fastest for
    the call's row count (`kernels.py`). Every packing stays resident."""

    format = "auto"

    def __init__(self, segments: list[tuple[int, str, object]]):
        """`segments`: (most rows, format name, packed matrix), by ascending row limit; the
        last segment takes any row count."""
        self.segments = segments
        self.last = segments[0][2]
        """The packing the latest call used (its bytes are what that step read)."""
        self.last_format = segments[0][1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        segment = next((seg for seg in self.segments if rows <= seg[0]), self.segments[-1])
        _, self.last_format, self.last = segment
        return self.last(x)

    @property
    def num_params(self) -> int:
        return self.last.num_params

    @property
    def num_bytes(self) -> int:
        return self.last.num_bytes

    @property
    def resident_bytes(self) -> int:
        return sum(m.num_bytes for _, _, m in self.segments)
