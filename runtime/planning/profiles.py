"""Hardware and model profiles: TOML data in `profiles/`, loaded into frozen dataclasses."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

from kvdeck.runtime.core.config import tomllib
from kvdeck.runtime.core.step_data import causal_pairs
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.kv.formats import KV_FORMATS, kv_bytes_per_token
from kvdeck.runtime.models.weight_formats import GROUPS
from kvdeck.runtime.planning.profile_tables import number, point_tables, whole
from kvdeck.runtime.planning.slot_save import SlotSave, slot_save_tables
from kvdeck.runtime.planning.wake import Wake, wake_tables
from kvdeck.runtime.resources import cache_dir, profile_names, profiles_dir


def user_profiles_dir() -> Path:
    """Profiles written by `kvdeck calibrate`; searched before the shipped ones."""
    return cache_dir() / "profiles"


def available_profiles(kind: str) -> list[str]:
    user = user_profiles_dir() / kind
    mine = [p.stem for p in user.glob("*.toml")] if user.is_dir() else []
    return sorted(set(mine) | set(profile_names(kind)))


def _load(kind: str, name: str) -> tuple[dict, str]:
    """(the profile's data, where it was read: the file's path). `name` is a profile's name
    (the user's own first, then the shipped ones) or the path of a `.toml` file."""
    path = user_profiles_dir() / kind / f"{name}.toml"
    if name.endswith(".toml") and Path(name).is_file():
        path = Path(name)
    elif not path.is_file():
        path = profiles_dir().joinpath(kind, f"{name}.toml")
    if not path.is_file():
        names = ", ".join(available_profiles(kind)) or "none"
        raise ConfigError(f"Unknown {kind} profile {name!r}; available: {names}.")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8")), str(path)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"Profile {path} is not valid TOML: {e}.") from None


def _need(data: dict, key: str, where: str):
    if key not in data:
        raise ConfigError(f"Profile {where} lacks the required key {key!r}.")
    return data[key]


def _number(data: dict, key: str, where: str, *, default: float | None = None,
            positive: bool = True, most: float | None = None, table: str = "") -> float:
    """A numeric field (in `[table]` if given), checked: one sentence naming the file, the
    field and the problem."""
    value = _need(data, key, where) if default is None else data.get(key, default)
    key = f"{table}.{key}" if table else key
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"Profile {where}: {key} must be a number, got {value!r}.")
    if not math.isfinite(value):
        raise ConfigError(f"Profile {where}: {key} must be a finite number, got {value!r}.")
    if positive and value <= 0 or not positive and value < 0:
        what = "greater than 0" if positive else "0 or more"
        raise ConfigError(f"Profile {where}: {key} must be {what}, got {value!r}.")
    if most is not None and value > most:
        raise ConfigError(f"Profile {where}: {key} must be at most {most}, got {value!r}.")
    return float(value)


@dataclass(frozen=True)
class HardwareProfile:
    """An accelerator: memory, bandwidth, peak compute, link and measured efficiencies."""

    name: str
    description: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    peak_flops: float
    power_watts: float
    link_bandwidth_bytes_per_s: float
    mfu: float
    mbu: float
    interconnect_bandwidth_bytes_per_s: float = 0.0
    """Card to card, one way (`[interconnect]`: NVLink where the card has it); a profile
    without the table talks over its host link (PCIe)."""

    @classmethod
    def load(cls, name: str) -> HardwareProfile:
        """The profile `name` (a user profile before a shipped one), validated: a missing
        or bad field gets one sentence naming the file, the field and the problem.
        Efficiencies a profile does not state (none measured yet) default to 0.5."""
        if name == "local" and "local" not in available_profiles("hardware"):
            return _measured_local()
        d, where = _load("hardware", name)
        link = d.get("link", {})
        eff = d.get("efficiency", {})
        inter = d.get("interconnect", {})
        if not isinstance(link, dict) or not isinstance(eff, dict) or \
                not isinstance(inter, dict):
            raise ConfigError(f"Profile {where}: [link], [interconnect] and [efficiency] must "
                              "be tables.")
        link_bw = _number(link, "bandwidth_bytes_per_s", where, default=0.0, positive=False,
                          table="link")
        return cls(
            name=name,
            description=str(d.get("description", name)),
            memory_bytes=int(_number(d, "memory_bytes", where)),
            bandwidth_bytes_per_s=_number(d, "bandwidth_bytes_per_s", where),
            peak_flops=_number(d, "peak_flops", where),
            power_watts=_number(d, "power_watts", where, default=0.0, positive=False),
            link_bandwidth_bytes_per_s=link_bw,
            mfu=_number(eff, "mfu", where, default=0.5, most=1.0, table="efficiency"),
            mbu=_number(eff, "mbu", where, default=0.5, most=1.0, table="efficiency"),
            interconnect_bandwidth_bytes_per_s=_number(
                inter, "bandwidth_bytes_per_s", where, default=link_bw, positive=False,
                table="interconnect"),
        )


