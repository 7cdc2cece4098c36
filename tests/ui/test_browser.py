"""The Designer in a real browser: headless JupyterLab + chromium (Playwright).

Opens a temp copy of notebooks/07_designer.ipynb (which opening must not mark modified),
runs all cells from the Run menu, and checks what only a browser can show: the DAG SVG and
the plotly timeline render, typing a new microbatch count into the schedule row redraws
the timeline, clicking a DAG node shows its details (the anywidget front end posts the id
back), a search in the Search tab draws its frontier and a click on a point loads that
candidate into the directive rows, and a screenshot of the Designer is saved as
artifacts/screenshots/designer.png
(git-ignored: a test never rewrites a tracked file). `make screenshots` runs this test and
copies that screenshot over the committed docs/_static/designer.png, which the
documentation site shows.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from piper_nb.host import free_port

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "07_designer.ipynb"
# the fresh screenshot of the Designer, in an ignored folder; `make screenshots` copies it to
# docs/_static/designer.png, the committed copy the docs site shows (docs/_ext/pn_notebooks.py)
SCREENSHOT = ROOT / "artifacts" / "screenshots" / "designer.png"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]

pytestmark = [pytest.mark.browser, pytest.mark.full, pytest.mark.timeout(420)]


def _api(base: str, token: str, path: str, method: str = "GET"):
    req = urllib.request.Request(f"{base}{path}?token={token}", method=method)
    with urllib.request.urlopen(req, timeout=5) as r:
        body = r.read()
    return json.loads(body) if body else None


def _wait_for_server(base: str, token: str, proc, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with code {proc.returncode}")
        try:
            _api(base, token, "/api/status")
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"jupyter lab did not answer on {base} within {timeout} s")


@pytest.fixture
def lab(tmp_path):
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium); the browser test needs it")
    pytest.importorskip("playwright.sync_api", reason="playwright (python) is not installed")
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
    port, token = free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTER_CONFIG_DIR=str(tmp_path / "config"), IPYTHONDIR=str(tmp_path / "ipython"),
               JUPYTER_PLATFORM_DIRS="1")
    log = open(tmp_path / "jupyter.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip", "127.0.0.1",
         "--port", str(port), f"--ServerApp.token={token}", "--allow-root",
         f"--ServerApp.root_dir={root}", "--LabApp.news_url=", "--ServerApp.port_retries=0",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_for_server(base, token, proc)
        yield base, token
    finally:
        try:
            for k in _api(base, token, "/api/kernels") or []:
                _api(base, token, f"/api/kernels/{k['id']}", method="DELETE")
        except OSError:
            pass
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        log.close()


def _bar_count(page) -> int:
    return page.locator(".js-plotly-plot:visible g.trace.bars g.point").count()


def _accept_dialogs(page) -> None:
    """Answer JupyterLab's "Select Kernel" (or any) dialog with its default button."""
    dialog = page.locator(".jp-Dialog .jp-mod-accept")
    if dialog.count():
        dialog.first.click()


