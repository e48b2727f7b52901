"""What a weight or KV format costs in accuracy, measured against fp32 weights with fp32 KV.

Two measures on a fixed text shipped with the project (`runtime/text/passage.txt`):

- **Teacher-forced agreement**: the text's first `QUALITY_TOKENS` tokens go through the
  model in one pass; at every position the format under test and the reference each pick
  their top-1 next token. Reported: the share of positions where they agree, and the mean
  |Δlogit| over the reference's `TOP_K` most likely tokens at each position (where the
  choice is made; the long tail of a 262K vocabulary would only dilute it). Where they
  disagree, the reference's margin between its top two logits says whether that was a
  near-tie.
- **Greedy continuation**: three fixed prompts, 32 greedy tokens each through the paged
  engine; the length of the continuation identical to the reference's.

KV formats enter teacher forcing exactly as in the paged pool: K and V are encoded and
decoded (`kv_codecs.py`) before attention reads them. Results are cached per model file and
format in `$KVDECK_CACHE/quality/` — computed once, not on every switch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvdeck.runtime.core.step_data import common_prefix
from kvdeck.runtime.executors.kv_codecs import KVCodec
from kvdeck.runtime.models.transformer import Transformer
from kvdeck.runtime.resources import PASSAGE, cache_dir

QUALITY_TOKENS = 512
TOP_K = 64
PROMPTS = ("The capital of France is", "def fibonacci(n):\n    ",
           "The three primary colors are")
CONTINUATION = 32


@dataclass
class Reference:
    """The fp32 reference at each position: top-1, top-two margin and top-K logits."""

    top1: list[int]
    margin: list[float]
    top_ids: list[list[int]]
    top_logits: list[list[float]]


@dataclass
class Quality:
    """One format's accuracy against the reference."""

    label: str
    top1_agreement: float
    mean_abs_dlogit: float
    disagreements: list[tuple[int, float]]
    """(position, the reference's top-two margin there) where the top-1 differs."""
    identical_greedy: list[int] | None = None
    """Per fixed prompt, greedy tokens identical to the reference (None: not measured)."""

    def short(self) -> str:
        """A few words for the knobs panel."""
        return f"top-1 {self.top1_agreement:.1%} · |Δ| {self.mean_abs_dlogit:.2f}"

    def line(self) -> str:
        g = f", greedy identical {'/'.join(map(str, self.identical_greedy))} of " \
            f"{CONTINUATION}" if self.identical_greedy is not None else ""
        return (f"{self.label}: top-1 {self.top1_agreement:.1%}, mean |Δlogit| "
                f"{self.mean_abs_dlogit:.3f}{g}")


@torch.inference_mode()
def teacher_forced_logits(model: Transformer, tokens: list[int],
                          kv: KVCodec | None = None) -> torch.Tensor:
    """Float32 logits [L, vocab] for every position in one causal pass; with `kv`, keys and
    values are stored and read back in that format first, as the paged pool does."""
    n = len(tokens)
    pos = torch.arange(n, device=model.device)

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if kv is not None:
            k = kv.decode(kv.encode(k), q.dtype)
            v = kv.decode(kv.encode(v), q.dtype)
        window = model.cfg.window(layer)
        allowed = pos[None, :] <= pos[:, None]
        if window is not None:
            allowed &= pos[None, :] > pos[:, None] - window
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=allowed, scale=model.cfg.attn_scale, enable_gqa=True)
        return o[0].transpose(0, 1)

    hidden = model.forward(torch.tensor(tokens, device=model.device), pos, attend)
    return model.logits(hidden)


def reference_from(logits: torch.Tensor) -> Reference:
    top = logits.topk(TOP_K, dim=-1)
    return Reference(top.indices[:, 0].tolist(),
                     (top.values[:, 0] - top.values[:, 1]).tolist(),
                     top.indices.tolist(), top.values.tolist())


def compare(label: str, logits: torch.Tensor, ref: Reference) -> Quality:
    ids = torch.tensor(ref.top_ids)
    got = logits.float().gather(1, ids.to(logits.device)).cpu()
    dlogit = (got - torch.tensor(ref.top_logits)).abs().mean().item()
    top1 = logits.argmax(-1).tolist()
    disagree = [(i, ref.margin[i]) for i, (a, b) in enumerate(zip(top1, ref.top1,
                                                                   strict=True)) if a != b]
    return Quality(label, 1 - len(disagree) / len(top1), dlogit, disagree)


