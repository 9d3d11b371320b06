"""bench/README.md is the index of the benchmarks (issue 41): every script in bench/ has its line there, and every path,
anchor and `python -m` module it names exists. Beside it, every `bench/...py` path and `python -m bench....` command in
the docs, the tests, the scripts and bench/ itself names a file of this checkout (a moved script leaves them behind)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
INDEX = BENCH / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`]+)`")
MODULE = re.compile(r"-m\s+(bench(?:\.\w+)+)|[\"'](bench(?:\.\w+)+)[\"']")
BENCH_PATH = re.compile(r"(?<![\w/.])bench/[\w/]+\.py\b")


def _has_main_block(path: Path) -> bool:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return True
    return False


def scripts() -> list[Path]:
    """Every .py under bench/ but the packages' __init__.py and the shared helpers (a module at bench/'s top level
    with no `__main__` block, e.g. shapes.py)."""
    found = []
    for path in sorted(BENCH.rglob("*.py")):
        if path.name == "__init__.py" or (path.parent == BENCH and not _has_main_block(path)):
            continue
        found.append(path)
    return found


def _module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)  # a `#` in a fenced command is no heading
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.+)$", text, re.M)}


def test_there_are_scripts_and_sub_packages():
    found = scripts()
    assert len(found) >= 15, found
    for folder in {p.parent for p in found}:
        assert (folder / "__init__.py").is_file(), f"{folder.relative_to(ROOT)} is no package: python -m cannot run it"


def test_every_script_has_its_line_in_the_index():
    text = INDEX.read_text()
    listed = {(INDEX.parent / target.split("#")[0]).resolve() for target in LINK.findall(text)}
    missing = [str(p.relative_to(ROOT)) for p in scripts() if p.resolve() not in listed]
    assert not missing, f"not in bench/README.md: {missing}"
    for path in scripts():
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        assert f"python -m {module}" in text, f"bench/README.md gives no `python -m {module}` command"


def test_every_path_anchor_and_module_the_index_names_exists():
    text = INDEX.read_text()
    problems = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (INDEX.parent / path).resolve()
        if not file.exists():
            problems.append(f"{target}: no such path")
        elif anchor and anchor not in _anchors(file):
            problems.append(f"{target}: no such heading")
    for span in CODE.findall(text):
        for module in (m.group(1) for m in re.finditer(r"-m\s+(bench(?:\.\w+)+)", span)):
            if _module_file(module) is None:
                problems.append(f"`{span}`: no module {module}")
    assert not problems, problems


def _reference_files() -> list[Path]:
    """Where bench paths and commands are written: README, docs, tests, scripts, CI, bench/ itself and grpo_lab/ (its
    comments, help texts and presets name the benches their figures come from)."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "tests").glob("*.py"))]
    files += [p for p in sorted((ROOT / "scripts").glob("*")) if p.is_file()]
    files += [p for p in sorted((ROOT / ".ci").rglob("*")) if p.is_file()]
    files += [p for p in sorted(BENCH.rglob("*")) if p.suffix in (".py", ".md")]
    files += [p for p in sorted((ROOT / "grpo_lab").rglob("*")) if p.suffix in (".py", ".yaml")]
    return files


def stale_references(text: str) -> list[str]:
    """The `bench/...py` paths and bench modules (after `-m`, or quoted) in `text` that name no file here."""
    found = [m.group(0) for m in BENCH_PATH.finditer(text) if not (ROOT / m.group(0)).is_file()]
    for m in MODULE.finditer(text):
        module = m.group(1) or m.group(2)
        if _module_file(module) is None:
            found.append(module)
    return found


def test_every_bench_path_and_command_in_the_repository_exists():
    problems = []
    for path in _reference_files():
        if path == Path(__file__).resolve():
            continue  # its own examples below name moved paths on purpose
        for ref in stale_references(path.read_text(errors="replace")):
            problems.append(f"{path.relative_to(ROOT)}: {ref}")
    assert not problems, problems


@pytest.mark.parametrize(
    "text, stale",
    [
        (".venv/bin/python bench/head_heap.py --rounds 3", ["bench/head_heap.py"]),
        ("python -m bench.gpu_check --out $OUT", ["bench.gpu_check"]),
        ('[sys.executable, "-m", "bench.compare_trl", "--worker"]', ["bench.compare_trl"]),
        ("python -m bench.gpu.gpu_check --out $OUT; bench/plan_accuracy/head_heap.py", []),
        ("raw lines in bench/results/gpu_check_h100_2026-11-26_run2/gpu_check.jsonl", []),
    ],
)
def test_a_moved_script_is_caught(text, stale):
    assert stale_references(text) == stale
