"""Run an arrival trace through a simulated fleet, from settings: `run_fleet` (what
`kvdeck run-trace --replicas/--router` and `--prefill-replicas/--decode-replicas` call)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvdeck.runtime.cluster.replicas import Cluster, ClusterConfig, Replica
from kvdeck.runtime.cluster.report import fleet_summary
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.runs.trace import Arrival
from kvdeck.runtime.session import Session, build_session
from kvdeck.runtime.settings import Settings
from kvdeck.runtime.stats.metrics import SLO


def run_fleet(settings: Settings, roles: Sequence[str], config: ClusterConfig,
              arrivals: Sequence[Arrival], *, slo: SLO = SLO(), hash_block_tokens: int = 512,
              on_step: Callable[[Replica], None] | None = None) -> dict:
    """One sim engine per role (`replicas.replica_roles`), all of `settings`, run together
    on one clock; returns `fleet_summary`'s figures."""
    if settings.session.executor != "sim":
        raise ConfigError("A fleet runs on the sim executor (--executor sim): replicas share "
                          "one virtual clock, which measured executors do not have.")
    sessions: list[Session] = []
    try:
        for _ in roles:
            sessions.append(build_session(settings, with_tokenizer=False))
        cluster = Cluster([s.engine for s in sessions], roles, config,
                          vocab_size=sessions[0].vocab_size,
                          hash_block_tokens=hash_block_tokens, on_step=on_step)
        cluster.run(arrivals)
        layout = sessions[0].executor.layout
        return fleet_summary(cluster, arrivals, slo, layout.cards)
    finally:
        for s in sessions:
            s.close()