class QualityCache:
    """Quality figures per model file and format label, kept as JSON."""

    @classmethod
    def for_executor(cls, executor, part: str, directory: Path | None = None
                     ) -> QualityCache:
        """The cache of a `TorchExecutor`'s figures for `part`: "weights" (keyed also by
        group sizes and the activation dtypes of quantized products, which need the
        kernel table) or "kv" (by the compute dtype only)."""
        variant = f"compute {executor.dtype_name}"
        if part == "weights":
            act = executor.packer.activations_for
            variant += (f", int8 g{executor.packer.int8_group_size} {act('int8')}, int4 "
                        f"g{executor.packer.int4_group_size} {act('int4')}")
        return cls(executor.info.model_path, directory, f"{part}: {variant}")

    def __init__(self, model_path: Path, directory: Path | None = None, variant: str = ""):
        """`variant`: what else decides the figures (group sizes, activation dtypes)."""
        st = model_path.stat()
        key = (f"{model_path.resolve()}|{st.st_size}|{QUALITY_TOKENS}|{TOP_K}|{CONTINUATION}"
               f"|{variant}")
        name = hashlib.sha1(key.encode()).hexdigest()[:16]
        self.path = (directory or cache_dir() / "quality") / f"{name}.json"
        try:
            self.data: dict = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.data = {}

    def get(self, label: str) -> Quality | None:
        d = self.data.get(label)
        if d is None:
            return None
        d = dict(d)
        d["disagreements"] = [tuple(x) for x in d["disagreements"]]
        return Quality(**d)

    def put(self, q: Quality) -> None:
        self.data[q.label] = asdict(q)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.data))
        except OSError:
            pass  # a read-only cache only costs a recomputation


def measure_formats(executor, tokenizer, weight_formats: tuple[str, ...],
                    kv_formats: tuple[str, ...], directory: Path | None = None,
                    greedy: bool = True, use_cache: bool = True) -> list[Quality]:
    """Quality of each weight format (with fp32 KV) and each KV format (with dense fp32
    weights) on a `TorchExecutor` whose compute dtype is fp32. Cached figures are reused
    and new ones cached (`QualityCache.for_executor`); the executor is left with dense
    weights."""
    from kvdeck.runtime.core.config import EngineConfig, Knobs
    from kvdeck.runtime.core.engine import Engine
    from kvdeck.runtime.core.request import SamplingParams
    from kvdeck.runtime.executors.kv_codecs import get_codec
    from kvdeck.runtime.models.weight_formats import GROUPS, format_weight_format

    # (label, weight format, KV format): each format measured with the other at fp32.
    cases = [(f"weights {w}", w, "fp32") for w in weight_formats] + \
        [(f"kv {k}", "dense", k) for k in kv_formats]
    caches = {part: QualityCache.for_executor(executor, part, directory)
              for part in ("weights", "kv")} if use_cache else {}
    cached = {label: caches[label.split()[0]].get(label)
              for label, _, _ in cases} if caches else {}

    def usable(q: Quality | None) -> bool:
        return q is not None and (q.identical_greedy is not None or not greedy)

    if caches and all(usable(q) for q in cached.values()):
        return [cached[label] for label, _, _ in cases]
    tokens = tokenizer.encode(PASSAGE.read_text(encoding="utf-8"))[:QUALITY_TOKENS]
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=CONTINUATION, ignore_eos=True)

    def set_weights(fmt: str) -> None:
        executor.set_weight_formats({g: fmt for g in GROUPS})

    def continuations(kv_format: str) -> list[list[int]]:
        knobs = Knobs(kv_format=kv_format,
                      weight_format=format_weight_format(executor.weight_formats))
        e = Engine(EngineConfig(kv_memory_bytes=64 << 20, knobs=knobs), executor)
        reqs = [e.add_request(p, params, request_id=f"q{i}") for i, p in enumerate(prompts)]
        e.run_until_idle()
        return [list(r.output_token_ids) for r in reqs]

    set_weights("dense")
    ref = reference_from(teacher_forced_logits(executor.model, tokens).cpu())
    ref_greedy = continuations("fp32") if greedy else []
    out: list[Quality] = []
    for label, weights, kv in cases:
        q = cached.get(label)
        if not usable(q):
            set_weights(weights)
            codec = get_codec(kv, executor.cfg.info.head_dim, executor.device) \
                if kv != "fp32" else None
            q = compare(label, teacher_forced_logits(executor.model, tokens, codec).cpu(), ref)
            if greedy:
                q.identical_greedy = [common_prefix(a, b) for a, b in
                                      zip(continuations(kv), ref_greedy, strict=True)]
            if caches:
                caches[label.split()[0]].put(q)
        out.append(q)
    set_weights("dense")
    return out
