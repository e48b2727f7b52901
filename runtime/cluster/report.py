"""The fleet's figures: the run as one (the same summary one engine's run gets), each
replica's share, and what only a fleet has — load imbalance, KV moved between instances,
decode capacity left idle, cards used."""

from __future__ import annotations

from collections.abc import Sequence

from kvdeck.runtime.cluster.replicas import Cluster, Replica
from kvdeck.runtime.runs.stages import stage_figures
from kvdeck.runtime.runs.trace import Arrival
from kvdeck.runtime.stats.figures import RunFigures, summarize
from kvdeck.runtime.stats.metrics import SLO, RequestMetrics


def replica_row(r: Replica, span: float) -> dict:
    """One replica's figures over the fleet's span."""
    f, tree = r.engine.figures, r.engine.kv.tree
    finished = [m for m in r.metrics if m.status in ("finished_stopped", "finished_length")]
    ttfts = sorted(m.ttft for m in r.metrics if m.ttft is not None)
    return {
        "name": r.name,
        "role": r.role,
        "requests": len(r.metrics) if r.role != "prefill" else f.num_finished_seen,
        "output_tokens_per_s": sum(m.output_tokens for m in finished) / span,
        "prefix_hit_rate": tree.hit_rate,
        "busy_share": f.busy_seconds / span,
        "prefill_tokens": f.prompt_tokens,
        "decode_tokens": f.decode_tokens,
        "ttft_p50_s": ttfts[len(ttfts) // 2] if ttfts else None,
        "kv_sent_bytes": r.kv_sent_bytes,
        "kv_received_bytes": r.kv_received_bytes,
        "transfer_s_mean": r.transfer_s / len(r.metrics) if r.role == "decode" and r.metrics
        else None,
    }


def fleet_summary(cluster: Cluster, arrivals: Sequence[Arrival], slo: SLO,
                  cards_per_replica: int) -> dict:
    """`{"summary": ..., "replicas": [...], "requests": [...]}` of a finished fleet run."""
    metrics: list[RequestMetrics] = [m for r in cluster.replicas for m in r.metrics]
    order = {(a.request_id or f"r{j}"): j for j, a in enumerate(arrivals)}
    metrics.sort(key=lambda m: order.get(m.request_id, len(order)))
    total = RunFigures.combined([r.engine.figures for r in cluster.replicas])
    if cluster.disaggregated:
        # A decode replica counts its requests resident from their arrival (their prefill
        # and transfer included); the prefill replicas' share would count it twice.
        total.resident_seconds = sum(r.engine.figures.resident_seconds
                                     for r in cluster.replicas if r.role != "prefill")
    summary = summarize(metrics, total, slo)
    span = max(summary["makespan_s"], 1e-12)
    rows = [replica_row(r, span) for r in cluster.replicas]
    serving = [row for row in rows if row["role"] != "prefill"]
    loads = [row["output_tokens_per_s"] for row in serving]
    mean = sum(loads) / len(loads) if loads else 0.0
    decode_rows = [row for row in rows if row["role"] == "decode"]
    first = cluster.replicas[0].engine.executor.info
    summary.update({
        "model": first.model_name,
        "router": cluster.router.describe(),
        "num_replicas": len(cluster.replicas),
        "prefill_replicas": sum(1 for r in cluster.replicas if r.role == "prefill"),
        "decode_replicas": len(decode_rows),
        "cards": len(cluster.replicas) * cards_per_replica,
        "load_imbalance": max(loads) / mean if mean else None,
        "kv_moved_bytes": sum(r.kv_sent_bytes for r in cluster.replicas),
        "transfer_s_mean": (sum(r.transfer_s for r in cluster.replicas)
                            / max(sum(len(r.metrics) for r in cluster.replicas
                                      if r.role == "decode"), 1)) if decode_rows else None,
        "decode_idle_share": _idle(decode_rows),
        "prefill_idle_share": _idle([row for row in rows if row["role"] == "prefill"]),
        "prefix_hit_rate": _hit_rate(cluster),
    })
    requests = [m.to_dict() for m in metrics]
    return {"summary": summary, "replicas": rows, "stages": stage_figures(requests),
            "requests": requests}


def _idle(rows: list[dict]) -> float | None:
    """The share of the span these replicas' cards did nothing (None: no such replica)."""
    return 1.0 - sum(row["busy_share"] for row in rows) / len(rows) if rows else None


def _hit_rate(cluster: Cluster) -> float:
    hit = sum(r.engine.kv.tree.num_hit_tokens for r in cluster.replicas if r.role != "decode")
    asked = sum(r.engine.kv.tree.num_query_tokens for r in cluster.replicas
                if r.role != "decode")
    return hit / asked if asked else 0.0
