"""LoRA adapters over a loaded base model, applied per row inside one batch.

An adapter adds `scale · B·A` to some of the model's matrices (`A`: rank × inputs, `B`:
outputs × rank). Serving many adapters from one base (S-LoRA, Punica) does not merge them:
every row of a batch runs the base matrices once, together, and each adapter's rows then
get their low-rank update gathered — `x[rows] @ Aᵀ @ Bᵀ` added back into those rows — so rows
of different adapters, and rows of none, share one pass (Punica's SGMV, in plain torch
index operations).

Two file forms load:

- PEFT's: a folder (or its `adapter_model.safetensors`) with `adapter_config.json` (`r`,
  `lora_alpha`, `use_rslora`); tensors `...layers.{i}.{self_attn|mlp}.{q,k,v,o,gate,up,
  down}_proj.lora_{A,B}.weight`. Scale `alpha / r` (`alpha / √r` with rsLoRA).
- llama.cpp's (`convert_lora_to_gguf.py`): a GGUF with `general.type = adapter`,
  `adapter.lora.alpha`, tensors `blk.{i}.{attn_q,...,ffn_down}.weight.lora_{a,b}`.

Matrices are matched to the base by name and shape: an adapter made for another model is
refused with a sentence naming the first matrix that does not fit. PEFT adapters are trained
on Hugging Face weights; a GGUF's Q and K rows are stored in Hugging Face order for the
NeoX-rope families kvdeck runs (Gemma, Qwen), and permuted for Llama, where such an adapter
would not apply: it is refused.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvdeck.runtime.errors import ConfigError

PEFT_TARGETS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
                "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
GGUF_TARGETS = {"attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo",
                "ffn_gate": "w_gate", "ffn_up": "w_up", "ffn_down": "w_down"}
PEFT_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
GGUF_KEY = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")


@dataclass
class LoRAAdapter:
    """One adapter's low-rank updates, by (layer, matrix field of `LayerWeights`)."""

    name: str
    path: str
    rank: int
    scale: float
    updates: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    """(layer, matrix) → (A [rank, inputs], B [outputs, rank])."""

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.updates.values()
                   for t in pair)

    def to(self, device: torch.device, dtype: torch.dtype, copy: bool = False) -> LoRAAdapter:
        moved = {k: (a.to(device, dtype, copy=copy), b.to(device, dtype, copy=copy))
                 for k, (a, b) in self.updates.items()}
        return LoRAAdapter(self.name, self.path, self.rank, self.scale, moved)


def load_adapter(name: str, path: str | Path) -> LoRAAdapter:
    """An adapter from a PEFT folder or safetensors file, or a llama.cpp GGUF; ConfigError
    with one sentence for anything else."""
    p = Path(path)
    if p.suffix == ".gguf":
        return _from_gguf(name, p)
    folder = p if p.is_dir() else p.parent
    weights = p if p.is_file() else folder / "adapter_model.safetensors"
    config = folder / "adapter_config.json"
    if not weights.is_file() or not config.is_file():
        raise ConfigError(f"The LoRA adapter {name!r} at {path} is neither a PEFT folder "
                          "(adapter_config.json and adapter_model.safetensors) nor a "
                          "llama.cpp adapter GGUF.")
    from safetensors.torch import load_file

    def unreadable(e: Exception) -> ConfigError:
        return ConfigError(f"The LoRA adapter {name!r} at {path} could not be read "
                           f"({type(e).__name__}: {e}).")

    try:
        cfg = json.loads(config.read_text(encoding="utf-8"))
        rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise unreadable(e) from None
    if rank < 1 or cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ConfigError(f"The LoRA adapter {name!r} has rank {rank} or a per-matrix "
                          "rank_pattern/alpha_pattern; kvdeck serves adapters of one rank "
                          "of at least 1 for every matrix.")
    try:
        tensors = load_file(str(weights))
    except Exception as e:  # noqa: BLE001 - safetensors' own error is a bare Exception
        raise unreadable(e) from None
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return LoRAAdapter(name, str(path), rank, scale,
                       _pairs(name, tensors, PEFT_KEY, PEFT_TARGETS, "A", "B"))


def _from_gguf(name: str, path: Path) -> LoRAAdapter:
    from kvdeck.runtime.models.gguf import read_gguf
    from kvdeck.runtime.models.weights import dequantize

    try:
        g = read_gguf(path)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the sentence
        raise ConfigError(f"The LoRA adapter {name!r} at {path} could not be read "
                          f"({e}).") from None
    try:
        if g.metadata.get("general.type") != "adapter" or \
                g.metadata.get("adapter.type") != "lora":
            raise ConfigError(f"{path} is a GGUF but not a LoRA adapter (general.type "
                              f"{g.metadata.get('general.type')!r}).")
        tensors = {info.name: dequantize(g, info) for info in g.tensors.values()}
    finally:
        g.close()
    updates = _pairs(name, tensors, GGUF_KEY, GGUF_TARGETS, "a", "b")
    rank = next(iter(updates.values()))[0].shape[0]
    alpha = float(g.metadata.get("adapter.lora.alpha") or rank)
    return LoRAAdapter(name, str(path), rank, alpha / rank, updates)


