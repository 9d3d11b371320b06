"""README.md and docs/*.md name only paths inside the repository (a clone holds everything they point to).

Checked: markdown links `[text](target)` that are not URLs or anchors, and inline code spans that look like
repository paths (a known file suffix, or a first segment that is a top-level entry of the repository). Each is
resolved from the repository root, from the doc's own folder and from the package folder (README and docs name
modules as `algo/grpo.py`). Fenced code blocks are not read: they hold commands and output, not references.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

SUFFIXES = (".py", ".md", ".ipynb", ".yaml", ".yml", ".toml", ".sh", ".json", ".jsonl", ".txt", ".csv", ".html", ".png")
# Paths on the user's machine, not in the repository: scratch and system files, the local wheels the CPU lock installs
# from (`/opt/wheels`, docs/install.md), the user cache, environment variables. Any other absolute path fails.
MACHINE_PREFIXES = ("/tmp/", "/dev/", "/proc/", "/opt/", "~/.cache/", "$")
# Placeholders for a directory the reader picks (`DIR/metrics.jsonl`, `OUT/...`) and the tests' git-ignored output.
PLACEHOLDER_DIRS = {"DIR", "OUT", "RUN_DIR", ".artifacts"}
# Bare file names that are no repository file: what a run, sweep, compare or plan writes into its output directory,
# what a model checkpoint holds, and torch's own source file that docs/fsdp2.md quotes.
NOT_REPO_FILES = {
    "config.yaml",
    "metrics.jsonl",
    "memory.csv",
    "report.html",
    "run.json",
    "summary.csv",
    "summary.html",
    "compare.html",
    "frontier.html",
    "config.json",
    "generation_config.json",
    "_fsdp_init.py",
}
FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*$", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?[^)]*\)")
CODE = re.compile(r"(`+)(.+?)\1", re.S)
URL_HOST = re.compile(r"^[\w-]+(\.[\w-]+)*\.(com|org|io|net|co|ai|dev)$")  # pytorch.org/memory_viz, github.com/...


def _without_fences(text: str) -> str:
    # blanked, not cut, so line numbers stay right
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _bases(doc: Path, token: str) -> list[Path]:
    """Where `token` may be relative to: the root, the doc's folder and, for a path that does not climb, the package."""
    return [ROOT, doc.parent] + ([] if ".." in token.split("/") else [ROOT / "grpo_lab"])


def _inside(path: Path) -> bool:
    return Path(os.path.normpath(path)).is_relative_to(ROOT)


def problem(token: str, doc: Path) -> str | None:
    """Why `token` (a link target or an inline code span of `doc`) is not a path inside the repository, or None."""
    if token.startswith(MACHINE_PREFIXES):
        return None
    if token.startswith(("/", "~")):
        return "an absolute path, outside the repository"
    bases = _bases(doc, token)
    candidates = [Path(os.path.normpath(base / token)) for base in bases]
    inside = [c for c in candidates if _inside(c)]
    if not inside:
        return "escapes the repository"
    first = token.split("/")[0]
    if first in PLACEHOLDER_DIRS:
        return None
    if re.search(r"[<>{}\[\]]", token):  # a template (`runs/<date-time>`, `step{N}-{phase}.pickle`): made at run time
        return None
    if "*" in token:  # a glob (`grpo_lab/config/presets/*.yaml`) must match something
        return None if any(any(base.glob(token)) for base in bases) else "matches no file"
    if any(c.exists() for c in inside):
        return None
    if "/" not in token and token in NOT_REPO_FILES:
        return None
    # `bench/vs_trl/step_vs_trl.trl_trainer`: an attribute of a module file
    module, _, attribute = token.rpartition(".")
    if module and attribute.isidentifier() and not token.endswith(SUFFIXES):
        if any((base / f"{module}.py").exists() for base in bases):
            return None
    return "does not exist"


def looks_like_path(token: str) -> bool:
    """An inline code span that names a repository path, not a command line, a URL, a metric or a Python name."""
    if re.search(r"\s", token) or "://" in token:  # commands with arguments, URLs
        return False
    if token.startswith(("../", "/", "~", "$")):
        return True
    first = token.split("/")[0]
    if "/" in token and URL_HOST.match(first):
        return False
    # A slash alone does not make a path (`reward/exact_answer` is a metric, `tensorboard/` a run's folder): it is one
    # when it ends in a file suffix or starts at a top-level entry of the repository (`docs/...`, `scripts/...`).
    top_level = {p.name for p in ROOT.iterdir()}
    return token.rstrip("/").endswith(SUFFIXES) or ("/" in token and first in top_level)


def references(markdown: str) -> list[tuple[int, str, bool]]:
    """(line, token, is_link) for every link target and path-like code span of a markdown text."""
    text = _without_fences(markdown)
    found = []
    for m in LINK.finditer(text):
        target = m.group(1).split("#")[0]
        if re.match(r"[a-zA-Z][\w+.-]*:", m.group(1)) or not target:  # http:, https:, mailto:, #anchor
            continue
        found.append((text.count("\n", 0, m.start()) + 1, target, True))
    for m in CODE.finditer(text):
        token = m.group(2).strip()
        if looks_like_path(token):
            found.append((text.count("\n", 0, m.start()) + 1, token, False))
    return found


