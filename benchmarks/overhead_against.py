"""Engine overhead of the working tree against another commit, in one run, as ratios.

    python -m benchmarks.overhead_against REV [ROUNDS]

Checks REV out into a temporary git worktree and times `engine_overhead.measure` (64, 256
and 1,024 running requests) on both trees in paired rounds: each round runs the two back to
back, each in a fresh process, in alternating order, and takes the ratio within the round,
so the machine's drift between rounds cancels. Prints the median and quartiles of the ratios
(working tree / REV) of the iteration and the snapshot cost. Each tree is imported as
`kvdeck` through a folder holding a `kvdeck` link to it, ahead of the editable install.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = ((64, 400), (256, 200), (1024, 60))
RUN = f"""
import gc, json
import kvdeck.benchmarks.engine_overhead as m
build = m.build
def frozen(n):  # the same method on both trees, whichever the REV's benchmark used
    e = build(n)
    gc.collect()
    gc.freeze()
    return e
m.build = frozen
out = []
for n, steps in {SIZES!r}:
    out.append(m.measure(n, steps))
    gc.unfreeze()
    gc.collect()
print(json.dumps(out))
"""
"""Times each size with the steady-state heap frozen out of the cyclic collector, on both
trees alike (see `engine_overhead.measure`)."""


def timed(path: Path) -> list[dict]:
    """One `measure` per size, in a fresh process importing `kvdeck` from `path`."""
    out = subprocess.run([sys.executable, "-c", RUN], capture_output=True, text=True,
                         check=True, cwd=path, env={**os.environ, "PYTHONPATH": str(path)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(rev: str, rounds: int = 8) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(old), rev], cwd=ROOT,
                       check=True)
        try:
            trees = {"rev": Path(tmp) / "rev", "here": Path(tmp) / "here"}
            for name, target in (("rev", old), ("here", ROOT)):
                trees[name].mkdir()
                (trees[name] / "kvdeck").symlink_to(target)
            ratios: dict[str, list[float]] = {}
            for r in range(rounds):
                got = {}
                for name in (("rev", "here") if r % 2 == 0 else ("here", "rev")):
                    got[name] = timed(trees[name])
                for i, (n, _) in enumerate(SIZES):
                    for k in ("ms_per_iteration", "ms_per_snapshot"):
                        ratios.setdefault(f"{n} {k}", []).append(
                            got["here"][i][k] / got["rev"][i][k])
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT,
                           check=False)
    print(f"working tree / {rev}, {rounds} paired rounds (median, quartiles)")
    summary = {}
    for key, values in ratios.items():
        q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
        summary[key] = {"median": statistics.median(values), "q1": q[0], "q3": q[2]}
        print(f"{key:<24} {statistics.median(values):6.3f}  ({q[0]:.3f}–{q[2]:.3f})")
    return summary


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8)