def _pairs(name: str, tensors: dict[str, torch.Tensor], key: re.Pattern, targets: dict,
           a: str, b: str) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, t in tensors.items():
        m = key.search(tensor_name)
        if m is None or m.group(2) not in targets:
            raise ConfigError(f"The LoRA adapter {name!r} holds {tensor_name}, which is not "
                              "an update of an attention or feed-forward matrix kvdeck "
                              "knows.")
        halves.setdefault((int(m.group(1)), targets[m.group(2)]), {})[m.group(3)] = t.float()
    if not halves:
        raise ConfigError(f"The LoRA adapter {name!r} holds no updates.")
    pairs = {}
    for where, h in halves.items():
        if set(h) != {a, b}:
            raise ConfigError(f"The LoRA adapter {name!r} has only half of layer "
                              f"{where[0]}'s {where[1]} update.")
        pairs[where] = (h[a], h[b])
    return pairs


def check_fits(adapter: LoRAAdapter, masters: list[dict], arch: str, rope_style: str) -> None:
    """ConfigError unless every update matches a matrix of the base model (`masters`: per
    layer, each matrix's float weight [outputs, inputs] as loaded)."""
    if rope_style != "neox" and any(m in ("wq", "wk") for _, m in adapter.updates):
        raise ConfigError(f"The LoRA adapter {adapter.name!r} updates Q or K, whose rows a "
                          f"{arch} GGUF stores permuted from the Hugging Face order adapters "
                          "are trained in; kvdeck applies such adapters to Gemma and Qwen "
                          "models only.")
    for (layer, matrix), (a, b) in sorted(adapter.updates.items()):
        if a.shape[0] != adapter.rank:
            raise ConfigError(f"The LoRA adapter {adapter.name!r} has rank {a.shape[0]} at "
                              f"layer {layer}'s {matrix} and {adapter.rank} elsewhere; kvdeck "
                              "serves adapters of one rank for every matrix.")
        if layer >= len(masters):
            raise ConfigError(f"The LoRA adapter {adapter.name!r} was made for another base "
                              f"model: it updates layer {layer}, and this model has "
                              f"{len(masters)} layers.")
        w = masters[layer][matrix][0]
        if a.shape[1] != w.shape[1] or b.shape[0] != w.shape[0] or a.shape[0] != b.shape[1]:
            raise ConfigError(
                f"The LoRA adapter {adapter.name!r} was made for another base model: its "
                f"layer {layer} {matrix} update is {b.shape[0]}×{a.shape[1]} (rank "
                f"{a.shape[0]}), and this model's matrix is {w.shape[0]}×{w.shape[1]}.")