@functools.cache
def _measured_local(device: str = "cpu") -> HardwareProfile:
    """`local`: this machine measured once per process: read bandwidth, matmul rate and the
    host link (`executors/link.py`); memory from the OS (or the GPU). Efficiencies come from
    this machine's calibrated profile (`kvdeck calibrate`) when there is one, else 0.5."""
    import psutil
    import torch

    from kvdeck.runtime.executors.link import measure_link
    from kvdeck.runtime.planning.machine import local_name, measure_machine
    from kvdeck.runtime.planning.power import nvml_power

    bandwidth, flops = measure_machine(device)
    link = measure_link(torch.device(device)).bandwidth
    memory = torch.cuda.get_device_properties(device).total_memory \
        if device.startswith("cuda") else psutil.virtual_memory().total
    mfu = mbu = 0.5
    calibrated = user_profiles_dir() / "hardware" / f"{local_name(device)}.toml"
    if calibrated.is_file():
        own = HardwareProfile.load(local_name(device))
        mfu, mbu = own.mfu, own.mbu
    power = nvml_power(torch.device(device).index or 0) if device.startswith("cuda") else None
    return HardwareProfile("local", f"this machine ({device}), measured now", int(memory),
                           bandwidth, flops, power.limit_w if power else 0.0, link, mfu, mbu)


@dataclass(frozen=True)
class StepFit:
    """`fixed + per_token × new tokens + per_pair × causal pairs [+ per_sample × rows whose
    logits are computed] [+ per_context × KV positions read] [+ mixed, in a step that runs
    prompt tokens beside decode rows]` (seconds). The per-sample term
    is what a wide output head costs per sampled row (Gemma 3's 262,144-token head is 63 % of
    the 270M model's matrix weights, so a decode row costs several times a prefill token).
    The per-context term is what reading a cached position costs apart from the pairs it
    joins: a decode row reads its whole context for one pair each, a prefill chunk of `c`
    tokens reads `h + c` positions for `c·h + c(c+1)/2` pairs, so one pair coefficient
    cannot price both (measured: llama.cpp's fit found no pair cost at all and priced deep
    decode steps low). `kvdeck calibrate` fits both; callers that do not know the sampled
    rows or the context leave them out."""

    fixed_s: float
    per_token_s: float
    per_pair_s: float
    per_sample_s: float = 0.0
    overhead_s: float = 0.0
    """A request's way through the server outside its steps — HTTP in, tokenizing, the
    first token streamed out — as `kvdeck calibrate --url` separates it from the steps it
    times from outside (0: fitted inside an executor). Not part of a step: the sim's runs
    take a request in this long after it was sent (`runs/runner.py`)."""
    per_context_s: float = 0.0
    mixed_s: float = 0.0
    """What a step that carries both prompt chunks and decode rows costs beyond its tokens
    (kvdeck's torch executor runs its prompt chunks and its decode rows through two attention
    paths; docs/planner.md says how calibrate times it). 0 where no mixed step was timed."""

    def seconds(self, num_new_tokens: float, num_pairs: float, num_sampled: float = 0.0,
                num_context: float = 0.0, mixed: bool = False) -> float:
        return self.fixed_s + self.per_token_s * num_new_tokens + self.per_pair_s * num_pairs \
            + self.per_sample_s * num_sampled + self.per_context_s * num_context \
            + (self.mixed_s if mixed else 0.0)

    def to_json(self) -> dict[str, float]:
        """In the units a profile's `[fit.<hw>]` table and `calibrate --json` give."""
        return {"fixed_ms": self.fixed_s * 1e3, "per_token_us": self.per_token_s * 1e6,
                "per_pair_ns": self.per_pair_s * 1e9, "per_sample_us": self.per_sample_s * 1e6,
                "overhead_ms": self.overhead_s * 1e3, "per_context_ns": self.per_context_s * 1e9,
                "mixed_ms": self.mixed_s * 1e3}


