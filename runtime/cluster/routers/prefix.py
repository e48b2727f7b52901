"""Routers that know the replicas' prefix caches, from their KV events:

- `prefix`: llm-d's precise prefix-cache scorer alone — the replica holding the longest run
  of the prompt's blocks from the start (vLLM's block hashes of the prompt's tokens, GPU
  blocks weighing 1.0, CPU ones 0.8); ties go to the least loaded.
- `weighted`: llm-d's scheduler form — `prefix·s_prefix + kv·s_kv + queue·s_queue`, highest
  wins: `s_prefix` the prompt's blocks held over its blocks, `s_kv = 1 − KV usage`,
  `s_queue = (most − q) / (most − least)` over the replicas' queues (1 when all equal).
- `cost`: Dynamo's KV router — cost `overlap × blocks to prefill + blocks decoding`, where
  blocks to prefill are the prompt's blocks not held plus what the replica has queued to
  prefill, and blocks decoding are those its running requests hold plus the prompt's; the
  lowest wins at temperature 0, else a replica is drawn with probability
  `softmax(−cost/max cost / temperature)`.
"""

from __future__ import annotations

import math
import random

from kvdeck.runtime.cluster.routers.base import Router, least_loaded
from kvdeck.runtime.cluster.view import Prompt, ReplicaView


class PrefixAware(Router):
    name = "prefix"

    def choose(self, prompt: Prompt, views: list[ReplicaView], now: float) -> ReplicaView:
        hashes = prompt.hashes_held(views)
        scores = {v.name: v.cached_blocks(hashes)[1] for v in views}
        best = max(scores.values())
        return least_loaded([v for v in views if scores[v.name] == best])


class Weighted(Router):
    name = "weighted"
    settings = {"prefix": 3.0, "kv": 2.0, "queue": 2.0}

    def choose(self, prompt: Prompt, views: list[ReplicaView], now: float) -> ReplicaView:
        w = self.values
        hashes = prompt.hashes_held(views)
        blocks = max(prompt.num_blocks, 1)
        queues = [v.queue for v in views]
        most, least = max(queues), min(queues)

        def total(v: ReplicaView) -> float:
            s_prefix = v.cached_blocks(hashes)[1] / blocks
            s_queue = 1.0 if most == least else (most - v.queue) / (most - least)
            return w["prefix"] * s_prefix + w["kv"] * (1.0 - v.metrics.kv_usage) + \
                w["queue"] * s_queue
        return max(views, key=total)


class Cost(Router):
    name = "cost"
    settings = {"overlap": 1.0, "temperature": 0.0}

    def __init__(self, seed: int = 0, **settings: float):
        super().__init__(seed, **settings)
        self._rng = random.Random(seed)

    def choose(self, prompt: Prompt, views: list[ReplicaView], now: float) -> ReplicaView:
        hashes = prompt.hashes_held(views)
        size = prompt.block_size
        costs = []
        for v in views:
            held = v.cached_blocks(hashes)[0]
            queued = v.metrics.prefill_tokens + sum(n for _, n in v.sent)
            prefill = prompt.num_blocks - held + queued / size
            decode = v.metrics.decode_blocks + prompt.num_blocks
            costs.append(self.values["overlap"] * prefill + decode)
        temperature = self.values["temperature"]
        if temperature <= 0:
            return views[min(range(len(views)), key=costs.__getitem__)]
        top = max(costs) or 1.0
        weights = [math.exp(-c / top / temperature) for c in costs]
        return self._rng.choices(views, weights)[0]