def write_gguf(adapter: LoRAAdapter, path: Path, arch: str) -> Path:
    """The adapter as llama.cpp's adapter GGUF (what `convert_lora_to_gguf.py` writes:
    `general.type = adapter`, `adapter.lora.alpha`, `blk.N.<matrix>.weight.lora_{a,b}` in
    float32) for a base model of architecture `arch`; llama.cpp scales by alpha / rank, so
    alpha is the adapter's scale × rank (rsLoRA's too). Written to a temporary name and
    renamed, so a reader never sees half a file."""
    import gguf

    names = {v: k for k, v in GGUF_TARGETS.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(".part")
    w = gguf.GGUFWriter(str(part), arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(adapter.scale * adapter.rank))
    for (layer, matrix), (a, b) in sorted(adapter.updates.items()):
        w.add_tensor(f"blk.{layer}.{names[matrix]}.weight.lora_a", a.float().numpy())
        w.add_tensor(f"blk.{layer}.{names[matrix]}.weight.lora_b", b.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    part.replace(path)
    return path


def merge(tensors: dict[str, torch.Tensor], adapter: LoRAAdapter) -> None:
    """Add the adapter into a base model's loaded GGUF tensors, in place: the merged model a
    batched adapter must agree with."""
    names = {v: k for k, v in GGUF_TARGETS.items()}
    for (layer, matrix), (a, b) in adapter.updates.items():
        key = f"blk.{layer}.{names[matrix]}.weight"
        w = tensors[key]
        tensors[key] = (w.float() + adapter.scale * (b.to(w.device) @ a.to(w.device))
                        ).to(w.dtype)


class AdapterSet:
    """The adapters one model serves, and which rows of the step now in flight use each.

    Every matrix's updates are stacked across adapters — `A` rows one after another, `B`
    columns likewise with each adapter's scale folded in — so a step applies all of them in
    two small matmuls per matrix, whatever the adapters' mix: `((x·Aᵀ) ⊙ M)·Bᵀ`, where the
    mask `M` keeps, in each row, only its own adapter's rank columns (Punica's BGMV, with the
    rows that use another adapter multiplied by zero rather than gathered: at these ranks
    the arithmetic is cheaper than the indexing)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, max_loras: int = 0):
        """`max_loras`: most adapters resident on the device at once (0: all). The others
        wait in host memory and are copied in when a step needs them, in place of one no
        row of that step uses, the least recently used (S-LoRA's on-demand loading)."""
        self.device, self.dtype, self.max_loras = device, dtype, max_loras
        self.host: dict[str, LoRAAdapter] = {}
        """Every adapter, in host memory (the copy a load starts from)."""
        self.adapters: dict[str, LoRAAdapter] = {}
        """The resident ones, on the device."""
        self._used: dict[str, int] = {}
        self._steps = 0
        self._columns: dict[str, slice] = {}
        """Each adapter's rank columns in the stacked updates."""
        self._stacked: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._mask: torch.Tensor | None = None

    def add(self, adapter: LoRAAdapter) -> None:
        self.host[adapter.name] = adapter.to(torch.device("cpu"), self.dtype)
        if not self.max_loras or len(self.adapters) < self.max_loras:
            self.adapters[adapter.name] = adapter.to(self.device, self.dtype)
            self._stack()

    def _stack(self) -> None:
        self._columns = {}
        start = 0
        for name, a in self.adapters.items():
            self._columns[name] = slice(start, start + a.rank)
            start += a.rank
        matrices = {key for a in self.adapters.values() for key in a.updates}
        self._stacked = {}
        for key in matrices:
            parts_a, parts_b = [], []
            for a in self.adapters.values():
                pair = a.updates.get(key)
                if pair is None:  # this adapter leaves the matrix alone: zero columns
                    inputs, outputs = self._dims(key)
                    pair = (torch.zeros(a.rank, inputs, device=self.device, dtype=self.dtype),
                            torch.zeros(outputs, a.rank, device=self.device,
                                        dtype=self.dtype))
                parts_a.append(pair[0])
                parts_b.append(pair[1] * a.scale)
            self._stacked[key] = (torch.cat(parts_a), torch.cat(parts_b, dim=1).T.contiguous())

    def _dims(self, key: tuple[int, str]) -> tuple[int, int]:
        a, b = next(a.updates[key] for a in self.adapters.values() if key in a.updates)
        return a.shape[1], b.shape[0]

    @property
    def num_bytes(self) -> int:
        return sum(a.num_bytes for a in self.adapters.values())

    @property
    def reserve_bytes(self) -> int:
        """Device bytes the adapters can take at most: the `max_loras` largest (all, with
        no limit) resident, each twice (its own copy and its columns in the stacked
        updates). The KV pool's budget leaves them out, as vLLM sizes LoRA slots before
        the KV cache."""
        sizes = sorted((a.num_bytes for a in self.host.values()), reverse=True)
        return 2 * sum(sizes[:self.max_loras or len(sizes)])

    def make_resident(self, needed: set[str]) -> tuple[list[tuple[str, int, float]],
                                                       list[str]]:
        """Load the `needed` adapters that are not resident, unloading the least recently
        used others to stay within `max_loras`; (loads as (name, bytes, seconds), unloads).
        The scheduler admits no more adapters into a batch than there are slots."""
        self._steps += 1
        for name in needed:
            self._used[name] = self._steps
        missing = [n for n in needed if n not in self.adapters]
        loads, unloads = [], []
        for name in missing:
            if self.max_loras and len(self.adapters) >= self.max_loras:
                idle = [n for n in self.adapters if n not in needed]
                assert idle, f"a step needs more than max_loras={self.max_loras} adapters"
                victim = min(idle, key=lambda n: self._used.get(n, 0))
                del self.adapters[victim]
                unloads.append(victim)
            start = time.perf_counter()
            copy = self.host[name].to(self.device, self.dtype, copy=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.adapters[name] = copy
            loads.append((name, copy.num_bytes, time.perf_counter() - start))
        if missing:
            self._stack()
        return loads, unloads

    def begin_step(self, rows: list[tuple[str | None, int]]) -> None:
        """The step's rows in order, as (adapter name or None, number of rows); every
        adapter named must be resident (`make_resident`)."""
        if all(name is None for name, _ in rows):
            self._mask = None
            return
        total = sum(n for _, n in rows)
        width = sum(a.rank for a in self.adapters.values())
        mask = torch.zeros(total, width, device=self.device, dtype=self.dtype)
        start = 0
        for name, n in rows:
            if name is not None:
                mask[start:start + n, self._columns[name]] = 1
            start += n
        self._mask = mask

    def apply(self, layer: int, matrix: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base matrix's output for `x`) with each row's adapter update added."""
        if self._mask is None:
            return y
        pair = self._stacked.get((layer, matrix))
        if pair is None:
            return y
        a, b_t = pair
        if x.dtype != a.dtype or y.dtype != a.dtype:  # e.g. int8 matrices' fp32 activations
            return y.add_((((x.to(a.dtype) @ a.T) * self._mask) @ b_t).to(y.dtype))
        return y.addmm_((x @ a.T) * self._mask, b_t)
