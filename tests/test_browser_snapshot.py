"""A saved notebook's memory snapshot (`lab.memory_snapshot()`) in JupyterLab, Debian's Chromium driven by Playwright
(issue 51 item 4): under JupyterLab Dark its PNG is no white block, and it fits the output area at a laptop's 1280 px.
Under JupyterLab Light the same snapshot reads light: the measure tells the themes apart. A headless run saves the
snapshot once, as its PNG (a live kernel shows it live instead). Screenshots go to .artifacts/browser/."""

import io
import json
from pathlib import Path

import nbformat
import pytest
from test_browser import ARTIFACTS, CHROMIUM, FLAGS, jupyter_server, open_notebook
from test_notebooks import run_notebook

pytestmark = [
    pytest.mark.slow,
    # why solo: a live kernel, JupyterLab and Chromium with deadlines: beside the ranks' group only
    pytest.mark.solo,
    pytest.mark.xdist_group("browser"),
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(), reason="Debian chromium not installed (scripts/install.sh installs it as root)"
    ),
]

CELLS = [
    'from grpo_lab import Lab\nlab = Lab("tiny-cpu", overrides=["memory.sample_hz=20"]).load()\nresult = lab.step()',
    "lab.memory_snapshot()\nlab.close()",
]
DARK, LIGHT = "JupyterLab Dark", "JupyterLab Light"
OUTPUT = ".jp-OutputArea-output"


def executed_notebook(root: Path) -> None:
    """notebooks/snapshot.ipynb under `root`: one step and its snapshot, run by papermill as a sweep runs it. Saved,
    not signed by this JupyterLab: it opens untrusted, as a notebook from GitHub or a colleague does."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    (root / "notebooks").mkdir(parents=True, exist_ok=True)
    (root / "source.ipynb").write_text(nbformat.writes(nb))
    run_notebook(root / "source.ipynb", root / "notebooks" / "snapshot.ipynb", root, {})


def start_in_dark(root: Path) -> None:
    """JupyterLab's theme setting, as Settings > Theme > JupyterLab Dark leaves it, before the page first loads; and
    no news toast (it would cover the bottom right of the output the test screenshots)."""
    settings = root / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True, exist_ok=True)
    (settings / "themes.jupyterlab-settings").write_text(json.dumps({"theme": DARK}))
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))


def switch_theme(page, name: str) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text="Settings").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Theme").first.hover()
    page.locator(".lm-Menu-itemLabel", has_text=name).first.click()
    page.wait_for_function(f"() => document.body.dataset.jpThemeLight === '{str(name == LIGHT).lower()}'")
    page.wait_for_timeout(1000)  # the theme's stylesheet applies (a variable swap, no event to wait on)


def mean_luminance(shot: bytes) -> float:
    """0 (black) to 1 (white): the mean of the screenshot's grey levels."""
    from PIL import Image, ImageStat

    return ImageStat.Stat(Image.open(io.BytesIO(shot)).convert("L")).mean[0] / 255


@pytest.fixture(scope="module")
def snapshot_page(tmp_path_factory, tiny_model):
    """The executed notebook open in JupyterLab, started in the dark theme; yields (page, the snapshot's <img>)."""
    from playwright.sync_api import sync_playwright

    root = tmp_path_factory.mktemp("snapshot")
    executed_notebook(root)
    start_in_dark(root)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with jupyter_server(root, notebooks=()) as (url, token, _), sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})  # a laptop, the file browser open
            open_notebook(page, f"{url}/lab/tree/notebooks/snapshot.ipynb?reset&token={token}")
            page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'", timeout=30_000)
            image = page.locator(f"{OUTPUT} img").first
            image.wait_for(state="visible", timeout=60_000)
            image.scroll_into_view_if_needed()
            page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=image.element_handle())
            yield page, image
        finally:
            browser.close()


def test_under_the_dark_theme_a_saved_snapshot_is_not_white_and_fits_its_output(snapshot_page):
    page, image = snapshot_page
    page.screenshot(path=str(ARTIFACTS / "snapshot_dark.png"))
    dark = mean_luminance(image.screenshot())
    width, area = image.evaluate(f"img => [img.getBoundingClientRect().width, img.closest('{OUTPUT}').clientWidth]")
    switch_theme(page, LIGHT)  # the control: the same image under the light theme is light
    page.screenshot(path=str(ARTIFACTS / "snapshot_light.png"))
    light = mean_luminance(image.screenshot())
    switch_theme(page, DARK)
    assert dark < 0.35, f"the snapshot is a light block under {DARK}: mean luminance {dark:.2f}"
    assert light > 0.6, f"under {LIGHT} the snapshot reads {light:.2f}: the measure cannot tell the themes apart"
    assert width <= area, f"the snapshot is {width:.0f} px wide in a {area:.0f} px output area"


def test_a_saved_snapshot_is_one_figure_its_png_not_a_png_and_a_live_copy(snapshot_page):
    """A headless run (papermill) saves each figure once (memory/static.show): the snapshot's output is its PNG,
    which JupyterLab shows as an image, and no plotly figure is kept beside it (plotly's renderer would draw one)."""
    page, image = snapshot_page
    assert page.locator(".jp-RenderedImage img").count() >= 1
    assert page.locator(".jp-RenderedPlotly").count() == 0, "the saved notebook keeps a plotly figure beside its PNG"
