"""Every link in README.md and docs/*.md resolves, and the README stays a first screen (at most 250 lines).

A markdown link `[text](target)` whose target is not a URL (http, https, mailto) names a file relative to the doc's
folder that exists; a `#anchor`, alone or after a .md path, names a heading of that doc by GitHub's slug rule (lower
case, punctuation but hyphens and spaces dropped, spaces as hyphens; a repeated heading gets -1, -2, ...). Fenced
code blocks and inline code are not read: a `[x](y)` there is code, not a link. tests/test_docs_paths.py checks the
backticked paths; this file checks the links and the anchors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250

FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"(`+).+?\1", re.S)
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?[^)]*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
EXTERNAL = ("http://", "https://", "mailto:")


def _blank(match: re.Match) -> str:
    """The match as spaces and newlines, so positions and line numbers stay right."""
    return re.sub(r"[^\n]", " ", match.group(0))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens and spaces dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """The anchors of a doc's headings (a `#` line in a fenced block is no heading); repeats get -1, -2, ..."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub(_blank, markdown)):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(markdown: str) -> list[tuple[int, str]]:
    """(line, target) of every markdown link outside code."""
    text = INLINE_CODE.sub(_blank, FENCE.sub(_blank, markdown))
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in LINK.finditer(text)]


def link_problems(doc: Path, markdown: str) -> list[str]:
    """Why each non-URL link of `markdown` (the text of `doc`) does not resolve: a missing file or heading."""
    out = []
    for line, target in links(markdown):
        if target.startswith(EXTERNAL):
            continue
        path, _, anchor = target.partition("#")
        where = f"{doc.name}:{line}: {target}"
        if path:
            file = (doc.parent / path).resolve()
            if not file.exists():
                out.append(f"{where}: no such file")
                continue
            if not anchor:
                continue
            if file.suffix != ".md":
                out.append(f"{where}: an anchor into a file that is not markdown")
                continue
            target_text = file.read_text(encoding="utf-8")
        else:
            target_text = markdown
        if anchor not in anchors(target_text):
            out.append(f"{where}: no heading with anchor #{anchor}")
    return out


def test_every_link_and_anchor_resolves():
    found = [p for doc in DOCS for p in link_problems(doc, doc.read_text(encoding="utf-8"))]
    assert not found, "broken links:\n" + "\n".join(found)


def test_the_docs_have_links_to_check():
    assert len(DOCS) >= 10
    assert sum(len(links(doc.read_text(encoding="utf-8"))) for doc in DOCS) >= 30


def test_readme_is_at_most_250_lines():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into a docs/ page"


def test_readme_links_every_docs_page():
    """The README's map names every page of docs/."""
    linked = {(README.parent / target.partition("#")[0]).resolve() for _, target in links(README.read_text())}
    missing = [p.name for p in DOCS[1:] if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


@pytest.mark.parametrize(
    "heading, expected",
    [
        ("The two commands", "the-two-commands"),
        ("Trackers: `run.report_to`", "trackers-runreport_to"),
        (
            "P1 · The learner spills onto the generator's GPU (the DataParallel trap)",
            "p1--the-learner-spills-onto-the-generators-gpu-the-dataparallel-trap",
        ),
        (
            "The frontier at scale: an 8B shape at long completions on one GPU (issue 38)",
            "the-frontier-at-scale-an-8b-shape-at-long-completions-on-one-gpu-issue-38",
        ),
        ("2-4. Sharding, gradients", "2-4-sharding-gradients"),
    ],
)
def test_slug_follows_github(heading, expected):
    assert slug(heading) == expected


def test_repeated_headings_get_numbered_anchors_and_fenced_hashes_are_no_headings():
    text = "# Top\n## Notes\ntext\n## Notes\n```bash\n# not a heading\n```\n"
    assert anchors(text) == {"top", "notes", "notes-1"}


MADE_UP = """# A page

## Real section

See [the install page](install.md), [its profiles](install.md#profiles), [here](#real-section),
[the web](https://example.com/missing#nowhere) and [mail](mailto:a@b.c).
Broken: [gone](no_such_page.md), [bad anchor](install.md#no-such-heading), [bad local](#nothing-here),
[image](img/none.png).
Code is not read: `[x](not_a_link.md)` and

```markdown
[y](also_not_a_link.md)
```
"""


def test_the_checker_catches_a_broken_link_and_a_broken_anchor():
    doc = ROOT / "docs" / "made_up.md"  # never written: its text is MADE_UP
    found = link_problems(doc, MADE_UP)
    assert found == [
        "made_up.md:7: no_such_page.md: no such file",
        "made_up.md:7: install.md#no-such-heading: no heading with anchor #no-such-heading",
        "made_up.md:7: #nothing-here: no heading with anchor #nothing-here",
        "made_up.md:8: img/none.png: no such file",
    ], found


def test_the_checker_passes_good_links():
    doc = ROOT / "docs" / "made_up.md"
    good = "# T\n## S\n[a](install.md#profiles) [b](../README.md#the-two-commands) [c](#s) [d](https://x.y/z#q)\n"
    assert link_problems(doc, good) == []