def _wait_kernel_idle(page, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    status = page.locator(".jp-StatusBar-Widget", has_text="Idle")
    while time.monotonic() < deadline:
        _accept_dialogs(page)
        if status.count() and page.locator(
                ".jp-Notebook-ExecutionIndicator[data-status='idle']").count():
            return
        page.wait_for_timeout(250)
    raise TimeoutError("the notebook's kernel did not become idle")


def _wait_rendered(page, selector: str, timeout: float = 120) -> None:
    """Wait for `selector`; fail at once with the cell's error if the notebook raised."""
    deadline = time.monotonic() + timeout
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    while time.monotonic() < deadline:
        if page.locator(selector).count():
            return
        if errors.count():
            raise AssertionError("the notebook raised:\n" + errors.first.inner_text()[-2000:])
        page.wait_for_timeout(250)
    raise TimeoutError(f"{selector} did not render within {timeout} s")


# rows whose widgets must stay on one line, and plots whose legend and title must show whole
_ROWS = "'.pn-row-line, .pn-layer, .pn-add > div, .pn-dag-bar, .pn-dag-bar > button'"
_WRAPPED_ROWS = "() => [...document.querySelectorAll(" + _ROWS + """)]
  .filter(line => line.offsetParent !== null && line.children.length > 1)
  .filter(line => {   // wrapped: one child lies wholly below another
    const boxes = [...line.children].filter(c => c.offsetParent !== null)
      .map(c => c.getBoundingClientRect()).filter(r => r.height > 0);
    return Math.max(...boxes.map(r => r.top)) >= Math.min(...boxes.map(r => r.bottom)) - 1;
  }).map(line => line.innerText.replace(/\\s+/g, ' ').slice(0, 80))"""
_CUT_ROWS = "() => [...document.querySelectorAll(" + _ROWS + """)]
  .filter(line => line.offsetParent !== null && line.scrollWidth > line.clientWidth + 1)
  .map(line => line.innerText.replace(/\\s+/g, ' ').slice(0, 80))"""
_CLIPPED = """() => [...document.querySelectorAll('.pn-designer .js-plotly-plot')]
  .filter(p => p.offsetParent !== null)
  .flatMap(p => {
    const box = p.querySelector('.main-svg').getBoundingClientRect();
    const shown = p.closest('.pn-designer').getBoundingClientRect();
    return [...p.querySelectorAll('.legend, .gtitle, .g-gtitle text, .annotation-text')]
      .filter(e => {
        const r = e.getBoundingClientRect();
        return r.width > 0 && (r.left < box.left - 1 || r.right > box.right + 1 ||
                               r.right > shown.right + 1 || r.top < box.top - 1);
      }).map(e => e.textContent.slice(0, 80));
  })"""
_NARROW = """() => [...document.querySelectorAll('.pn-designer .js-plotly-plot')]
  .filter(p => p.offsetParent !== null && p.querySelector('.main-svg'))
  .filter(p => {   // a figure narrower than the panel it sits in
    const drawn = p.querySelector('.main-svg').getBoundingClientRect().width;
    return drawn < 0.95 * p.parentElement.clientWidth;
  }).map(p => (p.querySelector('.gtitle') || {textContent: 'a figure'}).textContent
              .slice(0, 60) + ` (${Math.round(p.querySelector('.main-svg')
              .getBoundingClientRect().width)} of ${p.parentElement.clientWidth} px)`)"""
_SCROLLED = """() => [...document.querySelectorAll('.pn-designer .js-plotly-plot')]
  .filter(p => p.offsetParent !== null)   // a legend with a scrollbar hides entries
  .filter(p => [...p.querySelectorAll('.legend .scrollbar')]
                .some(b => b.getBoundingClientRect().height > 0))
  .map(p => (p.querySelector('.gtitle') || {textContent: 'a figure'}).textContent
            .slice(0, 60))"""
SIZES = ((1280, 800), (1920, 1080))
DOCS_SIZE = SIZES[0]
SHOTS = ROOT / "artifacts" / "screenshots"


def _check_layout_at_both_sizes(page) -> None:
    """At 1280 x 800 and 1920 x 1080, every tab of the editors and of the views: no row
    wraps or runs past its panel, no legend or title runs out of its plot, no legend
    scrolls, every figure fills its panel's width (bounding boxes, not pixels); a
    screenshot of each into the ignored artifacts folder."""
    (SHOTS / "tabs").mkdir(parents=True, exist_ok=True)
    problems = []
    for (width, height), arrangement in itertools.product(SIZES, ("side by side",
                                                                   "views below")):
        page.set_viewport_size({"width": width, "height": height})
        page.locator(".pn-arrangement button", has_text=arrangement).first.click()
        page.wait_for_timeout(500)
        for tab in ("Layers", "Directives", "JSON", "Python", "Search", "DAG", "Timeline",
                    "Memory", "Plan", "Problems", "Run"):
            tabs = page.locator(".pn-designer .widget-tab .lm-TabBar-tab", has_text=tab)
            if not tabs.count():
                continue
            tabs.first.click()
            page.wait_for_timeout(700)
            for what, found in (("wraps", page.evaluate(_WRAPPED_ROWS)),
                                ("runs past its panel", page.evaluate(_CUT_ROWS)),
                                ("is clipped", page.evaluate(_CLIPPED)),
                                ("does not fill its panel", page.evaluate(_NARROW)),
                                ("has a legend that scrolls", page.evaluate(_SCROLLED))):
                problems += [f"{width}x{height} {arrangement} {tab}: {text!r} {what}"
                             for text in found]
            tabs.first.evaluate("t => t.scrollIntoView({block: 'start'})")   # from the tab down
            page.screenshot(path=str(SHOTS / f"designer-{width}x{height}-"
                                          f"{arrangement.split()[0]}-{tab.lower()}.png"))
            if (width, height) == DOCS_SIZE and arrangement == "views below":   # for the guide
                panel = tabs.first.locator(   # the tab widget itself, not its bar
                    "xpath=ancestor::div[contains(concat(' ', normalize-space(@class), ' '),"
                    " ' widget-tab ')][1]")
                panel.screenshot(path=str(SHOTS / "tabs" / f"{tab.lower()}.png"))
    assert not problems, "\n".join(problems)


_LABEL_PX = """() => {  // the rendered size of the DAG's node labels, in CSS px
  const svg = document.querySelector('.pn-dag svg');
  const text = svg.querySelector('g.node text');
  return parseFloat(text.getAttribute('font-size')) *
         svg.getBoundingClientRect().width / svg.viewBox.baseVal.width;
}"""
_CANVAS = """() => {
  const c = document.querySelector('.pn-dag-canvas');
  const d = document.querySelector('.pn-details-panel');
  return {left: c.scrollLeft, top: c.scrollTop, width: c.getBoundingClientRect().width,
          svg: c.querySelector('svg').getBoundingClientRect().width,
          scale: document.querySelector('.pn-dag-scale').textContent,
          details: d.offsetParent !== null};
}"""


def _check_dag_gestures(page) -> None:
    """The DAG opens at legible labels with the details panel closed; ctrl + wheel zooms
    about the pointer, a drag pans, *readable* goes back; the *details* toggle opens the
    panel and narrows the picture."""
    opened = page.evaluate(_CANVAS)
    assert page.evaluate(_LABEL_PX) >= 11, "the DAG opens with labels under 11 px"
    assert "(readable)" in opened["scale"] and not opened["details"]
    canvas = page.locator(".pn-dag-canvas").first
    canvas.scroll_into_view_if_needed()
    box = canvas.bounding_box()
    box["height"] = min(box["height"], page.viewport_size["height"] - box["y"] - 10)
    under = page.evaluate("([x, y]) => document.elementFromPoint(x, y).closest('.pn-dag-canvas')"
                          " !== null", [box["x"] + box["width"] / 2, box["y"] + box["height"] / 2])
    assert under, (box, "the DAG canvas is not under the pointer")
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.keyboard.down("Control")
    page.mouse.wheel(0, -100)
    page.mouse.wheel(0, -100)
    page.keyboard.up("Control")
    page.wait_for_timeout(300)
    zoomed = page.evaluate(_CANVAS)
    assert zoomed["svg"] > opened["svg"] * 1.4 and "(readable)" not in zoomed["scale"], zoomed
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] / 2 - 200, box["y"] + box["height"] / 2 - 50,
                    steps=8)
    page.mouse.up()
    panned = page.evaluate(_CANVAS)
    assert panned["left"] > zoomed["left"] + 150, (zoomed, panned)
    assert not panned["details"], "a drag was taken for a click on a node"
    page.locator(".pn-dag-zoom", has_text="readable").first.click()
    page.wait_for_timeout(300)
    assert page.evaluate(_CANVAS)["svg"] == opened["svg"]
    page.locator(".pn-dag-details-toggle").first.click()
    page.wait_for_timeout(500)
    shown = page.evaluate(_CANVAS)
    assert shown["details"] and shown["width"] < opened["width"] * 0.8, shown
    page.locator(".pn-dag-details-toggle").first.click()
    page.wait_for_timeout(500)
    assert not page.evaluate(_CANVAS)["details"]


