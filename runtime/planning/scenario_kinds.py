"""How each kind of scenario (`scenarios.Scenario.kind`) computes kvdeck's figures.

Each function takes a scenario's setup and returns kvdeck's figures by name, computed
through the real planner, step model, KV arithmetic and sim executor; the chapter's figures
never reach these functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvdeck.runtime.planning.profiles import HardwareProfile, ModelProfile

GIB, MIB = 2**30, 2**20


def _plan(setup: dict) -> dict[str, float | str]:
    """The planner on the setup's profiles and budget, over its lettered schemes: each
    scheme's memory (GiB), TTFT and completion (s) and steps after the first token, and the
    letter of the chosen one (`none` when nothing is feasible)."""
    from kvdeck.runtime.planning.scenario_run import planner_of

    planner, letters = planner_of(setup)
    workload = planner.workload
    plan = planner.plan(only=list(letters.values()))
    out: dict[str, float | str] = {}
    for letter, r in zip(letters, plan.results, strict=True):
        out[f"{letter}.memory_gib"] = r.memory_bytes / GIB
        out[f"{letter}.ttft_s"] = r.ttft_s
        out[f"{letter}.completion_s"] = r.completion_s
        out[f"{letter}.steps"] = r.steps
        out[f"{letter}.feasible"] = "yes" if r.feasible else "no"
        out[f"{letter}.acc_s_per_good"] = r.accelerator_s_per_good
        out[f"{letter}.joules_per_good"] = r.energy_j_per_good
        # The chapter's per-request accounting: prefill and decode rates, and the
        # accelerator time one request takes at them (its prompt past the cache, its output).
        prefill = planner.prefill_tokens(r.concurrency, r.scheme)
        r_p, r_d = prefill / r.ttft_s, r.concurrency / r.decode_step_s
        out[f"{letter}.r_p"], out[f"{letter}.r_d"] = r_p, r_d
        out[f"{letter}.gpu_s_per_request"] = prefill / r.concurrency / r_p \
            + (workload.output_tokens - 1) / r_d
    out["choice"] = "none" if plan.choice is None else \
        next(letter for letter, r in zip(letters, plan.results, strict=True)
             if r is plan.choice)
    return out


def _retention(setup: dict) -> dict[str, float]:
    """Keeping a prefix on the host tier: its KV (MiB), the time to recompute it (a batch-1
    prefill by the step model, ms), the copy over each link (ms) and the hit probability
    above which keeping it saves time on each."""
    from kvdeck.runtime.core.step_data import causal_pairs
    from kvdeck.runtime.kv.prefix_node import break_even_hit_rate
    from kvdeck.runtime.planning.planner import Planner
    from kvdeck.runtime.planning.workloads import Workload

    hw = HardwareProfile.load(setup.get("hardware", "rtx-pro-6000"))
    model = ModelProfile.load(setup.get("model", "qwen3-8b"))
    tokens = int(setup["prefix_tokens"])
    planner = Planner(hw, model, Workload.load("long-burst"), GIB)
    nbytes = tokens * model.kv_bytes_per_token()
    recompute = planner.step_seconds(tokens, causal_pairs(tokens, 0), tokens)
    out = {"kv_mib": nbytes / MIB, "recompute_ms": recompute * 1e3}
    for link, bandwidth in setup["links"].items():
        copy = nbytes / float(bandwidth)
        out[f"{link}.copy_ms"] = copy * 1e3
        out[f"{link}.break_even_pct"] = 100 * break_even_hit_rate(recompute, copy, copy)
        out[f"{link}.value_ms_at_50pct"] = (0.5 * (recompute - copy) - copy) * 1e3  # V_h
    return out


def _offload(setup: dict) -> dict[str, float]:
    """Offloading FFN layers with the sim executor's own accounting: one layer's FFN
    (MiB), what moving `layers` of them frees, and the net gain with one and two prefetch
    buffers."""
    from kvdeck.runtime.executors.sim import SimConfig, SimExecutor

    ex = SimExecutor(SimConfig(model_profile=setup.get("model", "qwen3-8b"),
                               hardware=setup.get("hardware", "rtx-pro-6000")))
    layers = int(setup["layers"])
    out = {"ffn_layer_mib": ex.ffn_layer_bytes / MIB,
           "freed_mib": layers * ex.ffn_layer_bytes / MIB}
    for buffers in (1, 2):
        ex.set_offload(layers, buffers)
        out[f"net_mib.{buffers}_buffer"] = ex.offload_gain_bytes / MIB
    return out


def _capacity(setup: dict) -> dict[str, float]:
    """The planner's KV arithmetic for the setup's workload: per-token KV, one request's
    blocks and bytes at full length, requests the budget holds with and without sharing,
    and the batch at which KV reads overtake weight reads, per format."""
    from kvdeck.runtime.planning.planner import PLAN_KV_FORMATS, Planner
    from kvdeck.runtime.planning.workloads import Workload

    hw = HardwareProfile.load(setup.get("hardware", "rtx-pro-6000"))
    model = ModelProfile.load(setup.get("model", "qwen3-8b"))
    workload = Workload.load(setup.get("workload", "long-burst"))
    planner = Planner(hw, model, workload, float(setup["kv_budget_gib"]) * GIB)
    out: dict[str, float] = {"blocks_after_prefill": planner.blocks(workload.prompt_tokens),
                             "blocks_after_output": planner.blocks(planner.final_tokens)}
    values = 2 * model.num_layers * model.num_kv_heads * model.head_dim  # per token
    prompt_bf16 = planner.seq_bytes(workload.prompt_tokens, "bf16")
    for fmt in PLAN_KV_FORMATS:
        one = planner.seq_bytes(planner.final_tokens, fmt)
        prompt = planner.seq_bytes(workload.prompt_tokens, fmt)
        out[f"{fmt}.prompt_mib"] = prompt / MIB
        out[f"{fmt}.saved_mib"] = (prompt_bf16 - prompt) / MIB
        out[f"{fmt}.bits_per_value"] = 8 * planner.kv_bytes_per_token(fmt) / values
        out[f"{fmt}.kv_bytes_per_token"] = planner.kv_bytes_per_token(fmt)
        out[f"{fmt}.request_mib"] = one / MIB
        out[f"{fmt}.burst_gib"] = planner.kv_for(workload.num_requests, fmt, False) / GIB
        out[f"{fmt}.burst_shared_gib"] = planner.kv_for(workload.num_requests, fmt, True) / GIB
        out[f"{fmt}.capacity"] = planner.capacity(fmt, False)
        out[f"{fmt}.capacity_shared"] = planner.capacity(fmt, True)
        for context in setup.get("crossover_contexts", []):
            out[f"{fmt}.crossover_at_{context}"] = planner.crossover_batch(int(context), fmt)
    return out


def _decode_mbu(setup: dict) -> dict[str, float]:
    """The sim engine on the reference card: one decode step per batch with every row at
    the setup's context; its step time (ms) and the MBU its own bytes read and time give."""
    from kvdeck.runtime.core.config import EngineConfig, Knobs
    from kvdeck.runtime.core.engine import Engine
    from kvdeck.runtime.core.request import SamplingParams
    from kvdeck.runtime.executors.sim import SimConfig, SimExecutor

    context = int(setup["context"])
    out = {}
    for batch in setup["batches"]:
        engine = Engine(EngineConfig(kv_memory_bytes=40 * GIB, knobs=Knobs(
            max_num_batched_tokens=8192, chunk_size=8192, max_num_seqs=max(batch, 1),
            enable_prefix_caching=False)),
            SimExecutor(SimConfig(hardware=setup.get("hardware", "rtx-pro-6000"))))
        for i in range(batch):
            engine.add_request([3 + (i * 7 + j) % 30_000 for j in range(context - 1)],
                               SamplingParams(max_tokens=64, ignore_eos=True))
        engine.step()
        while any(not r.is_decoding for r in engine.scheduler.running) or \
                engine.scheduler.waiting:
            engine.step()
        record = engine.step()
        engine.check_integrity()
        bandwidth = engine.executor.hardware.bandwidth_bytes_per_s
        out[f"b{batch}.step_ms"] = record.dt * 1e3
        out[f"b{batch}.read_gb"] = record.bytes_read / 1e9
        out[f"b{batch}.mbu_pct"] = 100 * record.bytes_read / record.dt / bandwidth
    return out


