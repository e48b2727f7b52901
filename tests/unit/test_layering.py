"""The import graph of runtime/: no cycles, and the layers import downward only.

Imports are read from the source (every `import` and `from … import`, at module level or
inside a function: a deferred import still ties two modules together); imports under
`if TYPE_CHECKING:` are annotations only and are left out. The rules (CONTRIBUTING.md,
"Layout"): runtime/ never imports the console; the engine core (`core/`) and the KV cache
(`kv/`) never import `views/`, `runs/`, `planning/` or `server/`; the engine's statistics
(`stats/`) import nothing but the core; executors never import `views/`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

FORBIDDEN = {
    "core": ("views", "runs", "planning", "server"),
    "kv": ("views", "runs", "planning", "server"),
    "stats": ("views", "runs", "planning", "server", "executors", "kv"),
    "executors": ("views",),
}
"""Subpackage of runtime/ → subpackages it must not import."""

def module_name(path: Path, repo: Path) -> str:
    parts = list(path.relative_to(repo).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "kvdeck." + ".".join(parts)


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = module.split(".")[: len(module.split(".")) - node.level + is_package]
            base = ".".join(parts + ([base] if base else []))
        return [base] + [f"{base}.{a.name}" for a in node.names]
    return []


def imports_of(path: Path, module: str) -> set[str]:
    """Every module name `path` (the module `module`) imports, outside `if TYPE_CHECKING:`
    blocks."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        out.update(_imported(node, module, is_package))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return out


def import_graph(repo: Path) -> dict[str, set[str]]:
    """Module of `repo`/runtime → the modules of the same tree it imports (a name that is an
    attribute of a module, `from m import f`, resolves to `m`)."""
    files = {module_name(p, repo): p for p in (repo / "runtime").rglob("*.py")}
    return {m: {n for n in imports_of(p, m) if n in files and n != m}
            for m, p in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def broken_rules(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    bad = set()
    for module, targets in graph.items():
        layer = module.split(".")[2] if module.count(".") >= 2 else ""
        for target in targets:
            if target.split(".")[2:3] and target.split(".")[2] in FORBIDDEN.get(layer, ()):
                bad.add((module, target))
    return bad


def test_runtime_has_no_import_cycle() -> None:
    assert cycles(import_graph(REPO)) == []


def test_the_cycle_finder_finds_a_deliberate_cycle(tmp_path: Path) -> None:
    """The check above can fail: a tree with a -> b -> c -> a (one import deferred into a
    function, one relative) and a TYPE_CHECKING-only edge d -> a is reported as one cycle."""
    pkg = tmp_path / "runtime" / "demo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from kvdeck.runtime.demo.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n    return c\n")
    (pkg / "c.py").write_text("import kvdeck.runtime.demo.a\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from kvdeck.runtime.demo import a\n")
    found = cycles(import_graph(tmp_path))
    assert found == [["kvdeck.runtime.demo.a", "kvdeck.runtime.demo.b",
                      "kvdeck.runtime.demo.c"]]


def test_layers_import_downward_only() -> None:
    bad = broken_rules(import_graph(REPO))
    assert bad == set(), "imports against the layering rules"


def test_the_rule_check_flags_a_core_module_importing_a_view() -> None:
    graph = {"kvdeck.runtime.core.x": {"kvdeck.runtime.views.y", "kvdeck.runtime.kv.z"},
             "kvdeck.runtime.executors.e": {"kvdeck.runtime.views.y"},
             "kvdeck.runtime.views.y": {"kvdeck.runtime.core.x"}}
    assert broken_rules(graph) == {("kvdeck.runtime.core.x", "kvdeck.runtime.views.y"),
                                   ("kvdeck.runtime.executors.e", "kvdeck.runtime.views.y")}


def test_runtime_never_imports_textual_or_console() -> None:
    """Checked in a fresh interpreter after importing every module of runtime/."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import kvdeck.runtime as runtime\n"
        "for m in pkgutil.walk_packages(runtime.__path__, 'kvdeck.runtime.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = sorted(n for n in sys.modules\n"
        "             if n.split('.')[0] == 'textual' or n.startswith('kvdeck.console'))\n"
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
