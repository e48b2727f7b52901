"""Waking from idle: what a server's first step after an idle spell costs beyond the same
step run right after another.

On the shared 2-core VMs kvdeck is built on, the first step after an idle spell is slower the
longer the spell: a plain torch loop of bf16 matmuls over 190 MB of weights took 24 ms back
to back, 42–55 ms after 5 idle seconds and 60–68 ms after 15–20 (the caches and the host's
scheduling forget the process; only the first step pays). A kvdeck server's prefill of 64
tokens on a cached 512-token prefix took 145–166 ms after under a second, 184–188 after 10
and 205–217 after 15 (from the time it was due; a client's timer after a long idle fires up
to a thousandth of it late, which may be 10–20 ms of those). A trace whose requests arrive
seconds apart runs that first step again and again, and a step model fitted to probes sent
back to back misses it.

`kvdeck calibrate --url` measures it (`Probes.wake`: one prompt sent after each idle spell,
less the same prompt sent back to back), the profile keeps it as `[wake.<hardware>]`, and
the sim adds it (made non-decreasing in the spell) to the first step after each idle spell.
"""

from __future__ import annotations

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.planning.profile_tables import number, point_tables

Wake = tuple[tuple[float, float], ...]
"""(idle seconds, extra seconds of the first step after them), idle ascending."""


def wake_seconds(points: Wake, idle: float) -> float:
    """The extra seconds of a step after `idle` idle seconds: linear from (0, 0) through
    the measured points, the last one's beyond them (the cost of a cold start is bounded)."""
    if idle <= 0 or not points:
        return 0.0
    x0, y0 = 0.0, 0.0
    for x, y in points:
        if idle <= x:
            return y0 + (y - y0) * (idle - x0) / (x - x0)
        x0, y0 = x, y
    return y0


def pooled(points: Wake) -> Wake:
    """`points` (idle ascending) made non-decreasing: a longer spell never costs less, so
    neighbours that say otherwise are pooled at their mean (pool-adjacent-violators). One
    timing per spell on a shared machine is noisy (torch: 38 ms after 5 s, 17 after 10)."""
    blocks: list[list[float]] = []  # [sum of extras, count]
    for _, y in points:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            y_sum, n = blocks.pop()
            blocks[-1][0] += y_sum
            blocks[-1][1] += n
    means = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]
    return tuple((x, m) for (x, _), m in zip(points, means, strict=True))


def wake_tables(d: dict, where: str) -> dict[str, Wake]:
    """A model profile's `[wake.<hardware>]` tables (`points`, [idle seconds, extra
    milliseconds] pairs) by hardware name, idle ascending and `pooled`."""
    what = "[idle seconds, extra milliseconds] pairs (idle above 0, each once; extra 0 or more)"
    out = {}
    for hw, points in point_tables(d, where, "wake", 2, lambda p: number(p[0])
                                   and number(p[1]) and p[0] > 0 and p[1] >= 0, what).items():
        if len({p[0] for p in points}) < len(points):
            raise ConfigError(f"Profile {where}: wake.{hw}.points must be a list of {what}, "
                              f"got {points!r}.")
        out[hw] = pooled(tuple(sorted((float(s), ms / 1e3) for s, ms in points)))
    return out
