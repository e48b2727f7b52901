"""The shape the house keeps (docs/CONTRIBUTING.md, "Layout"): a slim engine, runtime files
of at most 600 lines, functions of at most 80 lines unless their docstring says why
("Long because ..."). What still breaks a rule is listed here exactly, so the list only
shrinks: a new breach fails, and so does an entry that no longer breaks the rule."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
ENGINE_MAX_LINES = 450

# What still breaks a rule, to be split; empty now, and a new breach fails.
LONG_FILES: set[str] = set()
LONG_FUNCTIONS: set[str] = set()


def sources(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


def long_files() -> set[str]:
    return {str(p.relative_to(ROOT)) for p in sources("runtime")
            if len(p.read_text().splitlines()) > MAX_FILE_LINES}


def long_functions(paths: list[Path], root: Path = ROOT) -> set[str]:
    """`path:name` (relative to `root`) of every function over the limit whose docstring
    does not say why."""
    out = set()
    for p in paths:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and \
                    node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES and \
                    "Long because" not in (ast.get_docstring(node) or ""):
                out.add(f"{p.relative_to(root)}:{node.name}")
    return out


def test_the_engine_is_slim() -> None:
    lines = len((ROOT / "runtime/core/engine.py").read_text().splitlines())
    assert lines < ENGINE_MAX_LINES, f"core/engine.py has {lines} lines"


def test_runtime_files_stay_small() -> None:
    assert long_files() == LONG_FILES


def test_functions_stay_short_or_say_why() -> None:
    assert long_functions(sources("runtime", "console")) == LONG_FUNCTIONS


def test_the_checker_finds_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "a.py").write_text(f"def long():\n{body}\n")
    (tmp_path / "b.py").write_text(f'def long():\n    """Long because a test."""\n{body}\n')
    (tmp_path / "c.py").write_text("def short():\n    return 1\n")
    assert long_functions(sorted(tmp_path.glob("*.py")), tmp_path) == {"a.py:long"}


def test_requests_keep_no_instance_dict() -> None:
    """`Request` is slotted: with an instance dict, CPython 3.11 stops sharing dict keys at
    30 attributes and every attribute access of every request slows (an engine iteration
    at 1,024 running requests was 18 % slower with one field more)."""
    from kvdeck.runtime.core.checkpoint import RequestState
    from kvdeck.runtime.core.request import Request

    for cls, args in ((Request, ("r", [1, 2])), (RequestState, ("r", 0.0, 2, 4, None, 0))):
        assert not hasattr(cls(*args), "__dict__"), cls.__name__
