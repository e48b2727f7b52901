"""Generated workloads in stages, as inference-perf (the load generator llm-d benchmarks
with) writes them: a TOML file naming a data shape and constant-rate load stages.

    [shared_prefix]            # inference-perf's shared_prefix data
    num_groups = 83            # groups, each with its own system prompt
    num_prompts_per_group = 3  # questions per group
    system_prompt_len = 8000
    question_len = 1000
    output_len = 1000
    seed = 0

    [[stages]]                 # constant rate: requests evenly spaced at 1/rate
    rate = 3.0
    duration = 50              # seconds

Each request takes a (group, question) drawn uniformly (seeded), so a question recurs with
its system prompt and both stay cacheable. Prompts are synthesized from hash ids as a
Mooncake trace's are, in blocks of the lengths' greatest common divisor: a group's system
prompt is the same tokens in every request of the group, a question the same tokens each
time it recurs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path

from kvdeck.runtime.core.config import tomllib
from kvdeck.runtime.errors import TraceError
from kvdeck.runtime.runs.arrival import Arrival
from kvdeck.runtime.stats.metrics import Distribution

SHAPE_KEYS = ("num_groups", "num_prompts_per_group", "system_prompt_len", "question_len",
              "output_len")


def _positive(table: dict, key: str, where: str, kind: type = int) -> float:
    v = table.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and
                                                                 not isinstance(v, int)) \
            or not v > 0:
        raise TraceError(f"{where} needs {key} as a {'whole ' if kind is int else ''}number "
                         f"above 0, got {v!r}.")
    return v


def read_stages(path: Path) -> Iterator[Arrival]:
    """The arrivals of a staged workload file (module docstring)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise TraceError(f"{path} is not valid TOML ({e}).") from None
    shape = data.get("shared_prefix")
    if not isinstance(shape, dict):
        raise TraceError(f"{path} needs a [shared_prefix] table with "
                         f"{', '.join(SHAPE_KEYS)}.")
    where = f"{path} [shared_prefix]"
    groups, per_group, system, question, output = (
        int(_positive(shape, k, where)) for k in SHAPE_KEYS)
    stages = data.get("stages")
    if not isinstance(stages, list) or not stages:
        raise TraceError(f"{path} needs at least one [[stages]] table with rate and duration.")
    rng = random.Random(shape.get("seed", 0))
    block = math.gcd(system, question)
    per_system, per_question = system // block, question // block
    t = 0.0
    for k, stage in enumerate(stages):
        where = f"{path} stage {k + 1}"
        if not isinstance(stage, dict):
            raise TraceError(f"{where} must be a table with rate and duration.")
        rate = _positive(stage, "rate", where, float)
        duration = _positive(stage, "duration", where, float)
        for j in range(int(rate * duration)):
            g, q = rng.randrange(groups), rng.randrange(per_group)
            ids = tuple(g * per_system + i for i in range(per_system)) + tuple(
                (1 << 32) + (g * per_group + q) * per_question + i for i in range(per_question))
            yield Arrival(t + j / rate, system + question, output, hash_ids=ids,
                          hash_block_tokens=block, request_id=f"s{k + 1}-{j}")
        t += duration


def stage_of(request_id: str) -> int | None:
    """The stage (from 1) a staged workload's request belongs to, from its id `s<k>-<j>`."""
    head, dash, _ = request_id.partition("-")
    return int(head[1:]) if dash and head[:1] == "s" and head[1:].isdigit() else None


def stage_figures(requests: list[dict]) -> list[dict]:
    """Per stage of a staged run's requests (`RequestMetrics` dicts): output tokens per
    second from its first arrival to its last finish (inference-perf's per-stage
    throughput), and TTFT percentiles. Empty when the requests are not a staged run's."""
    by_stage: dict[int, list[dict]] = {}
    for r in requests:
        k = stage_of(r["request_id"])
        if k is None:
            return []
        by_stage.setdefault(k, []).append(r)
    out = []
    for k in sorted(by_stage):
        rs = by_stage[k]
        done = [r for r in rs if r["finish"] is not None]
        start = min(r["arrival"] for r in rs)
        end = max((r["finish"] for r in done), default=start)
        ttft = Distribution.of(r["ttft"] for r in rs if r["ttft"] is not None)
        out.append({"stage": k, "requests": len(rs),
                    "output_tokens_per_s": sum(r["output_tokens"] for r in done)
                    / max(end - start, 1e-12),
                    "ttft_p50_s": ttft.p50, "ttft_p90_s": ttft.p90})
    return out
