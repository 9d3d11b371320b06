"""The house: grpo_lab's import graph (function-local imports included) has no circles, the lower layers never
import the Lab or an executor, and no module is much over STYLE.md's ~400 lines. Read from the source (ast), so an
import inside a function counts as much as one at the top."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "grpo_lab"
LOWER = ("grpo_lab.memory", "grpo_lab.planner", "grpo_lab.generation", "grpo_lab.config.schema")
UPPER = ("grpo_lab.lab", "grpo_lab.local.executor", "grpo_lab.cluster.executor", "grpo_lab.cluster.ranks")
MAX_LINES = 420   # STYLE.md: "files under ~400 lines"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def resolve(name: str, known: set[str]) -> str | None:
    """The grpo_lab module an import names (a package's name when it imports the package itself)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            stem = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            names = [f"{stem}.{alias.name}" for alias in node.names] + [stem]
        else:
            continue
        for name in names:
            target = resolve(name, known) if name and name.startswith("grpo_lab") else None
            if target and target != module and not (target == package and name == package and len(names) > 1):
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    edges = {m: imports_of(m, p, known) for m, p in mods.items()}
    # a package's __init__ imported for a submodule is not an edge to everything the package re-exports
    return {m: {t for t in ts if not (mods[t].name == "__init__.py" and any(u.startswith(t + ".") for u in ts))}
            for m, ts in edges.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), as a sorted list."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_planted_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_function_local_imports_count(tmp_path):
    src = tmp_path / "grpo_lab"
    src.mkdir()
    (src / "x.py").write_text("def f():\n    from .y import g\n")
    assert imports_of("grpo_lab.x", src / "x.py", {"grpo_lab.x", "grpo_lab.y"}) == {"grpo_lab.y"}


def test_no_import_circles():
    found = cycles(graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_lower_layers_never_import_the_lab_or_an_executor():
    bad = [(m, t) for m, ts in graph().items() if m.startswith(LOWER) for t in ts if t.startswith(UPPER)]
    assert not bad, bad


def test_the_lab_does_not_import_the_sharded_executor():
    assert not {t for t in graph()["grpo_lab.lab"] if t.startswith("grpo_lab.cluster")}


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_file_is_far_over_400_lines(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES
