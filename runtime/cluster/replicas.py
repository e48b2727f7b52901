"""Many engines on one virtual clock behind a router: `run_cluster`.

Each replica is a whole engine — its own scheduler, KV pool, prefix cache and knobs, a sim
executor on a virtual clock. The loop is a discrete-event simulation: the next thing to
happen is the earliest of the next arrival, the next KV handoff and the earliest clock of a
replica with work; an arrival is routed at its time (the router sees what was published
`staleness_s` before, `view.py`), a replica with work runs one step and publishes. Ties go to
arrivals, so requests that arrive as a step ends are planned in the next one, as on one
engine (`runs/runner.run_arrivals`).

With prefill and decode roles (`handoff.py`), arrivals go to the prefill replicas (their
router), and each finished prefill becomes a handoff due when its KV is in, routed then to
the decode replicas (least-loaded, as vLLM's P/D proxies do).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvdeck.runtime.cluster.handoff import TRANSFER_MODES, Handoff, transfer_seconds
from kvdeck.runtime.cluster.routers import Router, make_router
from kvdeck.runtime.cluster.view import Prompt, Publisher, ReplicaView
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import Request, RequestStatus, SamplingParams
from kvdeck.runtime.errors import ConfigError, EngineFailedError, KvdeckError
from kvdeck.runtime.fleet.block_events import env_seed
from kvdeck.runtime.runs.runner import rejected
from kvdeck.runtime.runs.trace import Arrival, synthesize_tokens
from kvdeck.runtime.stats.metrics import RequestMetrics, request_metrics

ROLES = ("both", "prefill", "decode")
STUCK_STEPS = 1000
"""Empty steps in a row at one time after which a replica is taken to be stuck."""


@dataclass
class Replica:
    """One engine of the fleet and what the run keeps of it."""

    name: str
    engine: Engine
    role: str = "both"
    view: ReplicaView = field(init=False)
    publisher: Publisher = field(init=False)
    metrics: list[RequestMetrics] = field(default_factory=list)
    kv_sent_bytes: int = 0
    kv_received_bytes: int = 0
    transfer_s: float = 0.0
    """Handoff time not hidden behind prefill, summed over the requests it received."""


@dataclass(frozen=True)
class ClusterConfig:
    """How the fleet is run (`kvdeck run-trace --replicas/--router`, `--prefill-replicas`)."""

    router: str = "round-robin"
    decode_router: str = "least-loaded"
    staleness_s: float = 0.0
    """How long after a step its events and metrics reach the router."""
    session_affinity: bool = True
    """A multi-turn session's later turns go where its first went (while that is up)."""
    kv_link_bytes_per_s: float | None = None
    """The prefill-to-decode link (None: the hardware profile's host link)."""
    kv_transfer: str = "layerwise"
    seed: int = 0
    check_integrity: bool = False
    """Check every replica's KV invariants after each of its steps (tests)."""

    def __post_init__(self) -> None:
        if not self.staleness_s >= 0:
            raise ConfigError(f"--router-staleness must be at least 0 seconds, got "
                              f"{self.staleness_s!r}.")
        make_router(self.router)
        make_router(self.decode_router)
        if self.kv_transfer not in TRANSFER_MODES:
            raise ConfigError(f"kv_transfer must be one of {', '.join(TRANSFER_MODES)}, got "
                              f"{self.kv_transfer!r}.")
        if self.kv_link_bytes_per_s is not None and not self.kv_link_bytes_per_s > 0:
            raise ConfigError("The KV link's bandwidth must be above 0 (--kv-link-bandwidth).")


def replica_roles(replicas: int, prefill: int, decode: int) -> list[str]:
    """Each replica's role from the counts the user gave; one sentence when they do not
    add up."""
    if prefill or decode:
        if prefill < 1 or decode < 1:
            raise ConfigError(f"Disaggregated serving needs at least one prefill and one "
                              f"decode replica, got --prefill-replicas {prefill} and "
                              f"--decode-replicas {decode}.")
        if replicas not in (1, prefill + decode):
            raise ConfigError(f"--replicas {replicas} does not add up: --prefill-replicas "
                              f"{prefill} + --decode-replicas {decode} make "
                              f"{prefill + decode}; leave --replicas out or make it equal.")
        return ["prefill"] * prefill + ["decode"] * decode
    if not 1 <= replicas <= 256:
        raise ConfigError(f"--replicas must be from 1 to 256, got {replicas}.")
    return ["both"] * replicas


