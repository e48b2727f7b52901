"""Hardware and model profiles: TOML data in `profiles/`, loaded into frozen dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from runtime.config import tomllib
from runtime.errors import ConfigError
from runtime.kv.formats import KV_FORMATS, kv_bytes_per_token
from runtime.resources import cache_dir, profile_names, profiles_dir


def user_profiles_dir() -> Path:
    """Profiles written by `kvdeck calibrate`; searched before the shipped ones."""
    return cache_dir() / "profiles"


def available_profiles(kind: str) -> list[str]:
    user = user_profiles_dir() / kind
    mine = [p.stem for p in user.glob("*.toml")] if user.is_dir() else []
    return sorted(set(mine) | set(profile_names(kind)))


def _load(kind: str, name: str) -> tuple[dict, str]:
    """(the profile's data, where it was read: the file's path)."""
    path = user_profiles_dir() / kind / f"{name}.toml"
    if not path.is_file():
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

    @classmethod
    def load(cls, name: str) -> HardwareProfile:
        """The profile `name` (a user profile before a shipped one), validated: a missing
        or bad field gets one sentence naming the file, the field and the problem.
        Efficiencies a profile does not state (none measured yet) default to 0.5."""
        d, where = _load("hardware", name)
        link = d.get("link", {})
        eff = d.get("efficiency", {})
        if not isinstance(link, dict) or not isinstance(eff, dict):
            raise ConfigError(f"Profile {where}: [link] and [efficiency] must be tables.")
        return cls(
            name=name,
            description=str(d.get("description", name)),
            memory_bytes=int(_number(d, "memory_bytes", where)),
            bandwidth_bytes_per_s=_number(d, "bandwidth_bytes_per_s", where),
            peak_flops=_number(d, "peak_flops", where),
            power_watts=_number(d, "power_watts", where, default=0.0, positive=False),
            link_bandwidth_bytes_per_s=_number(link, "bandwidth_bytes_per_s", where,
                                               default=0.0, positive=False, table="link"),
            mfu=_number(eff, "mfu", where, default=0.5, most=1.0, table="efficiency"),
            mbu=_number(eff, "mbu", where, default=0.5, most=1.0, table="efficiency"),
        )


@dataclass(frozen=True)
class StepFit:
    """`fixed + per_token × new tokens + per_pair × causal pairs` (seconds)."""

    fixed_s: float
    per_token_s: float
    per_pair_s: float

    def seconds(self, num_new_tokens: int, num_pairs: int) -> float:
        return self.fixed_s + self.per_token_s * num_new_tokens + self.per_pair_s * num_pairs


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

    def kv_bytes_per_token(self, kv_format: str | None = None) -> int:
        fmt = KV_FORMATS[kv_format or self.kv_dtype]
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, fmt)

    @property
    def matrix_params(self) -> float:
        return self.matrix_weight_bytes / self.bytes_per_weight

    @classmethod
    def load(cls, name: str) -> ModelProfile:
        d, where = _load("models", name)
        fits = {
            hw: StepFit(f["fixed_ms"] / 1e3, f["per_token_us"] / 1e6, f["per_pair_ns"] / 1e9)
            for hw, f in d.get("fit", {}).items()
        }
        return cls(
            name=name,
            architecture=d.get("architecture", name),
            num_layers=int(_need(d, "num_layers", where)),
            num_heads=int(_need(d, "num_heads", where)),
            num_kv_heads=int(_need(d, "num_kv_heads", where)),
            head_dim=int(_need(d, "head_dim", where)),
            kv_dtype=d.get("kv_dtype", "bf16"),
            weight_bytes=int(_need(d, "weight_bytes", where)),
            matrix_weight_bytes=int(_need(d, "matrix_weight_bytes", where)),
            context_length=int(_need(d, "context_length", where)),
            bytes_per_weight=float(d.get("bytes_per_weight", 2.0)),
            fits=fits,
        )
