"""What the planner compares and what it answers: a serving scheme (`Scheme`), the limits
it breaks (`Broken`), its figures and verdict (`SchemeResult`), and a whole plan (`Plan`).
The arithmetic that fills them is `planner.py`'s."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.planning.workloads import DraftSource

PLAN_KV_FORMATS = ("bf16", "q8_0", "q4_0")
"""The KV formats the planner compares (bf16 stands for any 2-byte float format)."""


@dataclass(frozen=True)
class Scheme:
    """One way to serve the workload."""

    shared: bool = False
    kv_format: str = "bf16"
    draft: DraftSource | None = None
    offload: bool = False

    @property
    def name(self) -> str:
        parts = (["shared prefix"] if self.shared else []) \
            + ([f"{self.kv_format} KV"] if self.kv_format != "bf16" else []) \
            + ([f"spec {self.draft.name}"] if self.draft is not None else []) \
            + (["weight offload"] if self.offload else [])
        return " + ".join(parts) or "baseline"


@dataclass(frozen=True)
class Broken:
    """A limit a scheme breaks and by how much (bytes or seconds)."""

    limit: str
    """`memory` or `deadline`."""
    over_by: float

    def describe(self, budget: float, deadline: float) -> str:
        if self.limit == "memory":
            size = f"{self.over_by / 2**30:.2f} GiB" if self.over_by >= 2**30 else \
                f"{self.over_by / 2**20:.1f} MiB"
            share = f" ({100 * self.over_by / budget:.1f}% of the budget)" if budget > 0 else ""
            return f"memory over by {size}{share}"
        if math.isinf(self.over_by):
            return "deadline: arrivals outpace service (the queue grows without bound)"
        share = f" ({100 * self.over_by / deadline:.0f}%)" if deadline > 0 else ""
        return f"deadline missed by {self.over_by:.2f} s{share}"


@dataclass
class SchemeResult:
    """What one scheme costs and whether it holds."""

    scheme: Scheme
    kv_bytes: int
    aux_bytes: int
    """Draft weights and peak buffers, offload prefetch buffers."""
    offloaded_bytes: int
    """Weights moved to the host, freeing that much device memory."""
    concurrency: int
    """Requests resident at once (the burst, or Little's law for Poisson arrivals)."""
    ttft_s: float
    completion_s: float
    decode_step_s: float
    """One decode step (a speculative round's verify + draft) at the plan's batch."""
    busy_s: float
    """Accelerator time the workload takes."""
    good: int
    budget_bytes: float
    deadline_s: float
    power_watts: float
    broken: list[Broken] = field(default_factory=list)
    unpriced: str = ""
    """A cost the timing could not include (a KV format's conversion, not measured on the
    card): the times are then lower bounds, and the scheme is not chosen over one fully
    priced."""
    steps: int = 0
    """Decode steps (or speculative rounds) after the first token."""

    @property
    def memory_bytes(self) -> int:
        """Device memory beyond the resident weights: KV + auxiliary − offloaded weights
        (offloading whole layers can free more than the rest needs: then 0)."""
        return max(self.kv_bytes + self.aux_bytes - self.offloaded_bytes, 0)

    @property
    def feasible(self) -> bool:
        return not self.broken

    @property
    def accelerator_s_per_good(self) -> float:
        return self.busy_s / self.good if self.good else math.inf

    @property
    def energy_j_per_good(self) -> float:
        """At the profile's power (its limit, or a live draw); NaN where the profile has no
        power figure (a CPU measured here)."""
        if not self.power_watts:
            return math.nan
        return self.accelerator_s_per_good * self.power_watts

    def verdict(self) -> str:
        if self.feasible and self.unpriced:
            slack = (self.deadline_s - self.completion_s) / max(self.steps, 1)
            return (f"feasible before {self.unpriced}: on time if it adds under "
                    f"{slack * 1e3:.2f} ms a step")
        if self.feasible:
            return "feasible"
        return "; ".join(b.describe(self.budget_bytes, self.deadline_s) for b in self.broken)

    def to_json(self) -> dict:
        def num(x: float) -> float | None:
            return None if math.isinf(x) or math.isnan(x) else x

        return {
            "scheme": self.scheme.name, "shared_prefix": self.scheme.shared,
            "kv_format": self.scheme.kv_format,
            "draft": self.scheme.draft.name if self.scheme.draft else None,
            "weight_offload": self.scheme.offload,
            "memory_bytes": self.memory_bytes, "kv_bytes": self.kv_bytes,
            "aux_bytes": self.aux_bytes, "offloaded_bytes": self.offloaded_bytes,
            "concurrency": self.concurrency, "ttft_s": num(self.ttft_s),
            "completion_s": num(self.completion_s), "decode_step_s": num(self.decode_step_s),
            "feasible": self.feasible, "unpriced": self.unpriced or None,
            "broken": [{"limit": b.limit, "over_by": num(b.over_by)} for b in self.broken],
            "broken_limit": ", ".join(b.limit for b in self.broken) or None,
            "accelerator_s_per_good": num(self.accelerator_s_per_good),
            "energy_j_per_good": num(self.energy_j_per_good),
        }


@dataclass
class Plan:
    """Every scheme's result, the chosen one and, when none is feasible, what would help."""

    results: list[SchemeResult]
    choice: SchemeResult | None
    suggestions: list[str]
    figures: dict


def parse_scheme(text: str, drafts: list[DraftSource]) -> Scheme:
    """A scheme from its parts joined by `+`: `baseline`, `shared`, a KV format (`q8_0`,
    `q4_0`, `bf16`), `offload`, or a draft source's name among `drafts`; one sentence
    naming the part and what is allowed otherwise."""
    by_name = {d.name: d for d in drafts}
    scheme = Scheme()
    for part in (p.strip() for p in text.split("+")):
        if part == "shared":
            scheme = Scheme(True, scheme.kv_format, scheme.draft, scheme.offload)
        elif part in PLAN_KV_FORMATS:
            scheme = Scheme(scheme.shared, part, scheme.draft, scheme.offload)
        elif part == "offload":
            scheme = Scheme(scheme.shared, scheme.kv_format, scheme.draft, True)
        elif part in by_name:
            scheme = Scheme(scheme.shared, scheme.kv_format, by_name[part], scheme.offload)
        elif part != "baseline":
            allowed = ", ".join(["baseline", "shared", *PLAN_KV_FORMATS, "offload",
                                 *by_name])
            raise ConfigError(f"Unknown scheme part {part!r} in {text!r}; parts are "
                              f"{allowed}, joined by '+'.")
    return scheme
