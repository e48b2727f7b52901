"""Workload and draft-source profiles: the request classes the planner sizes a
configuration for, and the speculative-decoding sources it can price.

Both are TOML under `profiles/workloads/` and `profiles/drafts/` (a user's
`$KVDECK_CACHE/profiles/<kind>/` first), validated on load like hardware profiles: a bad
field gets one sentence naming the file, the field and the problem.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.planning.profiles import ModelProfile, _load, _number, available_profiles

ARRIVALS = ("burst", "poisson")
DRAFTING = ("parallel", "sequential")


def _whole(d: dict, key: str, where: str, **kw) -> int:
    value = _number(d, key, where, **kw)
    if value != int(value):
        raise ConfigError(f"Profile {where}: {key} must be a whole number, got {value}.")
    return int(value)


def _flag(d: dict, key: str, where: str) -> bool:
    value = d.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"Profile {where}: {key} must be true or false, got {value!r}.")
    return value


def _choice(d: dict, key: str, where: str, allowed: tuple[str, ...]) -> str:
    value = d.get(key, allowed[0])
    if value not in allowed:
        raise ConfigError(f"Profile {where}: {key} must be one of {', '.join(allowed)}, "
                          f"got {value!r}.")
    return str(value)


@dataclass(frozen=True)
class Workload:
    """One request class and how it arrives: `burst` (all `num_requests` at once) or
    `poisson` (`rate_per_s` on average)."""

    name: str
    description: str
    prompt_tokens: int
    output_tokens: int
    shared_prefix_tokens: int
    """Leading prompt tokens identical across requests (system prompt, tool definitions)."""
    deadline_s: float
    """Completion deadline from arrival."""
    arrival: str
    num_requests: int
    rate_per_s: float = 0.0
    source: str = ""
    prefix_cached: bool = False
    """The shared prefix is in the prefix cache before the requests come (a warm server):
    a scheme that shares it computes only each prompt past it."""

    @property
    def final_tokens(self) -> int:
        """KV positions a request holds after its whole output: `prompt + output − 1` (the
        last token is never written)."""
        return self.prompt_tokens + self.output_tokens - 1

    @classmethod
    def load(cls, name: str) -> Workload:
        d, where = _load("workloads", name)
        prompt = _whole(d, "prompt_tokens", where)
        shared = _whole(d, "shared_prefix_tokens", where, default=0, positive=False)
        if shared > prompt:
            raise ConfigError(f"Profile {where}: shared_prefix_tokens must be at most "
                              f"prompt_tokens ({prompt}), got {shared}.")
        arrival = _choice(d, "arrival", where, ARRIVALS)
        return cls(name=str(d.get("name", name)), description=str(d.get("description", name)),
                   prompt_tokens=prompt, output_tokens=_whole(d, "output_tokens", where),
                   shared_prefix_tokens=shared, deadline_s=_number(d, "deadline_s", where),
                   arrival=arrival, num_requests=_whole(d, "num_requests", where, default=1,
                                                      most=100_000),
                   rate_per_s=_number(d, "rate_per_s", where) if arrival == "poisson" else 0.0,
                   source=where, prefix_cached=_flag(d, "prefix_cached", where))


def expected_outputs(acceptance: tuple[float, ...]) -> float:
    """`1 + Σ_{j≤m} Π_{i≤j} a_i`: tokens one speculative round emits on average with
    conditional acceptance `a_i` per position (docs/architecture.md, "Speculative
    decoding")."""
    total, keep = 1.0, 1.0
    for a in acceptance:
        keep *= a
        total += keep
    return total


def constant_acceptance(target: float, m: int) -> float:
    """The constant conditional acceptance `a` with `1 + a + … + a^m = target` (by
    bisection): a measured mean tokens per round as a per-position rate."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_outputs((mid,) * m) < target:
            lo = mid
        else:
            hi = mid
    return hi


@dataclass(frozen=True)
class DraftSource:
    """A speculative-decoding draft source as the planner prices it."""

    name: str
    description: str
    target: str
    """The model profile it drafts for, or `*` for any (n-gram lookup)."""
    drafting: str
    """`parallel`: one draft pass proposes all `draft_length` tokens; `sequential`: one pass
    per token."""
    draft_length: int
    weight_bytes: int
    extra_memory_bytes: int
    """Device memory it adds at peak, its weights included."""
    ttft_overhead: float
    """Fraction added to time to first token (the draft's own prefill)."""
    draft_cost: float
    """One draft pass, as a fraction of a plain decode step at the same batch."""
    acceptance: tuple[float, ...]
    """Conditional acceptance per draft position: the chance position i is kept given
    position i − 1 was (empty when only `tokens_per_round` was measured)."""
    source: str = ""
    tokens_per_round: float = 0.0
    """Measured mean tokens a round emits at `draft_length` (0: derive them from
    `acceptance`). A measurement wins over a per-position model of it."""

    def expected_outputs(self, length: int | None = None) -> float:
        """Expected tokens one round emits with `length` drafts (default: all): the
        measured mean at the full length, else `1 + Σ Π a_i` over the acceptance."""
        if self.tokens_per_round and (length is None or length >= self.draft_length):
            return self.tokens_per_round
        if not self.acceptance:
            raise ConfigError(f"Draft source {self.name} gives tokens per round only at "
                              f"{self.draft_length} drafts, not at {length}.")
        return expected_outputs(self.acceptance[:self.draft_length if length is None
                                                else length])

    def passes(self) -> int:
        """Draft passes per round."""
        return 1 if self.drafting == "parallel" else self.draft_length

    def fits(self, model: ModelProfile) -> bool:
        return self.target in ("*", model.name)

    @classmethod
    def load(cls, name: str) -> DraftSource:
        d, where = _load("drafts", name)
        length = _whole(d, "draft_length", where)
        per_round = _number(d, "tokens_per_round", where, default=0.0, positive=False,
                            most=length + 1.0)
        if per_round and per_round < 1:
            raise ConfigError(f"Profile {where}: tokens_per_round must be from 1 to "
                              f"draft_length + 1 ({length + 1}), got {per_round:g}.")
        acceptance = d.get("acceptance", [] if per_round else None)
        if not isinstance(acceptance, list) or (acceptance or not per_round) and (
                len(acceptance) < length or not all(
                    isinstance(a, (int, float)) and not isinstance(a, bool) and 0 <= a <= 1
                    for a in acceptance)):
            raise ConfigError(f"Profile {where}: acceptance must be a list of at least "
                              f"draft_length ({length}) chances from 0 to 1 (or give a "
                              f"measured tokens_per_round), got {acceptance!r}.")
        return cls(name=name, description=str(d.get("description", name)),
                   target=str(d.get("target", "*")),
                   drafting=_choice(d, "drafting", where, DRAFTING), draft_length=length,
                   weight_bytes=_whole(d, "weight_bytes", where, default=0, positive=False),
                   extra_memory_bytes=_whole(d, "extra_memory_bytes", where, default=0,
                                             positive=False),
                   ttft_overhead=_number(d, "ttft_overhead", where, default=0.0,
                                         positive=False),
                   draft_cost=_number(d, "draft_cost", where, default=0.0, positive=False),
                   acceptance=tuple(float(a) for a in acceptance[:length]), source=where,
                   tokens_per_round=per_round)


def draft_sources(model: ModelProfile) -> list[DraftSource]:
    """Every draft-source profile that fits `model`."""
    return [s for s in map(DraftSource.load, available_profiles("drafts")) if s.fits(model)]
