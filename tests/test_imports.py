"""The house: grpo_lab's import graph (function-local imports included) has no circles, runs downward through the
layers docs/architecture.md draws (but for the few listed with their reason), keeps the Ray driver out of the
one-process path, and no module is over STYLE.md's ~400 lines. Read from the source (ast), so an import inside a
function counts as much as one at the top."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "grpo_lab"
MAX_LINES = 400  # STYLE.md: "files under ~400 lines"
MAX_TOP_LEVEL = 15  # modules directly in grpo_lab/: the rest live in a package named for its concern

DOC = ROOT.parent / "docs" / "architecture.md"
# the Ray side of a sharded learner: its driver's modules and the rank's entry point (Ray imports it in each actor)
RAY_SIDE = (
    *(
        f"grpo_lab.execution.sharded.{m}"
        for m in ("driver", "driven", "ranks", "ray_cluster", "remote", "wire", "interrupts")
    ),
    "grpo_lab.rank",
)
# floors that algo/ and the floors the algorithm stands on never import an executor from: they reach a sharded
# learner through the executor contract's Sharding
NO_EXECUTION = ("algo", "memory", "recovery", "generation", "checks")


def _table(text: str, heading: str) -> list[list[str]]:
    """The rows of the first markdown table under `heading` (its header and rule left out), each a list of cells."""
    assert heading in text, f"docs/architecture.md has no {heading!r}"
    block: list[list[str]] = []
    for line in text.split(heading, 1)[1].splitlines():
        if line.startswith("|"):
            block.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif block:
            break
    assert len(block) > 2, f"docs/architecture.md has no table under {heading!r}"
    return block[2:]


def _names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def floors_of(text: str) -> list[tuple[str, tuple[str, ...], set[str]]]:
    """docs/architecture.md's floors, bottom to top: (name, module prefixes, the floors it says it imports)."""
    out = []
    for name, modules, _, imports in reversed(_table(text, "## Floors")):
        prefixes = tuple("grpo_lab" if m == "grpo_lab" else f"grpo_lab.{m}" for m in _names(modules))
        out.append((name, prefixes, set(_names(imports))))
    return out


FLOORS = floors_of(DOC.read_text())


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
    return {
        m: {t for t in ts if not (mods[t].name == "__init__.py" and any(u.startswith(t + ".") for u in ts))}
        for m, ts in edges.items()
    }


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


def floor_of(module: str, floors=None) -> int:
    """The index (bottom = 0) of the floor `module` is on: the floor of its longest matching name."""
    best = max(
        (
            (len(prefix), i)
            for i, (_, prefixes, _) in enumerate(floors or FLOORS)
            for prefix in prefixes
            if module == prefix or module.startswith(prefix + ".")
        ),
        default=None,
    )
    assert best is not None, f"{module} is on no floor of docs/architecture.md; add its package to the table"
    return best[1]


def upward(edges: dict[str, set[str]], floors=None) -> set[tuple[str, str]]:
    """Every import from a lower floor to a higher one."""
    return {(m, t) for m, ts in edges.items() for t in ts if floor_of(m, floors) < floor_of(t, floors)}


def test_the_floors_are_read_from_docs_architecture():
    names = [name for name, _, _ in FLOORS]
    assert names[0] == "base" and names[-1] == "entry points" and len(names) == len(set(names)) >= 12, names
    assert "grpo_lab.runtime" in FLOORS[0][1] and FLOORS[0][2] == set()  # the bottom floor imports nothing


def test_every_module_is_on_a_floor():
    for module in modules():
        floor_of(module)


def test_the_floor_check_finds_a_planted_upward_import():
    assert upward({"grpo_lab.algo.losses": {"grpo_lab.lab"}, "grpo_lab.lab": {"grpo_lab.algo.losses"}}) == {
        ("grpo_lab.algo.losses", "grpo_lab.lab")
    }
    # the runtime is the bottom floor: the old home under execution/ would be an upward import from algo/
    assert upward({"grpo_lab.algo.grpo": {"grpo_lab.execution.runtime"}}) == {
        ("grpo_lab.algo.grpo", "grpo_lab.execution.runtime")
    }


def test_no_import_runs_upward():
    """What a lower floor needs from a higher one is handed down or named by import path (docs/architecture.md)."""
    found = upward(graph())
    assert not found, "imports up the floors: " + "; ".join(f"{a} -> {b}" for a, b in sorted(found))


def test_the_rank_entry_point_is_named_where_the_driver_starts_it():
    """The driver reaches the rank's actor by import path (no static import up); the path must name a real class."""
    import importlib

    from grpo_lab.execution.sharded.ranks import RANK_ENTRY

    module, _, name = RANK_ENTRY.partition(":")
    assert floor_of(module) > floor_of("grpo_lab.lab")
    assert isinstance(getattr(importlib.import_module(module), name), type)


def test_algo_and_the_floors_below_the_executors_never_import_one():
    """algo/ and generation/ reach a sharded learner through the executor contract's `Sharding` (Learner.sharding);
    memory, recovery and checks need only the runtime, which is on the bottom floor."""
    bad = sorted(
        (m, t)
        for m, ts in graph().items()
        if m.split(".")[1:2] and m.split(".")[1] in NO_EXECUTION
        for t in ts
        if t.startswith("grpo_lab.execution")
    )
    assert not bad, bad