def matrix_params(info) -> int:
    """Weights in the matrices a decode step reads, from a dense model's shape (`ModelInfo`):
    per layer Q and O (`hidden × heads·d`), K and V (`hidden × kv_heads·d`) and the three
    FFN matrices (`hidden × ffn`), plus the output head (`vocab × hidden`)."""
    h, d = info.hidden_size, info.head_dim
    per_layer = h * d * (2 * info.num_heads + 2 * info.num_kv_heads) + 3 * h * info.ffn_size
    return info.num_layers * per_layer + info.vocab_size * h


ASSUMED_GROUP_SHARES = {"attn": 0.25, "ffn": 0.65, "head": 0.10}
"""Weight-group shares assumed for a profile that gives none (an older user profile):
typical of 8B-class models. Shipped profiles and every GGUF-derived one carry their own."""


@dataclass(frozen=True)
class ModelProfile:
    """A model's shape and weight sizes, enough to model its steps without its weights."""

    name: str
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    weight_bytes: int
    matrix_weight_bytes: int
    context_length: int
    bytes_per_weight: float
    fits: dict[str, StepFit] = field(default_factory=dict)
    """Fitted step-time models by hardware profile name."""
    sliding_window: int = 0
    """Window of the local (sliding-window) layers in tokens; 0 when every layer is global."""
    num_local_layers: int = 0
    """Layers that attend within `sliding_window` (Gemma 3: 15 of 18)."""
    source: str = ""
    """Where the profile came from: its TOML file, or the GGUF it was generated from."""
    decode_times: dict[str, tuple[tuple[int, int, float], ...]] = field(default_factory=dict)
    """Measured decode steps by hardware profile name: (batch, context, seconds), written
    by `kvdeck calibrate`; the planner interpolates them (`decode_seconds`)."""
    decode_pinned: frozenset[str] = frozenset()
    """Hardware names whose measured decode steps of several rows ran in neighbouring
    slots of llama-server, one pass each (`pinned = true`: `calibrate --url` sent them
    with `id_slot`); the sim's `--server-slots` is corrected by them all, not only by one
    row and every slot's."""
    prefill_times: dict[str, tuple[tuple[int, int, float], ...]] = field(
        default_factory=dict)
    """Measured prefill steps by hardware profile name: (new tokens, cached tokens before
    them, seconds of the step alone), written by `kvdeck calibrate`; a fitted step is
    corrected by them (`prefill_factor`)."""
    wake_times: dict[str, Wake] = field(default_factory=dict)
    """What the first step after an idle spell costs beyond the same step back to back, by
    hardware profile name: (idle seconds, extra seconds), written by `kvdeck calibrate --url`
    (`wake.py`); the sim adds it after each idle spell."""
    slot_saves: dict[str, SlotSave] = field(default_factory=dict)
    """What saving a slot's state to llama-server's prompt cache took, by hardware profile
    name: (tokens, seconds), written by `kvdeck calibrate --url` (`slot_save.py`); the sim's
    `--server-slots` holds its loop for the saves a launch makes."""
    group_bytes: dict[str, int] = field(default_factory=dict)
    """Matrix bytes per weight group (`attn`, `ffn`, `head`): from the GGUF's tensors, or
    the profile's `[weight_groups]` table; empty when a profile gives none."""
    prefill_mfu: dict[str, float] = field(default_factory=dict)
    """Measured prefill efficiency by hardware name (the measured step model prices a
    step's matmuls and attention at it; `step_time.py`)."""
    kv_convert_s_per_byte: dict[str, dict[str, float]] = field(default_factory=dict)
    """Measured extra time per byte of KV read in each format, by hardware name: what
    converting that format in attention costs beyond the bytes it saves. A format missing
    here has no measured conversion cost on that card."""

    @functools.cached_property
    def group_shares(self) -> dict[str, float]:
        """Each weight group's share of the matrix bytes (Qwen3-8B: 0.20 / 0.72 / 0.08),
        `ASSUMED_GROUP_SHARES` for a profile that gives no groups."""
        total = sum(self.group_bytes.values())
        if not total:
            return dict(ASSUMED_GROUP_SHARES)
        return {g: b / total for g, b in self.group_bytes.items()}

    def ffn_layer_bytes(self, matrix_bytes: float | None = None) -> float:
        """One layer's FFN matrices out of `matrix_bytes` (default: the profile's)."""
        total = self.matrix_weight_bytes if matrix_bytes is None else matrix_bytes
        return total * self.group_shares["ffn"] / self.num_layers

    def decode_seconds(self, hardware: str, batch: int, context: int) -> float | None:
        """A decode step of `batch` rows at `context`, interpolated from the measured steps
        on `hardware`: linearly in context at each measured batch (extended past the ends
        by the nearest two points), then linearly between the measured batches around
        `batch`. None outside the measured batches and contexts (the fit decides there: a
        noisy pair of points extended far would run to nothing), or without measurements."""
        points = self.decode_times.get(hardware)
        if not points:
            return None
        batches = sorted({b for b, _, _ in points})
        contexts = [c for _, c, _ in points]
        if not batches[0] <= batch <= batches[-1] or \
                not min(contexts) <= context <= max(contexts):
            return None

        def at(b: int) -> float:
            rows = sorted((c, s) for bb, c, s in points if bb == b)
            if len(rows) == 1:
                return rows[0][1]
            i = next((j for j in range(1, len(rows) - 1) if context <= rows[j][0]),
                     len(rows) - 1)
            (c0, s0), (c1, s1) = rows[i - 1], rows[i]
            return s0 + (s1 - s0) * (context - c0) / (c1 - c0) if c1 != c0 else s1

        hi = next(b for b in batches if b >= batch)
        lo = max(b for b in batches if b <= batch)
        if hi == lo:
            return max(at(lo), 0.0)
        return max(at(lo) + (at(hi) - at(lo)) * (batch - lo) / (hi - lo), 0.0)

    def prefill_factor(self, hardware: str, fit: StepFit, tokens: int, history: int
                       ) -> float:
        """How far the measured prefill steps on `hardware` sit from `fit` near a step of
        `tokens` new tokens on `history` cached ones: their measured / fitted ratios,
        weighted by the inverse square of their distance in (log tokens, log history) —
        exactly a measured step's ratio at that step. A linear fit through steps whose cost
        is not linear in their tokens (a CPU's matmuls speed up and slow down with the
        shape) misses each (torch on 2 cores: by −10 to +12 %), and a trace that runs one
        kind of step over and over inherits that miss; the correction keeps the fit
        between the measurements and the measurements where they are. 1 without measured
        prefill steps."""
        points = self.prefill_times.get(hardware)
        if not points:
            return 1.0
        here = (math.log2(max(tokens, 1)), math.log2(1 + max(history, 0)))
        num = den = 0.0
        for n, h, seconds in points:
            fitted = fit.seconds(n, causal_pairs(n, h), 1, n + h)
            if fitted <= 0:
                continue
            d2 = (here[0] - math.log2(n)) ** 2 + (here[1] - math.log2(1 + h)) ** 2
            if d2 < 1e-12:
                return seconds / fitted
            num += seconds / fitted / d2
            den += 1 / d2
        return num / den if den else 1.0

    def decode_factor(self, hardware: str, fit: StepFit, batch: int, context: int) -> float:
        """How far the measured decode steps on `hardware` sit from `fit` at a step of
        `batch` rows, each on `context` earlier positions: at each measured batch the
        measured / fitted ratio, linear in log context between its measured contexts (the
        nearest one's beyond them), then linear in the batch between the measured batches
        around `batch` (the nearest one's beyond them). A line through decode steps misses
        some of them (torch on 2 cores: one row at context 76 by +9 %), and a trace that
        runs that shape step after step inherits the miss. A ratio,
        not the measured time, carries past the measured contexts, so the fit's context
        term still grows the step there. 1 without measured decode steps."""
        return ratio_at(self.decode_ratios(hardware, fit), batch, context)

    def decode_ratios(self, hardware: str, fit: StepFit) -> dict[int, list[tuple[float, float]]]:
        """The measured decode steps on `hardware` over `fit`, by batch: (log2(1 + context),
        measured / fitted) ascending — what `decode_factor` interpolates, worked out once
        by a caller that asks for many steps (`ratio_at`)."""
        curves: dict[int, list[tuple[float, float]]] = {}
        for b, c, seconds in self.decode_times.get(hardware, ()):
            fitted = fit.seconds(b, b * causal_pairs(1, c), b, b * (c + 1))
            if fitted > 0:
                curves.setdefault(b, []).append((math.log2(1 + c), seconds / fitted))
        return {b: sorted(points) for b, points in curves.items()}

    def kv_bytes_per_token(self, kv_format: str | None = None) -> int:
        """K and V bytes of one token in every layer (a context within every window)."""
        fmt = KV_FORMATS[kv_format or self.kv_dtype]
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, fmt)

    def kv_bytes_per_layer_token(self, kv_format: str | None = None) -> int:
        """K and V bytes of one token in one layer."""
        return self.kv_bytes_per_token(kv_format) // self.num_layers

    def kv_bytes(self, num_tokens: int, block_size: int, kv_format: str | None = None) -> int:
        """KV bytes a sequence of `num_tokens` holds, block-rounded, with sliding-window
        layers counted as their window: `global layers × ceil(L/p)` blocks plus `local
        layers × min(ceil(L/p), ceil(w/p) + 1)` (a window of `w` positions can straddle
        one more block than `w/p`), each block `p` tokens of one layer's K and V."""
        blocks = -(-num_tokens // block_size)
        local = min(blocks, -(-self.sliding_window // block_size) + 1) \
            if self.sliding_window else blocks
        layer_blocks = (self.num_layers - self.num_local_layers) * blocks \
            + self.num_local_layers * local
        return layer_blocks * block_size * self.kv_bytes_per_layer_token(kv_format)

    @classmethod
    def from_gguf(cls, target: str) -> ModelProfile:
        """A profile generated from a GGUF's header (a model name kvdeck knows, or a path),
        as `kvdeck models` reads it: shape, weight bytes and sliding-window layers. It has
        no fitted timing (`kvdeck calibrate` writes one)."""
        from kvdeck.runtime.models.info import read_model_info
        from kvdeck.runtime.models.registry import resolve_model

        info = read_model_info(resolve_model(target))
        return cls(
            name=target, architecture=info.architecture, num_layers=info.num_layers,
            num_heads=info.num_heads, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
            kv_dtype="fp16", weight_bytes=info.weight_bytes,
            matrix_weight_bytes=info.matrix_weight_bytes,
            context_length=info.context_length,
            bytes_per_weight=info.matrix_weight_bytes / max(matrix_params(info), 1),
            sliding_window=info.sliding_window or 0,
            num_local_layers=len(info.sliding_window_layers) if info.sliding_window else 0,
            source=str(info.path), group_bytes=dict(info.group_bytes))

    @property
    def matrix_params(self) -> float:
        return self.matrix_weight_bytes / self.bytes_per_weight

    @classmethod
    def load(cls, name: str) -> ModelProfile:
        """The profile `name` from `profiles/models/` (a user profile first), validated like
        hardware profiles; a name with no profile that is a model kvdeck knows or a GGUF
        path is generated from the file's header (`from_gguf`)."""
        if name not in available_profiles("models"):
            from kvdeck.runtime.errors import ModelFileError, ModelNotFoundError

            try:
                return cls.from_gguf(name)
            except ModelNotFoundError:
                names = ", ".join(available_profiles("models"))
                raise ConfigError(f"Unknown model profile {name!r}; available: {names}, or a "
                                  "model name or GGUF path (generated from its header).") \
                    from None
            except ModelFileError as e:
                raise ConfigError(f"No model profile {name!r}, and as a GGUF: {e}") from None
        d, where = _load("models", name)
        fits = {}
        for hw, f in d.get("fit", {}).items():
            if not isinstance(f, dict):
                raise ConfigError(f"Profile {where}: fit.{hw} must be a table.")
            t = f"fit.{hw}"
            fits[hw] = StepFit(_number(f, "fixed_ms", where, positive=False, table=t) / 1e3,
                               _number(f, "per_token_us", where, positive=False, table=t) / 1e6,
                               _number(f, "per_pair_ns", where, positive=False, table=t) / 1e9,
                               _number(f, "per_sample_us", where, default=0.0, positive=False,
                                       table=t) / 1e6,
                               _number(f, "overhead_ms", where, default=0.0, positive=False,
                                       table=t) / 1e3,
                               _number(f, "per_context_ns", where, default=0.0, positive=False,
                                       table=t) / 1e9,
                               _number(f, "mixed_ms", where, default=0.0, positive=False,
                                       table=t) / 1e3)
        decode_times, prefill_mfu, kv_convert, pinned = _decode_tables(d, where)
        prefill_times = _prefill_tables(d, where)
        kv_dtype = str(d.get("kv_dtype", "bf16"))
        if kv_dtype not in KV_FORMATS:
            raise ConfigError(f"Profile {where}: kv_dtype must be one of "
                              f"{', '.join(KV_FORMATS)}, got {kv_dtype!r}.")

        def whole(key: str, **kw) -> int:
            value = _number(d, key, where, **kw)
            if value != int(value):
                raise ConfigError(f"Profile {where}: {key} must be a whole number, got {value}.")
            return int(value)

        num_layers = whole("num_layers")
        local = whole("num_local_layers", default=0, positive=False)
        if local > num_layers:
            raise ConfigError(f"Profile {where}: num_local_layers must be at most num_layers "
                              f"({num_layers}), got {local}.")
        return cls(
            name=name,
            architecture=str(d.get("architecture", name)),
            num_layers=num_layers,
            num_heads=whole("num_heads"),
            num_kv_heads=whole("num_kv_heads"),
            head_dim=whole("head_dim"),
            kv_dtype=kv_dtype,
            weight_bytes=whole("weight_bytes"),
            matrix_weight_bytes=whole("matrix_weight_bytes"),
            context_length=whole("context_length"),
            bytes_per_weight=_number(d, "bytes_per_weight", where, default=2.0),
            fits=fits,
            sliding_window=whole("sliding_window", default=0, positive=False),
            num_local_layers=local,
            source=where,
            decode_times=decode_times,
            decode_pinned=pinned,
            prefill_times=prefill_times,
            wake_times=wake_tables(d, where),
            slot_saves=slot_save_tables(d, where),
            group_bytes=_weight_groups(d, where),
            prefill_mfu=prefill_mfu,
            kv_convert_s_per_byte=kv_convert,
        )


def _decode_tables(d: dict, where: str) -> tuple[dict, dict, dict, frozenset[str]]:
    """A model profile's `[decode.<hardware>]` tables: the measured decode steps
    (`points`), the measured prefill efficiency (`prefill_mfu`) and the measured cost of
    reading KV in another format (`[decode.<hardware>.convert_ms_per_gb]`), each by
    hardware name; and the hardware names whose steps ran pinned to slots (`pinned`)."""
    points_by, mfu_by, convert_by, pinned = {}, {}, {}, set()
    for hw, table in d.get("decode", {}).items():
        points = table.get("points") if isinstance(table, dict) else None
        if not isinstance(points, list) or not points or not all(
                isinstance(p, list) and len(p) == 3 and all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0
                    for x in p) for p in points):
            raise ConfigError(f"Profile {where}: decode.{hw}.points must be a list of "
                              "[batch, context, milliseconds] triples of positive "
                              f"numbers, got {points!r}.")
        points_by[hw] = tuple((int(b), int(c), ms / 1e3) for b, c, ms in points)
        t = f"decode.{hw}"
        if not isinstance(is_pinned := table.get("pinned", False), bool):
            raise ConfigError(f"Profile {where}: {t}.pinned must be true or false, got "
                              f"{is_pinned!r}.")
        if is_pinned:
            pinned.add(hw)
        if "prefill_mfu" in table:
            mfu_by[hw] = _number(table, "prefill_mfu", where, most=1.0, table=t)
        convert = table.get("convert_ms_per_gb", {})
        if not isinstance(convert, dict) or not set(convert) <= set(KV_FORMATS):
            raise ConfigError(f"Profile {where}: {t}.convert_ms_per_gb must be a table of KV "
                              f"formats ({', '.join(KV_FORMATS)}), got {convert!r}.")
        convert_by[hw] = {f: _number(convert, f, where, positive=False,
                                     table=f"{t}.convert_ms_per_gb") / 1e3 / 1e9
                          for f in convert}
    return points_by, mfu_by, convert_by, frozenset(pinned)


def _prefill_tables(d: dict, where: str) -> dict[str, tuple[tuple[int, int, float], ...]]:
    """A model profile's `[prefill.<hardware>]` tables: the measured prefill steps
    (`points`, [new tokens, cached tokens, milliseconds]) by hardware name."""
    return {hw: tuple((int(n), int(h), ms / 1e3) for n, h, ms in points)
            for hw, points in point_tables(
                d, where, "prefill", 3, lambda p: whole(p[0]) and whole(p[1])
                and number(p[2]) and p[0] > 0 and p[1] >= 0 and p[2] > 0,
                "[new tokens, cached tokens, milliseconds] triples (whole tokens above 0, "
                "whole cached tokens 0 or more, time above 0)").items()}


def _weight_groups(d: dict, where: str) -> dict[str, int]:
    """A model profile's `[weight_groups]` table (`attn`, `ffn`, `head` matrix bytes), or {}
    without one."""
    table = d.get("weight_groups")
    if table is None:
        return {}
    if not isinstance(table, dict) or set(table) != set(GROUPS) or not all(
            isinstance(table[g], int) and not isinstance(table[g], bool) and table[g] > 0
            for g in GROUPS):
        raise ConfigError(f"Profile {where}: weight_groups must give attn, ffn and head, each "
                          f"a whole number of bytes above 0, got {table!r}.")
    return {g: table[g] for g in GROUPS}


def _clamped_line(points: list[tuple[float, float]], x: float) -> float:
    """`points` (ascending x) joined by straight lines, held level beyond the ends."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            return y1 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def ratio_at(curves: dict[int, list[tuple[float, float]]], batch: int, context: int) -> float:
    """`ModelProfile.decode_factor` from its `decode_ratios`: 1 where there are none."""
    if not curves:
        return 1.0
    x = math.log2(1 + max(context, 0))
    batches = sorted(curves)
    lo = max((b for b in batches if b <= batch), default=batches[0])
    hi = min((b for b in batches if b >= batch), default=batches[-1])
    at_lo = _clamped_line(curves[lo], x)
    if lo == hi:
        return at_lo
    return at_lo + (_clamped_line(curves[hi], x) - at_lo) * (batch - lo) / (hi - lo)
