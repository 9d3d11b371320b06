"""The notebook as users run it: JupyterLab on localhost, Debian's Chromium driven by Playwright,
01_quickstart run cell by cell from the Run menu. Asserts no cell errored and that the plotly
memory plot and the config editor are on the page; saves a screenshot to .artifacts/browser/."""

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("GRPO_LAB_ARTIFACTS", ROOT / ".artifacts")) / "browser"
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]

pytestmark = [
    pytest.mark.slow,
    # why solo: a live kernel, JupyterLab and Chromium with deadlines and timing checks: beside the ranks' group only
    pytest.mark.solo,
    pytest.mark.xdist_group("browser"),
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(), reason="Debian chromium not installed (scripts/install.sh installs it as root)"
    ),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def jupyter_server(tmp_path: Path, notebooks=("01_quickstart.ipynb",)):
    """A JupyterLab server on 127.0.0.1 rooted in `tmp_path`, holding only `notebooks` (copied into notebooks/):
    presets come by name and the built-in tiny model from GRPO_LAB_CACHE (set by conftest), as for a user outside
    the repo. Yields (url, token, root)."""
    (tmp_path / "notebooks").mkdir(exist_ok=True)
    # why: JupyterLab 4 virtualises cells scrolled out of view (windowing), so a widget below the fold is not in the
    # page and a wait for it times out; with windowing off every cell's output is in the DOM while the test waits
    tracker = tmp_path / "settings" / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True, exist_ok=True)
    tracker.write_text(json.dumps({"windowingMode": "none"}))
    # no news toast: it covered the bottom right of the output in every screenshot (the editor's fields under it)
    news = tmp_path / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True, exist_ok=True)
    news.write_text(json.dumps({"fetchNews": "false"}))
    for name in notebooks:
        shutil.copy(ROOT / "notebooks" / name, tmp_path / "notebooks")
    port, token = free_port(), secrets.token_hex(16)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            f"--port={port}",
            "--ServerApp.ip=127.0.0.1",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={tmp_path}",
            "--allow-root",
            # why: a workspace saved by an earlier session could reopen missing files behind modal dialogs
            f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
            f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "jupyter.log", "w"),
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            break
        except OSError:
            time.sleep(0.5)
    else:
        server.kill()
        pytest.fail("JupyterLab did not start: " + (tmp_path / "jupyter.log").read_text()[-2000:])
    try:
        yield url, token, tmp_path
    finally:
        server.terminate()
        server.wait(timeout=20)


@pytest.fixture
def jupyter(tmp_path, tiny_model):
    with jupyter_server(tmp_path) as server:
        yield server


def run_all(page, url: str) -> None:
    """Open the notebook at `url` (taking the preselected kernel if JupyterLab asks), then Run All Cells."""
    open_notebook(page, url)
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()


def open_notebook(page, url: str) -> None:
    """Open the notebook at `url`, taking the preselected kernel if JupyterLab asks, until its kernel is idle."""
    from playwright.sync_api import TimeoutError as NoDialog

    page.goto(url)
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=120_000)
    try:  # a first-time JupyterLab asks which kernel to start: take the preselected Python 3, as a user would
        page.wait_for_selector(".jp-Dialog", timeout=10_000)
        if "Select Kernel" in page.locator(".jp-Dialog").first.inner_text():
            page.locator(".jp-Dialog .jp-mod-accept").first.click()
    except NoDialog:
        pass
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)


def test_quickstart_runs_in_a_real_browser(jupyter):
    from playwright.sync_api import sync_playwright

    url, token, root = jupyter
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        run_all(page, f"{url}/lab/tree/notebooks/01_quickstart.ipynb?reset&token={token}")
        deadline = time.time() + 600
        while time.time() < deadline:  # nothing queued or running, something ran, kernel idle
            if page.locator(".jp-Dialog").count():  # an unexpected dialog would block the run: record it
                page.screenshot(path=str(ARTIFACTS / "dialog.png"))
                pytest.fail("JupyterLab showed a dialog: " + page.locator(".jp-Dialog").first.inner_text()[:300])
            prompts = [t.strip() for t in page.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()]
            idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").count() > 0
            if idle and prompts and all(t[1:-2].isdigit() for t in prompts):  # every cell ran (windowing is off)
                break
            time.sleep(1)  # the pace of the polls; what ends the wait is the notebook's state above
        else:
            page.screenshot(path=str(ARTIFACTS / "01_quickstart-unfinished.png"), full_page=True)
            errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
            stderr = errors.all_inner_texts()[-3:]
            pytest.fail(f"the notebook did not finish in 600 s: prompts {prompts}; stderr {stderr}")
        page.wait_for_selector(".js-plotly-plot", timeout=60_000)
        page.wait_for_selector(".grpo-lab-editor", timeout=60_000)
        page.locator(".grpo-lab-editor").first.scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "01_quickstart.png"), full_page=True)
        plots = page.locator(".js-plotly-plot").count()
        editors = page.locator(".grpo-lab-editor").count()
        page.keyboard.press("Control+s")
        # the save is done when the notebook's tab is no longer marked dirty (not after a fixed wait)
        page.wait_for_function(
            "() => document.querySelector('.lm-TabBar-tab.jp-mod-current') &&"
            " !document.querySelector('.lm-TabBar-tab.jp-mod-current.jp-mod-dirty')",
            timeout=60_000,
        )
        browser.close()
    notebook = json.loads((root / "notebooks" / "01_quickstart.ipynb").read_text())
    code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] for c in code), "not every cell ran"
    errors = [o for c in code for o in c["outputs"] if o["output_type"] == "error"]
    assert not errors, errors[0].get("evalue") if errors else ""
    assert plots >= 1 and editors >= 1