def test_each_floor_imports_what_docs_architecture_says():
    """The table's imports column is the code's: a floor that imports another floor the row does not list (or no
    longer imports one it lists) fails, so the drawing stays true."""
    names = [name for name, _, _ in FLOORS]
    actual: dict[str, set[str]] = {name: set() for name in names}
    for m, ts in graph().items():
        for t in ts:
            a, b = floor_of(m), floor_of(t)
            if a > b:
                actual[names[a]].add(names[b])
    said = {name: imports for name, _, imports in FLOORS}
    wrong = {name: (sorted(actual[name] - said[name]), sorted(said[name] - actual[name])) for name in names}
    wrong = {name: diff for name, diff in wrong.items() if diff != ([], [])}
    assert not wrong, f"floor: (imported but not in its row, in its row but not imported): {wrong}"


def test_the_one_process_path_never_imports_the_ray_driver():
    """Only the Ray driver's own modules import it (the Lab names its executor by import path)."""
    bad = [(m, t) for m, ts in graph().items() if not m.startswith(RAY_SIDE) for t in ts if t.startswith(RAY_SIDE)]
    assert not bad, bad


def test_at_most_15_modules_sit_directly_in_the_package():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top


def test_no_module_or_package_shadows_the_standard_library_a_dependency_or_a_build_folder():
    import sys

    taken = set(sys.stdlib_module_names) | {
        "torch",
        "transformers",
        "trl",
        "peft",
        "vllm",
        "ray",
        "accelerate",
        "bitsandbytes",
        "pydantic",
        "plotly",
        "ipywidgets",
        "papermill",
        "yaml",
    }
    # a package too (a `dist/` package was once skipped by ruff and other tools as build output)
    build_folders = {"build", "dist", "out", "target", "bin", "lib", "env", "venv", "site-packages"}
    bad = [p.relative_to(ROOT) for p in ROOT.rglob("*.py") if p.stem in taken]
    bad += [d.relative_to(ROOT) for d in ROOT.rglob("*") if d.is_dir() and d.name in taken | build_folders]
    assert not bad, bad


def test_no_two_modules_share_a_name():
    """One name per thing: two modules with the same file name (outside __init__) would be two things of one name."""
    from collections import Counter

    names = Counter(p.stem for p in ROOT.rglob("*.py") if p.stem != "__init__")
    assert [n for n, k in names.items() if k > 1] == []


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_file_is_over_400_lines(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES


def _defined_names(body: list[ast.stmt]) -> set[str]:
    """What a module's statements define at its top level (functions, classes, assignments, imports), read from its
    source; a name bound on a branch (an `if` or a `try` around an import) counts."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try)):
            handlers = [s for h in getattr(node, "handlers", []) for s in h.body]
            names |= _defined_names([*node.body, *node.orelse, *handlers, *getattr(node, "finalbody", [])])
    return names


def _source_of(module: str):
    """The file of `module` (grpo_lab.* or bench.*) in this checkout, or None."""
    base = ROOT.parent.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def test_every_import_of_the_projects_own_code_in_tests_and_bench_resolves():
    """A moved module or a removed function leaves `from grpo_lab.x import y` lines in the tests' function bodies and
    in bench/ that nothing runs at collection: tests/test_sharded_rollout.py imported grpo_lab.cluster.rollout (moved to
    generation/sample_once.py) and two bench scripts bench.planner_accuracy.build_model (gone). Read statically."""
    broken = []
    for path in sorted([*(ROOT.parent / "tests").glob("*.py"), *(ROOT.parent / "bench").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
                continue
            if node.module.split(".")[0] not in ("grpo_lab", "bench"):
                continue
            source = _source_of(node.module)
            if source is None:
                broken.append(f"{path.name}:{node.lineno} {node.module}")
                continue
            defined = _defined_names(ast.parse(source.read_text()).body)
            for alias in node.names:
                if alias.name not in defined and _source_of(f"{node.module}.{alias.name}") is None:
                    broken.append(f"{path.name}:{node.lineno} {node.module}.{alias.name}")
    assert not broken, broken


MAX_FUNCTION_LINES = 60  # STYLE.md: "functions under ~60" lines


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`path:function lines` for each function or method in `path` over `limit` lines: from its `def` to its last line,
    docstring included, decorators not."""
    return [
        f"{path.relative_to(ROOT.parent) if path.is_relative_to(ROOT.parent) else path.name}:{node.name} {lines}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (lines := node.end_lineno - node.lineno + 1) > limit
    ]


def test_the_function_length_check_counts_from_def_to_the_last_line(tmp_path):
    src = tmp_path / "x.py"
    src.write_text(
        '@decorator\n@another\ndef f():\n    """Doc."""\n    return 1\n\n\nclass A:\n    def g(self):\n        pass\n'
    )
    assert long_functions(src, limit=2) == ["x.py:f 3"]  # the decorators' two lines are not counted
    assert long_functions(src, limit=1) == ["x.py:f 3", "x.py:g 2"]  # a method counts as a function


def test_no_function_is_over_60_lines():
    over = [line for path in sorted(ROOT.rglob("*.py")) for line in long_functions(path)]
    assert not over, f"over {MAX_FUNCTION_LINES} lines; split them: {over}"