_PROGRAM = """() => [document.querySelector('.pn-python textarea').value,
  [...document.querySelectorAll('.pn-designer .pn-row')].map(r =>
    r.textContent + [...r.querySelectorAll('input')].map(i => i.value).join(',')).join('|')]"""


def _search_and_load(page) -> None:
    """The Search tab: search 4 H100s (two schedules pinned, to keep it short), wait for
    the frontier, click its points from the last until one loads: the directive rows and
    the Python tab then show that candidate's program."""
    page.locator(".pn-designer .widget-tab .lm-TabBar-tab", has_text="Search").first.click()
    search = page.locator(".pn-search").first
    search.locator("input[placeholder^='tp=2']").first.fill("schedule=none,1f1b")
    page.wait_for_timeout(500)
    search.locator("button", has_text="Search").first.click()
    dots = search.locator(".js-plotly-plot .scatterlayer .trace .points path.point")
    deadline = time.monotonic() + 180
    while not dots.count() and time.monotonic() < deadline:
        page.wait_for_timeout(500)
    assert dots.count(), "the frontier drew no points: " + search.inner_text()[:500]
    assert "candidates explored" in search.inner_text()
    assert search.locator(".pn-search-table tr").count() > 2
    before = page.evaluate(_PROGRAM)
    for i in reversed(range(dots.count())):
        dots.nth(i).scroll_into_view_if_needed()
        box = dots.nth(i).bounding_box()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.wait_for_timeout(200)
        page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        deadline = time.monotonic() + 30   # the rows at once, the Python after the refresh
        while page.evaluate(_PROGRAM)[0] == before[0] and time.monotonic() < deadline:
            page.wait_for_timeout(250)
        if page.evaluate(_PROGRAM)[0] != before[0]:
            break
    after = page.evaluate(_PROGRAM)
    assert after[0] != before[0] and after[1] != before[1], "a click loaded no candidate"
    assert "loaded" in search.inner_text()
    page.wait_for_selector(".pn-summary:has-text('4 devices')", timeout=60_000)


