"""Swapping a preempted request's KV to the host tier and back, and dropping the tier: the
host-tier half of `BlockManager` (`kv/manager.py`), which holds it as `swaps`. Every
decision is a KV event applied to the manager's state; every copy joins `copies` in the
order decided (the manager's module docstring says why the order matters)."""

from __future__ import annotations

from kvdeck.runtime.core.request import Request
from kvdeck.runtime.kv import events as ev


class HostSwaps:
    """`BlockManager`'s swap decisions (composed, like `WindowTables`): they read and change
    only the manager's state, through its methods."""

    def __init__(self, manager) -> None:
        self.m = manager

    def drop_host_tier(self, num_host_blocks: int) -> list[str]:
        """Empty the host tier and re-lay it as `num_host_blocks` blocks (the KV format
        changes: host copies in the old format are not converted). Swapped requests lose
        their host copy and recompute; demoted prefixes are dropped; pending copies are
        moot. Returns the ids of the requests that were swapped out."""
        m = self.m
        swapped = list(m.host_tables)
        for rid in swapped:
            m.apply(ev.Unswap(rid))
        m.tree.drop_host()
        m.copies.clear()
        if num_host_blocks != m.host.num_blocks:
            m.apply(ev.HostResize(num_host_blocks))
        return swapped

    def can_swap_out(self, num_blocks: int) -> bool:
        """Whether the host tier can take `num_blocks` blocks (dropping demoted prefixes)."""
        return 0 < num_blocks <= self.m.host.num_free + self.m.host.num_demoted

    def swap_out(self, req: Request) -> int:
        """Copy `req`'s computed blocks to the host tier and release its device blocks
        (between steps: the scheduler preempts while planning). Returns the blocks moved;
        the caller checks `can_swap_out` first. Its progress (`num_computed_tokens`) stays."""
        m = self.m
        rid = req.request_id
        table = m.tables[rid]
        n = m.blocks_needed(req.num_computed_tokens)
        made = m.tree.make_host_room(n)
        assert made, "swap_out without room on the host tier"
        pairs = [[table[i], h] for i, h in enumerate(m.host.pick(n))]
        m.apply(ev.SwapOut(rid, pairs))
        m.copies.append(("swap", "d2h", rid, pairs))
        m._release_device(rid)
        return n

    def swap_in_blocks(self, req: Request, num_new_tokens: int, reserve_full: bool) -> int:
        """Device blocks a swap-in of `req` with its next `num_new_tokens` tokens needs."""
        tokens = req.max_total_tokens if reserve_full else \
            req.num_computed_tokens + num_new_tokens
        return self.m.blocks_needed(tokens)

    def can_swap_in(self, req: Request, num_new_tokens: int, reserve_full: bool) -> bool:
        return self.swap_in_blocks(req, num_new_tokens, reserve_full) <= \
            self.m.num_available_blocks()

    def swap_in(self, req: Request, num_new_tokens: int, reserve_full: bool
                ) -> list[tuple[int, int]]:
        """Readmit swapped-out `req`: fresh device blocks receive its host blocks (copied
        before the next forward pass), then room for `num_new_tokens` more. Its blocks
        re-enter the prefix cache as they are found there (`cache_computed`)."""
        m = self.m
        rid = req.request_id
        hosts = m.host_tables[rid]
        m._chains[rid] = []
        if reserve_full:
            m.apply(ev.Reserve(rid, m.blocks_needed(req.max_total_tokens) - len(hosts)))
        # Device blocks first, while the host blocks are still held: a demotion decided
        # while taking them must not land in a host block not yet copied back.
        for i in range(len(hosts)):
            m._apply(ev.Ref(rid, i, m._take_for(rid, 1)[0]))
        pairs = [[h, d] for h, d in zip(hosts, m.tables[rid], strict=True)]
        m.copies.append(("swap", "h2d", rid, pairs))
        m.apply(ev.SwapIn(rid, pairs))
        return m.allocate(req, num_new_tokens)

    def unswap(self, req: Request) -> None:
        """Drop swapped-out `req`'s host copy (aborted, or it will recompute)."""
        self.m.apply(ev.Unswap(req.request_id))
