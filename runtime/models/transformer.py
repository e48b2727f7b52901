"""The decoder forward pass shared by every supported architecture.

It works on a *packed* batch: the new tokens of every scheduled chunk concatenated into one
`[T]` vector with their positions. Everything except attention is position-wise, so one
matmul per weight serves decode rows and prefill chunks together. Attention is delegated to
an `attend(layer, q, k, v)` callback: the paged executor writes K/V into blocks and reads
them back through block tables; the test reference keeps them contiguous.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvdeck.runtime.errors import ModelFileError
from kvdeck.runtime.models.arch import ModelConfig
from kvdeck.runtime.models.linear import Int8Linear, Linear, make_linear
from kvdeck.runtime.models.lora import AdapterSet

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(layer, q [T, H, d], k [T, KVH, d], v [T, KVH, d]) -> attention output [T, H, d]."""


Matmul = Callable[[torch.Tensor], torch.Tensor]
"""A packed matrix (`linear.py`): called on activations, with `num_params`, `num_bytes`."""
Packer = Callable[[torch.Tensor, "torch.Tensor | None", str, str], Matmul]
"""(master weight, bias, format, group) -> the matrix in that format."""
GROUP_MATRICES = {"attn": ("wq", "wk", "wv", "wo"), "ffn": ("w_gate", "w_up", "w_down")}


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    wq: Matmul
    wk: Matmul
    wv: Matmul
    wo: Matmul
    ffn_norm: torch.Tensor
    w_gate: Matmul
    w_up: Matmul
    w_down: Matmul
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class Transformer:
    """Weights plus the per-layer computations of one model."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], int8: bool = False,
                 int8_head: bool = False):
        """`int8` stores every matrix (not the embedding table used for lookups) as int8
        for FBGEMM's dynamic-quantization GEMM; `int8_head` only the output head. See
        `linear.py`."""
        self.cfg = cfg
        self.int8 = int8
        info = cfg.info
        self.num_heads, self.num_kv_heads, self.head_dim = \
            info.num_heads, info.num_kv_heads, info.head_dim
        self.emb = tensors["token_embd.weight"]
        head = tensors.get("output.weight", self.emb)  # tied to the embeddings when absent
        self.head_master = head
        self.head = make_linear(head, None, int8 or int8_head)
        self.shortlist_head: Int8Linear | None = None
        """An int8 copy of a wide float head, used to shortlist greedy candidates."""
        self.out_norm = tensors["output_norm.weight"]
        self.device, self.dtype = self.emb.device, self.emb.dtype
        self.masters: list[dict[str, tuple[torch.Tensor, torch.Tensor | None]]] = []
        """Per layer, each matrix's float weight and bias as loaded: what re-packing into
        another weight format starts from (dense weights in the compute dtype share it)."""
        self.layers = [self._layer(tensors, i) for i in range(info.num_layers)]
        self.weight_formats = {"attn": "dense", "ffn": "dense", "head": "dense"}
        rope_scale = tensors.get("rope_freqs.weight")
        d = self.head_dim
        self._inv_freq: dict[float, torch.Tensor] = {}
        for base in {cfg.rope_base(i) for i in range(info.num_layers)}:
            inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
            if rope_scale is not None:  # llama 3.x frequency factors
                inv = inv / rope_scale.float().cpu()
            self._inv_freq[base] = inv.to(self.device)
        self.embed_scale = info.hidden_size ** 0.5 if cfg.arch.embed_scale else None
        self.offload = None
        """An `offload.FFNOffload` whose hooks run around each layer, or None."""
        self.adapters: AdapterSet | None = None
        """LoRA adapters whose updates the rows of the step in flight get (`lora.py`)."""

    def _layer(self, t: dict[str, torch.Tensor], i: int) -> LayerWeights:
        p = f"blk.{i}."
        spec = self.cfg.arch

        def get(name: str, required: bool = True) -> torch.Tensor | None:
            """A layer tensor; one the architecture requires must be in the file."""
            tensor = t.get(p + name)
            if tensor is None and required:
                raise ModelFileError(f"The {spec.name} model file lacks tensor {p + name}, "
                                     "which its architecture requires.")
            return tensor

        masters: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.masters.append(masters)
        fields = {"attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo",
                  "ffn_gate": "w_gate", "ffn_up": "w_up", "ffn_down": "w_down"}

        def lin(name: str, bias: str | None = None) -> Matmul:
            # Biases are required where the architecture has them (Qwen2) and used when a
            # file of another family carries them anyway, as llama.cpp does.
            w, b = get(name), get(bias, spec.qkv_bias) if bias else None
            masters[fields[name.split(".")[0]]] = (w, b)
            return make_linear(w, b, self.int8)

        return LayerWeights(
            attn_norm=get("attn_norm.weight"), wq=lin("attn_q.weight", "attn_q.bias"),
            wk=lin("attn_k.weight", "attn_k.bias"), wv=lin("attn_v.weight", "attn_v.bias"),
            wo=lin("attn_output.weight"), ffn_norm=get("ffn_norm.weight"),
            w_gate=lin("ffn_gate.weight"), w_up=lin("ffn_up.weight"),
            w_down=lin("ffn_down.weight"),
            q_norm=get("attn_q_norm.weight", spec.qk_norm) if spec.qk_norm else None,
            k_norm=get("attn_k_norm.weight", spec.qk_norm) if spec.qk_norm else None,
            post_attn_norm=get("post_attention_norm.weight") if spec.post_norms else None,
            post_ffn_norm=get("post_ffw_norm.weight") if spec.post_norms else None,
        )

    # -- pieces -----------------------------------------------------------------------------

    def rope(self, x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
        """Rotate `x` [T, heads, d] by its positions; layout per the architecture."""
        angles = positions.float()[:, None] * self._inv_freq[base][None, :]  # [T, d/2]
        cos = angles.cos()[:, None, :].to(x.dtype)
        sin = angles.sin()[:, None, :].to(x.dtype)
        if self.cfg.arch.rope_style == "neox":
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)

    def mm(self, i: int, matrix: str, x: torch.Tensor) -> torch.Tensor:
        """Layer `i`'s `matrix` applied to `x`, with each LoRA row's update added."""
        y = getattr(self.layers[i], matrix)(x)
        return y if self.adapters is None else self.adapters.apply(i, matrix, x, y)

    def qkv(self, i: int, x: torch.Tensor, positions: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w, eps, t = self.layers[i], self.cfg.rms_eps, x.shape[0]
        h = rms_norm(x, w.attn_norm, eps)
        q = self.mm(i, "wq", h).view(t, self.num_heads, self.head_dim)
        k = self.mm(i, "wk", h).view(t, self.num_kv_heads, self.head_dim)
        v = self.mm(i, "wv", h).view(t, self.num_kv_heads, self.head_dim)
        if w.q_norm is not None:
            q = rms_norm(q, w.q_norm, eps)
            k = rms_norm(k, w.k_norm, eps)
        base = self.cfg.rope_base(i)
        return self.rope(q, positions, base), self.rope(k, positions, base), v

    def finish_layer(self, i: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        w, eps = self.layers[i], self.cfg.rms_eps
        o = self.mm(i, "wo", attn.reshape(x.shape[0], -1))
        if w.post_attn_norm is not None:
            o = rms_norm(o, w.post_attn_norm, eps)
        x = x + o
        h = rms_norm(x, w.ffn_norm, eps)
        gate = self.mm(i, "w_gate", h)
        gate = F.gelu(gate, approximate="tanh") if self.cfg.arch.activation == "gelu_tanh" \
            else F.silu(gate)
        f = self.mm(i, "w_down", gate * self.mm(i, "w_up", h))
        if w.post_ffn_norm is not None:
            f = rms_norm(f, w.post_ffn_norm, eps)
        return x + f

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb[tokens]
        return x * self.embed_scale if self.embed_scale is not None else x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the given rows of final hidden states."""
        return self.head(rms_norm(hidden, self.out_norm, self.cfg.rms_eps)).float()

    SHORTLIST = 64

    def update_shortlist(self, allowed: bool) -> None:
        """Give a wide fp32 head an int8 shortlist copy for greedy decoding where `allowed`
        (the CPU; see `greedy_tokens`), and drop it otherwise; other head formats are fast
        enough on their own."""
        head = self.head
        wanted = allowed and isinstance(head, Linear) and \
            head.weight.dtype == torch.float32 and head.weight.shape[0] >= Linear.WIDE
        if not wanted:
            self.shortlist_head = None
        elif self.shortlist_head is None:
            self.shortlist_head = Int8Linear(head.weight)

    def argmax_tokens(self, hidden: torch.Tensor, allowed: torch.Tensor | None = None
                      ) -> list[int]:
        """Greedy tokens: through the int8 shortlist where there is one, else the float
        logits' argmax; `allowed` [S, vocab] (bool) limits each row to a grammar's tokens."""
        tokens = self.greedy_tokens(hidden, allowed)
        if tokens is not None:
            return tokens
        logits = self.logits(hidden)
        if allowed is not None:
            allowed = _widen(allowed, logits.shape[-1]).to(logits.device)
            logits = logits.masked_fill(~allowed, float("-inf"))
        return logits.argmax(-1).tolist()

    def greedy_tokens(self, hidden: torch.Tensor, allowed: torch.Tensor | None = None
                      ) -> list[int] | None:
        """Argmax tokens via an int8 shortlist rescored exactly in float, or None when the
        model has no int8 shortlist head. `allowed` [S, vocab] (bool): only those tokens
        compete (a grammar's mask), in the shortlist and in the rescoring.

        The int8 head's logits err by ~0.3 on average; the exact float logits of its top 64
        candidates decide. The result equals the full-precision argmax unless that error
        pushed the true best token below 64 others — far outside the error measured here.
        """
        if self.shortlist_head is None:
            return None
        h = rms_norm(hidden, self.out_norm, self.cfg.rms_eps)
        approx = self.shortlist_head(h)
        if allowed is not None:
            allowed = _widen(allowed, approx.shape[-1]).to(approx.device)
            approx = approx.masked_fill(~allowed, float("-inf"))
        candidates = approx.topk(self.SHORTLIST, dim=-1).indices                    # [S, k]
        weights = self.head.weight[candidates]                                       # [S, k, d]
        exact = torch.einsum("sd,skd->sk", h.to(weights.dtype), weights)
        if allowed is not None:  # fewer than k allowed: the refused fill the shortlist
            exact = exact.masked_fill(~allowed.gather(1, candidates), float("-inf"))
        return candidates.gather(1, exact.argmax(-1, keepdim=True)).squeeze(1).tolist()

    # -- weight formats ---------------------------------------------------------------------

    def set_weight_formats(self, formats: dict[str, str], pack: Packer) -> None:
        """Re-pack the groups whose format changes (`weight_formats.py`) from the masters."""
        for group, fmt in formats.items():
            if self.weight_formats.get(group) == fmt:
                continue
            if group == "head":
                self.head = None  # drop the old packing before building the new one
                self.head = pack(self.head_master, None, fmt, group)
            else:
                for layer, masters in zip(self.layers, self.masters, strict=True):
                    for name in GROUP_MATRICES[group]:
                        setattr(layer, name, None)
                        setattr(layer, name, pack(*masters[name], fmt, group))
            self.weight_formats[group] = fmt

    def group_matrices(self, group: str) -> list[Matmul]:
        if group == "head":
            return [self.head]
        return [getattr(w, n) for w in self.layers for n in GROUP_MATRICES[group]]

    # -- whole pass -------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend
                ) -> torch.Tensor:
        """Final hidden states [T, hidden] for a packed batch of tokens at `positions`."""
        x = self.embed(tokens)
        off = self.offload
        if off is not None:
            off.begin()
        for i in range(len(self.layers)):
            if off is not None:
                off.before(i)
            q, k, v = self.qkv(i, x, positions)
            x = self.finish_layer(i, x, attend(i, q, k, v))
            if off is not None:
                off.after(i)
        return x

    def matrices(self) -> list[Matmul]:
        return [self.head] + [m for w in self.layers
                              for m in (w.wq, w.wk, w.wv, w.wo, w.w_gate, w.w_up, w.w_down)]

    @property
    def matrix_params(self) -> int:
        return sum(m.num_params for m in self.matrices())

    @property
    def matrix_weight_bytes(self) -> int:
        """Bytes of matrices one step reads once (the embedding only when tied)."""
        return sum(m.num_bytes for m in self.matrices())


def _widen(allowed: torch.Tensor, width: int) -> torch.Tensor:
    """A grammar mask over the tokenizer's vocabulary, refusing a head's padding rows."""
    extra = width - allowed.shape[-1]
    return torch.nn.functional.pad(allowed, (0, extra), value=False) if extra > 0 else allowed
