"""The executor contract stays narrow (issue "A house one can live in"): a core protocol of
at most ten members, capabilities as protocols of their own that callers test for, and no
code that branches on an executor's name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kvdeck.runtime.core.config import EngineConfig
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.base import (
    Drafting,
    Executor,
    HostTier,
    KVConversion,
    Modelled,
    Offload,
    StepCost,
    WeightFormats,
    WindowGroups,
    capability,
    resolve_weight_formats,
)
from kvdeck.runtime.executors.sim import SimExecutor

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "runtime/executors/base.py"


def protocol_members(path: Path, name: str) -> list[str]:
    """The members a Protocol class in `path` declares (methods and annotated fields)."""
    cls = next(n for n in ast.parse(path.read_text()).body
               if isinstance(n, ast.ClassDef) and n.name == name)
    return [n.name if isinstance(n, ast.FunctionDef) else n.target.id for n in cls.body
            if isinstance(n, ast.FunctionDef | ast.AnnAssign)]


def test_the_core_protocol_has_at_most_ten_members() -> None:
    members = protocol_members(BASE, "Executor")
    assert "info" in members and "execute" in members
    assert len(members) <= 10, members


def test_nothing_branches_on_an_executors_name() -> None:
    name_test = re.compile(r"\b(executor|ex|info)\.(info\.)?name\s*(==|!=|in\b)")
    found = [f"{p.relative_to(ROOT)}:{i}" for folder in ("runtime", "console", "benchmarks",
                                                          "tests")
             for p in sorted((ROOT / folder).rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if name_test.search(line)]
    assert found == []


def test_the_sim_has_every_capability_but_window_groups() -> None:
    sim = SimExecutor()
    assert isinstance(sim, Executor)
    for kind in (KVConversion, HostTier, WeightFormats, Offload, Drafting, StepCost, Modelled):
        assert isinstance(sim, kind), kind
    assert not isinstance(sim, WindowGroups)


def test_a_missing_capability_is_refused_in_one_sentence() -> None:
    with pytest.raises(ConfigError, match=r"^free_window_kv needs an executor that lays out KV "
                                          r"pages of its own \(the torch executor\); the sim "
                                          r"executor does not\.$"):
        Engine(EngineConfig(free_window_kv=True), SimExecutor())
    bare = type("Bare", (), {"info": SimExecutor().info})()
    with pytest.raises(ConfigError, match="^offload_layers needs an executor that offloads"):
        capability(bare, Offload, "offload_layers")


def test_weights_of_an_executor_that_does_not_repack_take_dense_only() -> None:
    bare = type("Bare", (), {"info": SimExecutor().info})()
    assert resolve_weight_formats(bare, "measured") == \
        {"attn": "dense", "ffn": "dense", "head": "dense"}
    with pytest.raises(ConfigError, match="^weight_format 'int8': the sim executor runs the "
                                          "model file's own weights"):
        resolve_weight_formats(bare, "int8")


def test_the_engine_sizes_and_runs_without_optional_capabilities() -> None:
    """An executor with the core protocol only: the engine runs it; what needs a
    capability it lacks is refused when asked for."""

    core = set(protocol_members(BASE, "Executor"))

    class CoreOnly:
        def __init__(self) -> None:
            self.sim = SimExecutor()
            self.info = self.sim.info

        def __getattr__(self, name: str):
            if name in core:
                return getattr(self.sim, name)
            raise AttributeError(name)

    ex = CoreOnly()
    for kind in (KVConversion, HostTier, WeightFormats, Offload, Drafting, WindowGroups):
        assert not isinstance(ex, kind), kind
    e = Engine(EngineConfig(num_blocks=64, block_size=16), ex)
    e.add_request(list(range(1, 40)), request_id="a")
    while e.has_work:
        e.step()
        e.check_integrity()
    assert len(e.completed) == 1
    with pytest.raises(ConfigError, match="^changing kv_format live needs an executor that "
                                          "re-encodes"):
        e.set_knobs(kv_format="q8_0")
    with pytest.raises(ConfigError, match="^offload_layers needs an executor that offloads"):
        e.set_knobs(offload_layers=2)
    e.close()