def _batching(setup: dict) -> dict[str, float]:
    """The sim engine on the setup's arrivals under each scheduling mode's knobs: the time
    the last request finishes and the longest gap between two outputs of a request (ms)."""
    from kvdeck.runtime.core.config import EngineConfig, Knobs
    from kvdeck.runtime.core.engine import Engine
    from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
    from kvdeck.runtime.runs.runner import run_arrivals
    from kvdeck.runtime.runs.trace import Arrival

    arrivals = [Arrival(ms / 1e3, prompt, output) for ms, prompt, output in setup["requests"]]
    out = {}
    for mode, knobs in setup["modes"].items():
        engine = Engine(EngineConfig(kv_memory_bytes=8 * GIB, knobs=Knobs(**knobs)),
                        SimExecutor(SimConfig(timing=setup.get("timing", "auto"))))
        requests = run_arrivals(engine, arrivals, vocab_size=32_000)["requests"]
        engine.check_integrity()
        out[f"{mode}.total_ms"] = 1e3 * max(r["finish"] for r in requests)
        out[f"{mode}.max_gap_ms"] = 1e3 * max(x for r in requests for x in r["itls"])
    return out


def _speculation(setup: dict) -> dict[str, float]:
    """Speculative rounds at batch 1: tokens a round emits for each draft's conditional
    acceptance (`1 + Σ Π a_i`), the round (verifying `m + 1` positions at the setup's
    context by the step model, plus the draft's own time) and the time per output token."""
    from kvdeck.runtime.core.step_data import causal_pairs
    from kvdeck.runtime.planning.planner import Planner
    from kvdeck.runtime.planning.workloads import Workload, expected_outputs

    planner = Planner(HardwareProfile.load(setup.get("hardware", "rtx-pro-6000")),
                      ModelProfile.load(setup.get("model", "qwen3-8b")),
                      Workload.load("long-burst"), GIB)
    m, ctx = int(setup["draft_length"]), int(setup["context"])
    verify = planner.step_seconds(m + 1, causal_pairs(m + 1, ctx), ctx + m + 1,
                                  num_sampled=m + 1)
    round_ms = 1e3 * verify + float(setup.get("draft_ms", 0.0))
    out = {"round_ms": round_ms}
    for name, a in setup["acceptance"].items():
        tokens = expected_outputs((float(a),) * m)
        out[f"{name}.tokens_per_round"] = tokens
        out[f"{name}.ms_per_token"] = round_ms / tokens
    return out