def _run_all(page) -> None:
    _wait_kernel_idle(page)
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    page.wait_for_timeout(500)
    _accept_dialogs(page)


def test_designer_in_jupyterlab(lab, tmp_path):
    from playwright.sync_api import sync_playwright
    base, token = lab
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1700, "height": 1100})
            page.set_default_timeout(60_000)
            page.goto(f"{base}/lab/tree/{NOTEBOOK.name}?token={token}")
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=90_000)
            # opened and its kernel started, the stored notebook is as JupyterLab would
            # write it: not marked modified, so autosave leaves the tracked file alone
            _wait_kernel_idle(page)
            page.wait_for_timeout(1500)
            assert page.locator(".lm-TabBar-tab.jp-mod-dirty").count() == 0, \
                "opening the notebook marked it modified"
            _run_all(page)

            # the DAG renders as SVG with clickable nodes carrying DAG ids
            _wait_rendered(page, ".pn-dag svg g.node")
            assert page.locator('.pn-dag g.node[id="F[PP=0,MB=0]"]').count() == 1
            _check_dag_gestures(page)

            # the timeline renders (plotly) once its tab is shown
            page.locator(".widget-tab .lm-TabBar-tab", has_text="Timeline").first.click()
            page.wait_for_selector(".js-plotly-plot:visible g.trace.bars g.point")
            before = _bar_count(page)

            # type a new microbatch count into the schedule row: the timeline redraws
            page.locator(".widget-tab .lm-TabBar-tab", has_text="Directives").first.click()
            box = page.locator(".pn-microbatches input").first
            box.fill("8")
            box.press("Enter")
            deadline = time.monotonic() + 60
            while _bar_count(page) <= before and time.monotonic() < deadline:
                page.wait_for_timeout(250)
            assert _bar_count(page) > before, "the timeline did not redraw after the edit"
            page.wait_for_selector(".pn-summary:has-text('8 microbatches')")

            # a deliberately broken plan: the schedule's ranks past the stages. Its row is
            # marked, saying the fix with the numbers; set back, the mark goes
            row = page.locator(".pn-designer .pn-row").filter(has_text="#2 schedule").first
            ranks = row.locator(".widget-text", has_text="ranks").locator("input").first
            ranks.fill("4")
            ranks.press("Enter")
            page.wait_for_selector(".pn-row.pn-row-error:has-text('#2 schedule'):has-text("
                                   "'cut into 2 stages (PP 0-1): set ranks=2')")
            assert page.locator(".pn-row.pn-row-error").count() == 1
            ranks.fill("2")
            ranks.press("Enter")
            page.wait_for_selector(".pn-row.pn-row-error", state="detached")

            # click a DAG node: its details appear beside the picture
            page.locator(".widget-tab .lm-TabBar-tab", has_text="DAG").first.click()
            node = page.locator('.pn-dag g.node[id="F[PP=1,MB=0]"]')
            node.wait_for(state="visible")
            node.click()
            details = page.locator(".pn-details-panel")
            details.wait_for(state="visible")
            details.locator("text=inputs").wait_for()
            text = details.inner_text()
            assert "F[PP=1,MB=0]" in text and "stream" in text and "outputs" in text
            assert "selected: F[PP=1,MB=0]" in page.locator(".pn-dag-note").first.inner_text()
            # launch: the Run tab trains, then stacks the measured timeline under the predicted
            page.locator(".pn-designer .widget-tab .lm-TabBar-tab", has_text="Run").first.click()
            page.locator(".pn-designer button", has_text="Launch").first.click()
            page.locator(".pn-designer .pn-good", has_text="done").first.wait_for(timeout=180_000)
            assert _bar_count(page) > 0, "the Run tab shows no timeline bars after the launch"
            # JupyterLab's notifications (its news question) would sit over the widget
            page.add_style_tag(content=".Toastify { display: none !important; }")
            _search_and_load(page)
            _check_layout_at_both_sizes(page)
            # the docs' picture: the directives above, the DAG with the node's details below
            page.set_viewport_size({"width": 1700, "height": 1700})
            for tab in ("Directives", "DAG"):
                page.locator(".pn-designer .widget-tab .lm-TabBar-tab", has_text=tab).first.click()
            page.wait_for_timeout(700)
            page.screenshot(path=str(tmp_path / "designer.png"), full_page=True)
            assert (tmp_path / "designer.png").stat().st_size > 10_000
            widget = tmp_path / "designer_widget.png"
            page.locator(".pn-designer").first.screenshot(path=str(widget))
            assert widget.stat().st_size > 10_000
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(widget, SCREENSHOT)   # for `make screenshots`, once it is whole
        finally:
            browser.close()