def problems(doc: Path) -> list[str]:
    out = []
    for line, token, link in references(doc.read_text(encoding="utf-8")):
        why = problem(token, doc)
        if why:
            out.append(f"{doc.relative_to(ROOT)}:{line}: {'link' if link else 'code'} {token!r} {why}")
    return out


def test_docs_name_only_paths_inside_the_repository():
    found = [p for doc in DOCS for p in problems(doc)]
    assert not found, "paths outside the repository or missing:\n" + "\n".join(found)


def test_docs_are_found():
    names = {doc.name for doc in DOCS}
    assert {"README.md", "install.md", "problems.md"} <= names


@pytest.mark.parametrize(
    "text, bad",
    [
        ("described in `../shared/PROBLEMS.md`.", "../shared/PROBLEMS.md"),  # README before issue 34
        ("see [the list](../shared/PROBLEMS.md)", "../shared/PROBLEMS.md"),
        ("see `shared/PROBLEMS.md`", "shared/PROBLEMS.md"),
        ("the old `configs/tiny-cpu.yaml`", "configs/tiny-cpu.yaml"),
        ("run `scripts/nope.sh`", "scripts/nope.sh"),
        ("on `/work/shared/notes.md`", "/work/shared/notes.md"),
        ("`docs/missing/` folder", "docs/missing/"),
        ("`notebooks/*.nope` glob", "notebooks/*.nope"),
    ],
)
def test_a_path_outside_or_missing_is_caught(text, bad):
    assert [token for _, token, _ in references(text)] == [bad]
    assert problem(bad, ROOT / "README.md") is not None
    assert problem(bad, ROOT / "docs" / "install.md") is not None


@pytest.mark.parametrize(
    "text",
    [
        "`grpo_lab/algo/phases.py`, `algo/grpo.py`, `docs/install.md`, [install](docs/install.md)",
        "`DIR/metrics.jsonl`, `OUT/frontier.html`, `/tmp/run`, `~/.cache/grpo_lab`, `$GRPO_LAB_CACHE`",
        "`$XDG_CACHE_HOME/grpo_lab`, `/dev/shm/grpo-lab-lora-<pid>-*`, `/proc/cpuinfo`",
        "`grpo_lab/config/presets/*.yaml`, `step{N}-{phase}.pickle`, `runs/<date-time>`, `train/<metric>`",
        '`grpo_lab.config.schema.field_when("grpo.beta")`, `reward/exact_answer`, `is_ratio_min/mean/max`',
        "`grpo-lab run --resume DIR`, `scripts/demo.sh --steps 3 --out /tmp/run`, `tensorboard/`",
        "`report.html`, `config.json`, `bench/vs_trl/step_vs_trl.trl_trainer`, [memory_viz](https://pytorch.org/memory_viz)",
        "[top](#the-two-commands), `pytorch.org/memory_viz`, [mail](mailto:a@b.c)",
        "```bash\ncat ../shared/PROBLEMS.md\n```",
    ],
)
def test_what_is_not_a_repository_path_passes(text):
    doc = ROOT / "README.md"
    found = [(token, problem(token, doc)) for _, token, _ in references(text)]
    assert [f for f in found if f[1]] == []


def test_links_resolve_from_the_doc_folder():
    assert problem("img/compare_trl_peak_vs_length.png", ROOT / "docs" / "benchmarks.md") is None
    assert problem("../README.md", ROOT / "docs" / "install.md") is None
    assert problem("../README.md", ROOT / "README.md") == "escapes the repository"


def test_the_packages_docstrings_and_comments_name_only_files_that_exist():
    """Issue 41: docstrings named modules long moved ("sharded.py", "sharded.world", "planner/models/"). Every
    `name.py`/`.md`/`.ipynb` in grpo_lab's source (a path suffix, or a bare name) is a tracked file of the
    repository."""
    import subprocess

    if not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    paths = [p for p in tracked.splitlines() if (ROOT / p).exists()]
    names = {Path(p).name for p in paths}
    stale = []
    for source in sorted((ROOT / "grpo_lab").rglob("*.py")):
        for number, line in enumerate(source.read_text().splitlines(), 1):
            for ref in re.findall(r"([\w./-]+\.(?:py|md|ipynb))\b", line):
                if not (any(p.endswith(ref) for p in paths) if "/" in ref else ref in names):
                    stale.append(f"{source.relative_to(ROOT)}:{number}: {ref}")
    assert not stale, stale


ISSUE_NUMBER = re.compile(r"\bissues? #?\d+", re.IGNORECASE)


def test_nothing_in_the_package_or_the_docs_cites_an_issue_number():
    """Comments and docs say why, not which issue: a number means nothing to a reader of the code or the docs."""
    files = [*DOCS, *sorted((ROOT / "grpo_lab").rglob("*.py"))]
    found = [
        f"{path.relative_to(ROOT)}:{n}: {m.group(0)}"
        for path in files
        for n, line in enumerate(path.read_text().splitlines(), 1)
        for m in ISSUE_NUMBER.finditer(line)
    ]
    assert not found, found[:10]
    assert ISSUE_NUMBER.search("(issue 42: 1.500)") and ISSUE_NUMBER.search("Issues 3 and 4")
