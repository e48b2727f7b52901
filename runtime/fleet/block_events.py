"""An engine's prefix-cache changes as vLLM's KV events (`BlockStored`, `BlockRemoved` maps),
with vLLM's own block hashes — what kvdeck's server publishes and what the simulated fleet's
routers read (`runtime/cluster/`).

    Cache (a block entered the prefix tree)     BlockStored, medium GPU
    Evict (the tree dropped it)                 BlockRemoved, medium GPU (CPU for a block
                                                that lived on the host tier)
    Demote (device -> host tier)                BlockRemoved GPU, then BlockStored CPU
    Promote (host tier -> device)               BlockStored GPU, then BlockRemoved CPU

A block's hash is the one vLLM gives the same tokens (`vllm_block_hash`: its default
`sha256` algorithm, seeded by `PYTHONHASHSEED` as vLLM seeds it), published as vLLM does — the
low 64 bits, or the 32-byte digest — so an indexer that hashes request tokens the vLLM way
(llm-d's) finds kvdeck's blocks, and replicas sharing the seed name a prefix alike. Only
full-attention blocks are published (kvdeck's own sliding-window pages are not cache
entries).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Iterable, Iterator

from kvdeck.runtime.fleet.kv_events import fold
from kvdeck.runtime.kv.events import Cache, Demote, Evict, Promote
from kvdeck.runtime.kv.state import adapter_of

DEFAULT_SEED = "vllm-none-hash"
"""vLLM's seed of the first block's parent hash when `PYTHONHASHSEED` is not set."""


def vllm_block_hash(parent: bytes | None, tokens: tuple[int, ...], seed: str,
                    lora: str | None = None) -> bytes:
    """The hash vLLM's prefix cache gives a full block of `tokens` after the block hashed
    `parent` (None: the first): SHA-256 of the pickled (parent, tokens, extra keys), the
    first block's parent being SHA-256 of the pickled seed (vLLM's default `sha256`
    algorithm). The extra keys are the LoRA adapter's name when the block was computed
    under one (vLLM's `_gen_lora_extra_hash_keys`), else none; no multimodal keys. Checked
    against a real vLLM 0.32's events in `tests/unit/test_kv_events.py`."""
    if parent is None:
        parent = _sha256(seed)
    return _sha256((parent, tuple(tokens), (lora,) if lora else None))


def _sha256(value) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def env_seed() -> str:
    """The seed vLLM would use in this process's environment."""
    return os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)


def prompt_block_hashes(tokens: list[int], block_size: int, seed: str) -> Iterator[int]:
    """The folded (64-bit) vLLM hashes of a prompt's full blocks, first to last, computed
    lazily so a caller that stops at the first miss hashes no further (llm-d's precise
    scorer hashes a request's tokens this way)."""
    digest = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        digest = vllm_block_hash(digest, tuple(tokens[start:start + block_size]), seed)
        yield fold(digest)


class BlockEvents:
    """Turns one engine's KV events into vLLM event maps, remembering each cached node's
    hash while it is cached."""

    def __init__(self, block_size: int, seed: str | None = None, int_hashes: bool = True):
        self.block_size = block_size
        self.seed = env_seed() if seed is None else seed
        self.int_hashes = int_hashes
        self._hashes: dict[int, tuple[int | bytes, bytes, str | None]] = {}
        """Cached node id -> (published hash, vLLM's full digest, its LoRA adapter) while
        the node is cached."""

    def translate(self, kv_events: Iterable, tree) -> list[dict]:
        """A step's KV events (`StepRecord.kv`) as vLLM event maps."""
        out: list[dict] = []
        hashes = self._hashes
        for ev in kv_events:
            if isinstance(ev, Cache):
                stored = self._stored(ev, tree)
                if stored is not None:
                    out.append(stored)
            elif isinstance(ev, Evict):
                known = hashes.pop(ev.node_id, None)
                if known is not None:
                    out.append(removed(known[0], "CPU" if ev.block < 0 else "GPU"))
            elif isinstance(ev, Demote) and ev.node_id in hashes:
                h, node = hashes[ev.node_id][0], tree.nodes.get(ev.node_id)
                out.append(removed(h, "GPU"))
                if node is not None:
                    out.append(self._store_map(h, node, "CPU"))
            elif isinstance(ev, Promote) and ev.node_id in hashes:
                h, node = hashes[ev.node_id][0], tree.nodes.get(ev.node_id)
                if node is not None:
                    out.append(self._store_map(h, node, "GPU"))
                out.append(removed(h, "CPU"))
        return out

    def reset(self, tree) -> list[dict]:
        """After the cache was reset (`BlockManager.clear_cache`): `AllBlocksCleared`, as
        vLLM publishes it, then `BlockStored` again for each published block a request
        still holds (a reset drops only what no request uses), parents first, so a
        subscriber's view equals the cache again. Blocks the reset dropped are forgotten:
        their evictions publish nothing more."""
        kept = {nid: h for nid, h in self._hashes.items() if nid in tree.nodes}
        self._hashes = {}
        out: list[dict] = [{"type": "AllBlocksCleared"}]
        for nid in sorted(kept, key=lambda n: tree.nodes[n].depth_tokens):
            node = tree.nodes[nid]
            parent = node.parent.node_id if node.parent is not None else None
            if parent is not None and parent in tree.nodes and tree.nodes[parent].key and \
                    parent not in self._hashes:
                continue  # its parent went: a subscriber could not place it
            self._hashes[nid] = kept[nid]
            out.append(self._store_map(kept[nid][0], node, "CPU" if node.on_host else "GPU"))
        return out

    def _stored(self, ev: Cache, tree) -> dict | None:
        node = tree.nodes.get(ev.node_id)
        if node is None or len(node.key) != self.block_size:
            return None  # evicted within the step, or a replayed id-keyed node
        parent = self._hashes.get(ev.parent_id) if ev.parent_id else None
        if ev.parent_id and parent is None:
            return None  # its parent was never published: nothing a subscriber could place
        lora = parent[2] if parent else next(
            (adapter_of(ns) for ns, root in tree.roots.items() if root is node.parent), None)
        digest = vllm_block_hash(parent[1] if parent else None, node.key, self.seed, lora)
        h = fold(digest) if self.int_hashes else digest
        self._hashes[ev.node_id] = (h, digest, lora)
        return self._store_map(h, node, "GPU")

    def _store_map(self, h: int | bytes, node, medium: str) -> dict:
        parent = self._hashes.get(node.parent.node_id) if node.parent is not None else None
        lora = self._hashes[node.node_id][2]
        return {"type": "BlockStored", "block_hashes": [h],
                "parent_block_hash": parent[0] if parent else None,
                "token_ids": list(node.key), "block_size": self.block_size, "lora_id": None,
                "medium": medium, "lora_name": lora, "group_idx": 0,
                "kv_cache_spec_kind": "full_attention"}


def removed(h: int | bytes, medium: str) -> dict:
    return {"type": "BlockRemoved", "block_hashes": [h], "medium": medium, "group_idx": 0}