def _format_time(setup: dict) -> dict[str, float]:
    """What reading one context in another KV format saves per step: the bytes (MiB), the
    time by the roofline's bandwidth quotient (`ΔD/(β·MBU)`) and along the measured curve,
    and the net saving after each conversion cost given (ms)."""
    from kvdeck.runtime.planning.planner import Planner
    from kvdeck.runtime.planning.workloads import Workload

    planner = Planner(HardwareProfile.load(setup.get("hardware", "rtx-pro-6000")),
                      ModelProfile.load(setup.get("model", "qwen3-8b")),
                      Workload.load("long-burst"), GIB)
    ctx, fmt = int(setup["context"]), setup["format"]
    out = {"saved_mib": ctx * (planner.kv_bytes_per_token("bf16")
                               - planner.kv_bytes_per_token(fmt)) / MIB}
    for timing in ("roofline", "measured"):
        out[f"saved_ms.{timing}"] = 1e3 * (planner.decode_step(1, ctx, "bf16", timing)
                                           - planner.decode_step(1, ctx, fmt, timing))
    for convert_ms in setup.get("convert_ms", []):
        out[f"net_ms.roofline.{convert_ms}"] = out["saved_ms.roofline"] - float(convert_ms)
    return out


def _paging(setup: dict) -> dict[str, float]:
    """The KV manager holding requests of the setup's lengths, each allowed `max_tokens`
    in all: tokens of KV allocated with the whole range reserved, paged (blocks as
    needed), and paged with the requests that share a prefix sharing its full blocks."""
    from kvdeck.runtime.core.request import Request, SamplingParams
    from kvdeck.runtime.kv.manager import BlockManager

    p, most = int(setup["block_size"]), int(setup["max_tokens"])
    shared = int(setup.get("shared_prefix", 0))

    def held(lengths: dict, reserve: bool, share: tuple) -> int:
        kv = BlockManager(256, p, enable_caching=bool(share))
        for name, n in lengths.items():
            prompt = list(range(1, shared + 1)) if name in share else []
            prompt += [1000 * (ord(name[0]) + 1) + i for i in range(n - len(prompt))]
            req = Request(name, prompt, SamplingParams(max_tokens=most - n + 1))
            kv.admit(req, n - kv.peek_prefix(req), reserve)  # past a cached prefix
            req.num_computed_tokens = n
            kv.cache_computed(req)
        kv.check_integrity()
        return (kv.pool.num_used + (kv.num_reserved if reserve else 0)) * p

    lengths = dict(setup["lengths"])
    stored = sum(lengths.values())
    full, paged = held(lengths, True, ()), held(lengths, False, ())
    return {"stored_tokens": stored, "reserved_tokens": full, "paged_tokens": paged,
            "unused_reserved": full - stored, "unused_paged": paged - stored,
            "paged_shared_tokens": held(lengths, False, tuple(setup.get("sharing", ())))}


