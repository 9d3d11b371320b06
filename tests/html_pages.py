"""A static HTML page (a report, a compare page) opened in Debian's Chromium through Playwright, screenshot
kept under .artifacts/<folder>/ (override with GRPO_LAB_ARTIFACTS); importable as `html_pages` (tests/ on the path)."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("GRPO_LAB_ARTIFACTS", Path(__file__).resolve().parents[1] / ".artifacts"))
needs_chromium = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason="Debian chromium not installed (scripts/install.sh installs it as root)"
)


@contextmanager
def opened(path: Path, screenshot: str, height: int = 1000):
    """The page of `path` once plotly has drawn, after a full-page screenshot to .artifacts/`screenshot`."""
    from playwright.sync_api import sync_playwright

    shot = ARTIFACTS / screenshot
    shot.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1300, "height": height})
            page.goto(Path(path).as_uri())
            page.wait_for_selector(".main-svg")
            page.screenshot(path=str(shot), full_page=True)
            yield page
        finally:
            browser.close()
