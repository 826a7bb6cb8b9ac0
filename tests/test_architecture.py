"""The architecture, checked: dependencies point one way, no import cycles, `import libra` changes
nothing about importing, and the folders say where each decision is made."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "libra"
POLICIES = ("core", "costmodel", "rollout", "planner", "actions")
MECHANISMS = ("sim", "runtime")


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """Every libra module `path` imports, at module level or inside a function."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in out if m in MODULES}


GRAPH = {m: _imports(p) for m, p in MODULES.items()}


def _layer(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def _edges():
    for m, deps in sorted(GRAPH.items()):
        for d in sorted(deps):
            yield m, d


def test_policies_import_no_mechanism_and_no_cli():
    bad = [(m, d) for m, d in _edges() if _layer(m) in POLICIES and _layer(d) in (*MECHANISMS, "cli")]
    assert not bad, bad


def test_only_the_cli_imports_the_cli():
    bad = [(m, d) for m, d in _edges() if _layer(d) == "cli" and _layer(m) != "cli" and m != "libra.__main__"]
    assert not bad, bad


def test_sim_and_runtime_are_imported_only_by_themselves_and_the_cli():
    bad = [
        (m, d)
        for m, d in _edges()
        if _layer(d) in MECHANISMS and _layer(m) not in (_layer(d), "cli") and m != "libra.__main__"
    ]
    assert not bad, bad


def test_core_imports_only_core():
    bad = [(m, d) for m, d in _edges() if _layer(m) == "core" and _layer(d) not in ("core", "")]
    assert not bad, bad


def test_no_import_cycles():
    """Tarjan's strongly connected components over every import, lazy ones included."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                comp.append(w)
            on_stack.discard(v)
            if comp:
                cycles.append([v, *comp])

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(GRAPH)))
    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_import_libra_leaves_the_import_system_alone():
    code = "import sys; before = list(sys.meta_path); import libra, libra.cli; print(sys.meta_path == before)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr


def test_heavy_dependencies_stay_out_of_the_light_packages():
    """torch, aiohttp and ray are imported only inside runtime (and the CLI that starts it)."""
    heavy = ("torch", "aiohttp", "ray", "fastapi")
    bad = []
    for m, path in MODULES.items():
        if _layer(m) in (*POLICIES, "sim"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                bad += [(m, n) for n in names if n.split(".")[0] in heavy]
    assert not bad, bad


@pytest.mark.parametrize(
    "decision, module",
    [
        ("route a turn", "libra.rollout.registry"),
        ("re-plan", "libra.planner.controller"),
        ("borrow or release hybrid replicas", "libra.planner.elastic"),
        ("admit an action", "libra.actions.scheduler"),
        ("bound staleness", "libra.planner.staleness"),
    ],
)
def test_each_decision_lives_in_a_policy_package(decision, module):
    assert module in MODULES and _layer(module) in POLICIES, decision


def _folder_map() -> set[str]:
    """The folders docs/architecture.md's map names, as paths under src/libra ("runtime/train")."""
    doc = (SRC.parent / "docs" / "architecture.md").read_text()
    block = doc.split("```\nsrc/libra/\n", 1)[1].split("```", 1)[0]
    out, stack = set(), []  # stack: (indent, name) of the folders above the current line
    for line in block.splitlines():
        name = line.strip().split(" ", 1)[0]
        if not name.endswith("/"):
            continue  # a continuation of a description
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, name.rstrip("/")))
        out.add("/".join(n for _, n in stack))
    return out


def test_the_folder_map_names_every_package_and_nothing_else():
    """Every folder of src/libra holding code or shipped data is in docs/architecture.md's map,
    and the map names no folder that is gone."""
    folders = {
        str(d.relative_to(PACKAGE))
        for d in PACKAGE.rglob("*")
        if d.is_dir() and d.name != "__pycache__" and any(f.is_file() for f in d.iterdir())
    }
    mapped = _folder_map()
    assert folders - mapped == set(), "folders missing from docs/architecture.md's map"
    assert mapped - folders == set(), "folders in docs/architecture.md's map that do not exist"