class Cluster:
    """The fleet being run: replicas, routers, the pending handoffs."""

    def __init__(self, engines: Sequence[Engine], roles: Sequence[str], config: ClusterConfig,
                 *, vocab_size: int, hash_block_tokens: int = 512,
                 on_step: Callable[[Replica], None] | None = None):
        if len(engines) != len(roles) or not engines:
            raise ConfigError("A fleet needs one role per engine and at least one engine.")
        self.config = config
        self.vocab_size = vocab_size
        self.hash_block_tokens = hash_block_tokens
        self.on_step = on_step
        self.router: Router = make_router(config.router, config.seed)
        self.decode_router: Router = make_router(config.decode_router, config.seed + 1)
        seed = env_seed()
        width = len(str(len(engines) - 1))
        self.replicas: list[Replica] = []
        for i, (engine, role) in enumerate(zip(engines, roles, strict=True)):
            r = Replica(f"{role[0] if role != 'both' else 'r'}{i:0{width}d}", engine, role)
            r.view = ReplicaView(r.name, engine.kv.block_size, config.staleness_s, seed)
            r.publisher = Publisher(engine, r.view)
            engine.on_finish.append(self._finisher(r))
            self.replicas.append(r)
        sizes = {r.engine.kv.block_size for r in self.replicas}
        if len(sizes) > 1:
            raise ConfigError(f"Every replica needs one block size to route by blocks, got "
                              f"{sorted(sizes)}.")
        self.block_size = sizes.pop()
        self.disaggregated = "prefill" in roles
        self.handoffs: list[tuple[float, int, Handoff]] = []
        self.sessions: dict[str, ReplicaView] = {}
        self._arrivals: Sequence[Arrival] = ()
        self._pending_prefill: dict[Request, tuple[int, Arrival, list[int]]] = {}
        """Prefill requests (by object: a trace may repeat an id) and what they hand off."""
        self._handed: dict[Request, Handoff] = {}
        """Decode requests and the handoff that brought them."""
        self._link_free: dict[str, float] = {}
        """When each prefill replica's link is free again (copies go one after another)."""

    # -- finishing --------------------------------------------------------------------------

    def _finisher(self, replica: Replica) -> Callable[[Request], None]:
        def done(req: Request) -> None:
            pending = self._pending_prefill.pop(req, None)
            if pending is None or req.status is not RequestStatus.FINISHED_LENGTH:
                m = request_metrics(req)
                handoff = self._handed.pop(req, None)
                if handoff is not None:  # its prompt's cache hits were the prefill side's
                    m = dataclasses.replace(m, cached_tokens=handoff.cached_tokens)
                replica.metrics.append(m)
                return
            index, arrival, tokens = pending
            self._hand_off(replica, req, index, arrival, tokens)
        return done

    def _hand_off(self, replica: Replica, req: Request, index: int, arrival: Arrival,
                  tokens: list[int]) -> None:
        engine = replica.engine
        nbytes = len(tokens) * engine.kv.bytes_per_block // engine.kv.block_size
        link = self.config.kv_link_bytes_per_s or engine.executor.info.link_bandwidth
        now = engine.clock.now()
        # The copy overlaps the prefill as it ran (admission to its end), and waits for the
        # copies before it on the same link.
        elapsed = now - (req.admitted_time if req.admitted_time is not None else now)
        exposed = transfer_seconds(nbytes, link, elapsed, engine.executor.info.num_layers,
                                   self.config.kv_transfer)
        start = max(now, self._link_free.get(replica.name, now))
        ready = self._link_free[replica.name] = start + exposed
        replica.kv_sent_bytes += nbytes
        h = Handoff(index, tokens, arrival.output_len, arrival.arrival_s, ready, nbytes,
                    ready - now, replica.name, req.num_cached_tokens)
        heapq.heappush(self.handoffs, (h.ready_s, index, h))

    # -- routing ----------------------------------------------------------------------------

    def _views(self, role: str) -> list[ReplicaView]:
        return [r.view for r in self.replicas if r.role in (role, "both") and r.view.up]

    def _route(self, index: int, arrival: Arrival, now: float) -> None:
        rid = arrival.request_id or f"r{index}"
        try:
            tokens = synthesize_tokens(arrival, index, self.vocab_size, self.hash_block_tokens)
        except KvdeckError as e:
            self._reject(arrival, rid, str(e))
            return
        views = self._views("prefill")
        for v in views:
            v.catch_up(now)
        prompt = Prompt(tokens, self.block_size, views[0].seed, arrival.session)
        view = self.sessions.get(arrival.session) if self.config.session_affinity and \
            arrival.session else None
        if view is None or not view.up:
            view = self.router.choose(prompt, views, now)
            if arrival.session:
                self.sessions[arrival.session] = view
        replica = self._replica(view)
        if self.disaggregated:
            fits = min(r.engine.max_model_len for r in self.replicas if r.role == "decode")
            if len(tokens) + arrival.output_len > fits:  # refused before its prefill runs
                self._reject(arrival, rid, f"The prompt's {len(tokens):,} tokens and "
                             f"{arrival.output_len:,} to generate exceed the decode "
                             f"replicas' context of {fits:,} tokens.")
                return
            req = self._add(replica, arrival, rid, tokens, 1, now)
            if req is not None:
                self._pending_prefill[req] = (index, arrival, tokens)
        else:
            self._add(replica, arrival, rid, tokens, arrival.output_len, now)

    def _route_handoff(self, h: Handoff) -> None:
        arrival = self._arrivals[h.index]
        rid = arrival.request_id or f"r{h.index}"
        views = self._views("decode")
        for v in views:
            v.catch_up(h.ready_s)
        prompt = Prompt(h.tokens, self.block_size, views[0].seed)
        replica = self._replica(self.decode_router.choose(prompt, views, h.ready_s))
        replica.kv_received_bytes += h.nbytes
        replica.transfer_s += h.seconds
        req = self._add(replica, arrival, rid, h.tokens, h.output_len, h.ready_s,
                        remote=len(h.tokens) - 1)
        if req is not None:
            self._handed[req] = h

    def _replica(self, view: ReplicaView) -> Replica:
        return next(r for r in self.replicas if r.view is view)

    def _add(self, replica: Replica, arrival: Arrival, rid: str, tokens: list[int],
             max_tokens: int, now: float, remote: int = 0) -> Request | None:
        """The request added to `replica`'s engine, or None when it refused it (then its
        metrics say why)."""
        engine = replica.engine
        try:
            req = engine.add_request(tokens, SamplingParams(max_tokens=max_tokens,
                                                            ignore_eos=True),
                                     request_id=rid, arrival_time=arrival.arrival_s,
                                     deadline_s=arrival.deadline_s, priority=arrival.priority,
                                     intake_s=now - arrival.arrival_s, remote_kv_tokens=remote)
        except KvdeckError as e:
            replica.metrics.append(rejected(arrival, rid, str(e)))
            return None
        replica.view.note_sent(now, len(tokens) - remote)
        return req

    def _reject(self, arrival: Arrival, rid: str, reason: str) -> None:
        self.replicas[0].metrics.append(rejected(arrival, rid, reason))

    # -- the loop ---------------------------------------------------------------------------

    def run(self, arrivals: Sequence[Arrival],
            pacer: Callable[[float], bool] | None = None) -> None:
        """Feed `arrivals` at their times and step every replica until all are done.
        `pacer(t)`, called before whatever happens at engine time `t`, may hold the loop
        to the wall clock (a live fleet) and stop it by returning False."""
        self._arrivals = arrivals
        i, n = 0, len(arrivals)
        empty = [0] * len(self.replicas)
        while True:
            t_arrival = arrivals[i].arrival_s if i < n else math.inf
            t_handoff = self.handoffs[0][0] if self.handoffs else math.inf
            t_step, k = math.inf, -1
            for j, r in enumerate(self.replicas):
                if r.engine.has_work and r.engine.clock.now() < t_step:
                    t_step, k = r.engine.clock.now(), j
            if pacer is not None and not pacer(min(t_arrival, t_handoff, t_step)):
                break
            if min(t_arrival, t_handoff) <= t_step:
                if t_arrival == math.inf and t_handoff == math.inf:
                    break
                if t_handoff < t_arrival:
                    self._route_handoff(heapq.heappop(self.handoffs)[2])
                else:
                    self._route(i, arrivals[i], t_arrival)
                    i += 1
                continue
            self._step(self.replicas[k], empty, k)

    def _step(self, r: Replica, empty: list[int], k: int) -> None:
        engine = r.engine
        before = engine.clock.now()
        try:
            record = engine.step()
        except KvdeckError:
            raise
        except Exception as e:  # noqa: BLE001 - an engine failure: one sentence and a log
            raise engine.fail(e).error(f"Replica {r.name}") from None
        if record is None and engine.clock.now() == before:
            empty[k] += 1
            if empty[k] >= STUCK_STEPS:
                raise EngineFailedError(f"Replica {r.name} has work but ran no step "
                                        f"{STUCK_STEPS} times at {before:.3f} s.")
        else:
            empty[k] = 0
        r.publisher.after_step(before)
        if self.config.check_integrity:
            engine.check_integrity()
        if self.on_step is not None:
            self.on_step(r)

