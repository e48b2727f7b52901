"""The console under simulated load, driven as an impatient operator drives it: random knob
edits (valid and not), pause and resume, recording on and off, the request table and charts
opened and left, traffic up and down; then `q`. It must exit 0 with no traceback and no native
abort, and every recording it made must replay.

CI runs a 40-second variant; `make soak` runs it for 10 minutes (KVDECK_CONSOLE_SOAK_S=600).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.terminal import Terminal

DURATION_S = float(os.environ.get("KVDECK_CONSOLE_SOAK_S", "40"))
VALUES = ("1", "4", "16", "64", "256", "512", "2048", "0.5", "-1", "abc", "99999999")


def knob_edit(rng: random.Random) -> list[str]:
    """k, move to a knob, Enter, then clear and type a value (an enum's list ignores the
    typing and takes the highlighted choice), Enter."""
    return (["k"] + ["\x1b[B"] * rng.randrange(15) + ["\r"] + ["\x7f"] * 12
            + [rng.choice(VALUES), "\x1b[B" * rng.randrange(3), "\r"])


ACTIONS = {
    "knob": knob_edit,
    "pause": lambda rng: ["p"],
    "record": lambda rng: ["r"],
    "requests": lambda rng: ["l", "f", "o", "\x1b[B", "\r", "l"],
    "charts": lambda rng: ["c", "c"],
    "rate": lambda rng: [rng.choice("+-")],
    "select": lambda rng: ["n"],
}


@pytest.mark.slow
def test_console_soak_with_random_operator_actions_then_q(tmp_path: Path) -> None:
    rng = random.Random(11)
    term = Terminal([sys.executable, "-m", "kvdeck.console.cli", "console", "--executor", "sim"],
                    cwd=str(tmp_path))
    done: dict[str, int] = {}
    try:
        assert b"Knobs" in term.read(120, until=(b"KV blocks", b"Knobs"))
        end = time.monotonic() + DURATION_S
        while time.monotonic() < end:
            name = rng.choice(list(ACTIONS))
            for key in ACTIONS[name](rng):
                term.press(key)
                term.read(0.05)
            done[name] = done.get(name, 0) + 1
            term.read(rng.uniform(0.2, 1.5))
        term.press("\x1b")  # leave whatever is open (a dialog, the knob table)
        term.read(1)
        term.press("q")
        status = term.wait(120)
    finally:
        term.close()
    screen = term.screen.decode("utf-8", errors="replace")
    assert status is not None, "the console did not exit within 120 s of q"
    assert "Traceback" not in screen and "terminate called" not in screen
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (status, screen[-3000:])
    assert done.get("knob", 0) >= 3 and done.get("record", 0) >= 1, done
    runs = sorted((tmp_path / "runs").iterdir()) if (tmp_path / "runs").is_dir() else []
    for run in runs:  # every recording replays, figures and all
        r = subprocess.run([sys.executable, "-m", "kvdeck.console.cli", "replay", str(run),
                            "--summary", "--json"], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, (run, r.stderr)
        assert json.loads(r.stdout)["steps"]["count"] >= 0
    print(f"soak {DURATION_S:.0f} s: actions {done}, {len(runs)} recordings replayed")