def _amdahl(setup: dict) -> dict[str, float]:
    """A task's time and speed-up when its decode phase is sped up (`amdahl.py`), for
    each split of the task the setup gives."""
    from kvdeck.runtime.planning.amdahl import task_seconds, task_speedup

    out = {}
    speedup = float(setup["speedup"])
    for name, phases in setup["tasks"].items():
        total = sum(phases.values())
        out[f"{name}.task_s"] = task_seconds(phases, {"decode": speedup})
        out[f"{name}.speedup"] = task_speedup(phases["decode"] / total, speedup)
    return out


def _fits_memory(setup: dict) -> dict[str, float]:
    """Weight files on a card: the memory left after a reserve (GiB), what each file leaves
    (negative: over by), the model's KV per context length, and requests of the first
    context each file still holds."""
    hw = HardwareProfile.load(setup["hardware"])
    model = ModelProfile.load(setup["model"])
    available = hw.memory_bytes - float(setup["reserve_gib"]) * GIB
    out = {"available_gib": available / GIB}
    contexts = [int(c) for c in setup["contexts"]]
    for c in contexts:
        out[f"kv_gib.{c}"] = c * model.kv_bytes_per_token() / GIB
    for name, size_gib in setup["files_gib"].items():
        left = available - float(size_gib) * GIB
        out[f"{name}.left_gib"] = left / GIB
        one = contexts[0] * model.kv_bytes_per_token()
        out[f"{name}.requests"] = max(int(left // one), 0)
        out[f"{name}.spare_gib"] = (left - out[f"{name}.requests"] * one) / GIB
    return out


def _batch_sweep(setup: dict) -> dict[str, float]:
    """`kvdeck sweep --batch` on the sim engine (`batch_sweep.py`): per batch size, output
    tokens per second, mean TTFT (s), mean gap between outputs (ms)."""
    from kvdeck.runtime.core.config import EngineConfig, Knobs
    from kvdeck.runtime.core.engine import Engine
    from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
    from kvdeck.runtime.planning.batch_sweep import batch_sweep
    from kvdeck.runtime.runs.runner import run_arrivals

    def run(arrivals: list) -> tuple:
        ex = SimExecutor(SimConfig(hardware=setup.get("hardware", "rtx-pro-6000")))
        engine = Engine(EngineConfig(
            kv_memory_bytes=int(float(setup["kv_memory_gib"]) * GIB),
            knobs=Knobs(max_num_seqs=len(arrivals), **setup.get("knobs", {}))), ex)
        records: list = []
        engine.recorder = records.append
        requests = run_arrivals(engine, arrivals, vocab_size=32_000)["requests"]
        engine.check_integrity()
        return requests, records, ex.hardware.bandwidth_bytes_per_s

    out = {}
    for p in batch_sweep(run, setup["batches"], int(setup["prompt_len"]),
                         int(setup["output_len"])):
        out[f"b{p.batch}.tok_s"] = p.throughput_tps
        out[f"b{p.batch}.ttft_s"] = p.ttft_mean_s
        out[f"b{p.batch}.itl_ms"] = p.itl_mean_s * 1e3
    return out


def _static_vs_continuous(setup: dict) -> dict[str, float]:
    """The sim engine at a fixed step time over outputs drawn as the chapter's script draws
    them (`random.seed`, `randint`), static against continuous batching: output tokens per
    second each, and the speed-up."""
    import random

    from kvdeck.runtime.core.config import EngineConfig, Knobs
    from kvdeck.runtime.core.engine import Engine
    from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
    from kvdeck.runtime.runs.runner import run_arrivals
    from kvdeck.runtime.runs.trace import Arrival

    rng = random.Random(int(setup["seed"]))
    lo, hi = setup["output_range"]
    outputs = [rng.randint(lo, hi) for _ in range(int(setup["requests"]))]
    out = {}
    for mode in ("static", "continuous"):
        engine = Engine(EngineConfig(kv_memory_bytes=GIB, knobs=Knobs(
            scheduling=mode, max_num_seqs=int(setup["batch"]), enable_prefix_caching=False)),
            SimExecutor(SimConfig(timing="fit", fixed_ms=float(setup["step_ms"]),
                                  per_token_us=0.0, per_pair_ns=0.0)))
        arrivals = [Arrival(0.0, 1, n) for n in outputs]  # no prefill work: a 1-token prompt
        s = run_arrivals(engine, arrivals, vocab_size=32_000)["summary"]
        engine.check_integrity()
        out[f"{mode}.tok_s"] = s["output_tokens_per_s"]
    out["speedup"] = out["continuous.tok_s"] / out["static.tok_s"]
    return out


def _paged_memory(setup: dict) -> dict[str, float]:
    """KV held by requests reserving their whole length against paged ones (the block
    manager, per case), in GB at the setup's bytes per token, with the waste of each; and
    the model profile's own bytes per token, which a chapter may state otherwise."""
    from kvdeck.runtime.core.request import Request, SamplingParams
    from kvdeck.runtime.kv.manager import BlockManager

    k, p = float(setup["kv_bytes_per_token"]), int(setup["block_size"])
    out: dict[str, float] = {}
    for name, (n, most, mean) in setup["cases"].items():
        held = {}
        for reserve in (True, False):
            kv = BlockManager(n * -(-most // p), p, enable_caching=False)
            for i in range(n):
                req = Request(f"r{i}", [1] * mean, SamplingParams(max_tokens=most - mean + 1))
                kv.admit(req, mean, reserve)
            kv.check_integrity()
            held[reserve] = (kv.pool.num_used + (kv.num_reserved if reserve else 0)) * p
        out[f"{name}.preallocated_gb"] = held[True] * k / 1e9
        out[f"{name}.paged_gb"] = held[False] * k / 1e9
        out[f"{name}.waste_preallocated"] = (held[True] - n * mean) / held[True]
        out[f"{name}.waste_paged"] = (held[False] - n * mean) / held[False]
        out[f"{name}.ratio"] = held[True] / held[False]
    if "model" in setup:
        out["model_kv_bytes_per_token"] = ModelProfile.load(setup["model"]).kv_bytes_per_token()
    return out


def _drafting(setup: dict) -> dict[str, float]:
    """A draft network's pass at the batch-1 read rate of the card's measured curve (its
    first point: bytes over time), drafting one pass per token against one for all, and
    the time per output token of each with the verification round."""
    from kvdeck.runtime.planning.step_time import Measured

    measured = Measured.of(ModelProfile.load(setup.get("model", "qwen3-8b")),
                           HardwareProfile.load(setup.get("hardware", "rtx-pro-6000")))
    read, verify = measured.points[0]
    rate = read / verify
    one = float(setup["draft_bytes"]) / rate
    m, per_round = int(setup["draft_tokens"]), float(setup["tokens_per_round"])
    return {"read_rate_gbs": rate / 1e9, "pass_ms": one * 1e3, "sequential_ms": m * one * 1e3,
            "sequential.ms_per_token": (m * one + verify) / per_round * 1e3,
            "parallel.ms_per_token": (one + verify) / per_round * 1e3}


def _spec_latency(setup: dict) -> dict[str, float]:
    """Speculative rounds fed to kvdeck's speculation counters: their time per output
    token (`ΣT/ΣN`, as the panel shows it) against the mean of the rounds' own ratios."""
    from kvdeck.runtime.spec.stats import SpecStats

    stats, ratios = SpecStats(), []
    for ms, emitted in setup["rounds"]:
        stats.on_round(emitted - 1, emitted - 1, emitted, ms / 1e3)
        ratios.append(ms / emitted)
    view = stats.view("draft", max(e for _, e in setup["rounds"]) - 1)
    return {"ms_per_token": view.seconds_per_token * 1e3,
            "mean_of_ratios_ms": sum(ratios) / len(ratios)}


def _chunk_pairs(setup: dict) -> dict[str, float]:
    """Causal query–key pairs of a prompt's first and last chunk (`causal_pairs`)."""
    from kvdeck.runtime.core.step_data import causal_pairs

    c, prompt = int(setup["chunk"]), int(setup["prompt"])
    first, last = causal_pairs(c, 0), causal_pairs(c, prompt - c)
    return {"first_pairs": first, "last_pairs": last, "ratio": last / first}


def _branches(setup: dict) -> dict[str, float]:
    """A request forked into branches in the block manager, each growing past the shared
    prefix: the block-table references they hold, the physical blocks, and the saving."""
    from kvdeck.runtime.core.request import Request, SamplingParams
    from kvdeck.runtime.kv.manager import BlockManager

    p, shared, own, n = (int(setup[k]) for k in ("block_size", "shared_blocks", "own_blocks",
                                                 "branches"))
    kv = BlockManager(shared + n * own + 8, p, enable_caching=False)
    parent = Request("parent", [1] * (shared * p), SamplingParams(max_tokens=own * p + 1))
    kv.admit(parent, shared * p, False)
    parent.num_computed_tokens = shared * p
    branches = [Request(f"b{i}", list(parent.prompt_token_ids),
                        SamplingParams(max_tokens=own * p + 1)) for i in range(n)]
    for b in branches:
        kv.fork(parent, b)
    kv.release(parent)
    for b in branches:
        kv.allocate(b, own * p)
    kv.check_integrity()
    refs = sum(len(kv.table(b.request_id)) for b in branches)
    return {"references": refs, "physical_blocks": kv.pool.num_used,
            "saving": 1 - kv.pool.num_used / refs}


def _verify_cost(setup: dict) -> dict[str, float]:
    """A speculative round's verification by the step model: the matmul and attention
    FLOPs its extra rows add over a plain decode step (GFLOP), their time at the measured
    prefill efficiency (ms), and the round (ms) — the larger of that and the bytes it reads
    along the measured curve."""
    from kvdeck.runtime.core.step_data import causal_pairs
    from kvdeck.runtime.planning.planner import Planner
    from kvdeck.runtime.planning.roofline import Peaks
    from kvdeck.runtime.planning.workloads import Workload

    model = ModelProfile.load(setup.get("model", "qwen3-8b"))
    hw = HardwareProfile.load(setup.get("hardware", "rtx-pro-6000"))
    planner = Planner(hw, model, Workload.load("long-burst"), GIB)
    peaks = Peaks.of(model, hw)  # the roofline's FLOPs per new token and per causal pair
    b, rows, ctx = (int(setup[k]) for k in ("batch", "rows", "context"))
    pairs = b * causal_pairs(rows, ctx)
    flops = peaks.flops_per_token * b * rows + peaks.flops_per_pair * pairs
    if setup.get("extra_only"):  # the rows beyond a plain decode step's
        flops -= peaks.flops_per_token * b + peaks.flops_per_pair * b * causal_pairs(1, ctx)
    return {"gflop": flops / 1e9,
            "compute_ms": flops / (hw.peak_flops * planner.measured.prefill_mfu) * 1e3,
            "round_ms": planner.step_seconds(b * rows, pairs, b * (ctx + rows)) * 1e3}


def _graph_padding(setup: dict) -> dict[str, float]:
    """Decode steps of each row count on the sim engine with execution shapes: the graph
    the step ran in (rows + the padding its record counts)."""
    from kvdeck.runtime.core.config import EngineConfig, Knobs
    from kvdeck.runtime.core.engine import Engine
    from kvdeck.runtime.core.request import SamplingParams
    from kvdeck.runtime.executors.sim import SimConfig, SimExecutor

    buckets = ",".join(str(b) for b in setup["buckets"])
    out = {}
    for rows in setup["rows"]:
        engine = Engine(EngineConfig(kv_memory_bytes=GIB, knobs=Knobs(
            max_num_seqs=rows, enable_prefix_caching=False)),
            SimExecutor(SimConfig(graph_buckets=buckets)))
        for i in range(rows):
            engine.add_request([3 + i] * 16, SamplingParams(max_tokens=8, ignore_eos=True))
        while True:
            record = engine.step()
            if record is not None and record.dt and record.num_decode == rows:
                break
        out[f"rows{rows}.graph"] = rows + record.padding
        out[f"rows{rows}.padding"] = record.padding
    return out


def _tp_allreduce(setup: dict) -> dict[str, float]:
    """What tensor parallelism's all-reduces add to a layer and to a step of `tokens`
    tokens, for each named card's interconnect (`parallel.py`)."""
    from kvdeck.runtime.planning.parallel import (
        ALLREDUCES_PER_LAYER,
        allreduce_seconds_per_layer,
        layer_message_bytes,
    )

    model, tp, tokens = ModelProfile.load(setup["model"]), int(setup["tp"]), int(setup["tokens"])
    out = {"message_mb": ALLREDUCES_PER_LAYER * layer_message_bytes(model, tokens) / 1e6}
    for name, card in setup["links"].items():
        layer = allreduce_seconds_per_layer(model, tokens, tp, HardwareProfile.load(card))
        out[f"{name}.layer_ms"] = layer * 1e3
        out[f"{name}.step_ms"] = layer * model.num_layers * 1e3
    return out


KINDS: dict[str, Callable[[dict], dict[str, Any]]] = {
    "plan": _plan, "retention": _retention, "offload": _offload, "capacity": _capacity,
    "decode-mbu": _decode_mbu, "batching": _batching, "speculation": _speculation,
    "format-time": _format_time, "paging": _paging, "amdahl": _amdahl,
    "fits-memory": _fits_memory, "batch-sweep": _batch_sweep,
    "static-vs-continuous": _static_vs_continuous, "paged-memory": _paged_memory,
    "drafting": _drafting, "spec-latency": _spec_latency, "chunk-pairs": _chunk_pairs,
    "branches": _branches, "verify-cost": _verify_cost, "graph-padding": _graph_padding,
    "tp-allreduce": _tp_allreduce}
"""How each kind of scenario computes kvdeck's figures."""
