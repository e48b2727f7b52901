"""runtime/ never imports the UI: checked in a fresh interpreter after importing every module."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_runtime_never_imports_textual_or_console() -> None:
    code = (
        "import importlib, pkgutil, sys\nimport kvdeck.runtime as runtime\n"
        "for m in pkgutil.walk_packages(runtime.__path__, 'kvdeck.runtime.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] == 'textual' or n.startswith('kvdeck.console'))\n"
        "print(len(list(pkgutil.walk_packages(runtime.__path__))), bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_project_stands_alone() -> None:
    """Nothing in the repository reads or cites a file outside it: no path to a folder
    beside the checkout, no design document that only the authors have."""
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=REPO,
                             check=True).stdout.split()
    outside = ("../" + "shared", '"' + "shared" + '" / "traces"', "DESIGN" + ".md")
    offenders = []
    for name in tracked:
        path = REPO / name
        if path.suffix in (".svg", ".csv", ".jsonl") or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        offenders += [f"{name}: {needle}" for needle in outside if needle in text]
    assert not offenders, offenders
