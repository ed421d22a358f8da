"""End to end in a real browser: Debian's ``chromium`` driven by Python Playwright, against the app
served by ``jlens app`` (``streamlit run app/main.py``) on a free localhost port.

* Inspect on the embedded default model (the real SmolLM2-135M; its first load converts the GGUF,
  later loads read the cache): the heatmap appears with token text and the model's real
  prediction in the output row; a new prompt redraws it; hover shows the top-k; a click opens the
  cell's detail; the lens mode switches.
* Generate on the default model: 8 new tokens, the heatmap grows by 8 columns marked as generated.
* The J-space display mode on the default model: the labels arrive after the plain heatmap, in the same view.
* Intervene on the default model: a swap France -> Germany turns the answer Paris into Berlin.
* Fit on a tiny model saved to a temporary folder: the progress bar and the convergence chart
  update while the fit runs, survive a page reload, and the fit finishes.
* A Fit whose checkpoint lies outside the app's workspace is refused, and no file appears.

Nowhere an exception element. Screenshots go to ``$JLENS_SCREENSHOTS`` (default: the test's
temporary folder). Skipped, with the reason, where chromium is not installed.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pytest
from conftest import LONG_TEXT, free_port, wait_serving

CHROMIUM = os.environ.get("JLENS_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync"]
REPO = Path(__file__).resolve().parent.parent
HEATMAP = '.st-key-heatmap [data-testid="stPlotlyChart"] .js-plotly-plot'  # the Inspect heatmap (its key)
FIRST_LOAD_S = 420  # the default model's first launch converts a GGUF (tens of seconds; more on a busy CPU)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path(CHROMIUM).is_file(),
                                 reason=f"chromium is not installed ({CHROMIUM} not found): `apt-get install "
                                        "chromium` (run.sh does it) to run the browser tests")]
sync_api = pytest.importorskip("playwright.sync_api", reason="Python Playwright is not installed (pip install "
                                                            "playwright; no browser download is needed)")


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("JLENS_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``jlens app`` on a free port; yields its URL."""
    work = tmp_path_factory.mktemp("server")
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", JLENS_RUNS_DIR=str(work / "runs"), PYTHONUNBUFFERED="1")
    log = open(work / "server.log", "wb")  # noqa: SIM115 - closed at teardown
    # the workspace: every temporary folder of this session (the tiny model, the corpora)
    proc = subprocess.Popen([sys.executable, "-m", "jlens_core", "app", "--headless", "--port", str(port),
                             "--address", "127.0.0.1", "--server.fileWatcherType", "none",
                             "--workspace", str(tmp_path_factory.getbasetemp())],
                            cwd=str(REPO), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    if not wait_serving(url, proc):
        log.flush()
        pytest.fail(f"the app did not start: {(work / 'server.log').read_text(errors='replace')[-2000:]}")
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    log.close()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        yield chromium
        chromium.close()


def _page(browser, height: int = 1000):
    page = browser.new_page(viewport={"width": 1400, "height": height})
    page.set_default_timeout(60_000)
    return page


def _no_exception(page) -> None:
    assert page.locator('[data-testid="stException"]').count() == 0, page.locator(
        '[data-testid="stException"]').all_inner_texts()


def _heatmap(page, expr: str):
    """Evaluate ``expr`` on the heatmap's graph div ``g`` (Plotly keeps the figure on it)."""
    return page.evaluate(f"(() => {{ const g = document.querySelector('{HEATMAP}'); return {expr}; }})()")


def _idle(page, timeout: float = 120_000) -> None:
    """Wait until Streamlit's script run has finished (its status widget gone)."""
    page.wait_for_timeout(300)
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=timeout)


def _settled(page, timeout: float = 120_000) -> None:
    """Wait until the script run has finished and the extras it announced (the stability marks, "...: computing…"
    in the reading's caption) have arrived and been drawn: their redraw replaces the heatmap's and the panels'
    elements, so a hover or a click made before it can land on an element that is gone."""
    _idle(page, timeout)
    page.wait_for_function("() => ![...document.querySelectorAll('[data-testid=stCaptionContainer]')]"
                           ".some(e => e.innerText.includes('computing…'))", timeout=timeout)
    _idle(page, timeout)


def _wait_heatmap(page, condition: str, timeout: float = 60_000) -> None:
    page.wait_for_function(f"(() => {{ const g = document.querySelector('{HEATMAP}'); "
                           f"return !!(g && g.data && ({condition})); }})()", timeout=timeout)


def test_inspect_on_the_default_model(server, browser, shots):
    page = _page(browser)
    page.goto(server + "/")
    # the first launch converts the embedded GGUF; later launches read the cache
    _wait_heatmap(page, "g.data[0].text && g.querySelectorAll('.heatmap-label text').length > 50",
                  timeout=FIRST_LOAD_S * 1000)
    time.sleep(1.0)
    _no_exception(page)
    labels = _heatmap(page, "g.layout.yaxis.ticktext")
    assert labels[0] == "L0" and labels[-1] == "output (L29)"  # SmolLM2-135M: 30 layers, output last
    # the default example ends "... The capital of Italy is": the model's own prediction is written in
    # the output row's last cell
    assert "Rome" in _heatmap(page, "g.data[0].text.at(-1).at(-1)")
    written = page.locator(f"{HEATMAP} .heatmap-label text").all_text_contents()
    assert "Rome" in " ".join(written)
    page.screenshot(path=str(shots / "inspect.png"))

    # a new prompt: the heatmap follows
    prompt = page.get_by_label("Prompt", exact=True)
    prompt.fill("The Eiffel Tower is located in the city of")
    prompt.press("Control+Enter")
    # the last run's elements are dimmed in one step, not faded frame by frame (app/common.py STALE_CSS):
    # a stale element container, as Streamlit marks one, gets the app's transition
    assert page.evaluate("""() => { const e = document.createElement('div');
        e.className = 'stElementContainer'; e.setAttribute('data-stale', 'true'); document.body.append(e);
        const t = getComputedStyle(e).transition; e.remove(); return t; }""") == "opacity 0s linear 1s"
    _wait_heatmap(page, "g.data[0].text.at(-1).at(-1).includes('Paris')")
    _no_exception(page)
    if page.locator('[data-testid="stSidebar"]').get_by_text("No Jacobian lens loaded").count() == 0:
        # the plain heatmap paints first; the J lens's stability marks redraw it in the same view when they are
        # computed (docs/app.md): the cells are hovered and clicked once that redraw is done
        _wait_heatmap(page, "g.data[0].text.at(-1).at(-1).includes('Paris') && g.data.some(d => d.name === 'stable %')")
        _settled(page)

    # hover a cell: its top-k tokens with probabilities
    drag = page.locator(f"{HEATMAP} .nsewdrag").first
    drag.scroll_into_view_if_needed()
    box = drag.bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.55, box["y"] + box["height"] * 0.6)
    page.wait_for_selector(".hoverlayer .hovertext", timeout=15_000)
    hover = page.locator(".hoverlayer .hovertext").first.text_content()
    assert "1. " in hover and "10. " in hover and "%" in hover and "top-1 probability" in hover
    page.screenshot(path=str(shots / "inspect-hover.png"))

    # click a cell: the detail panel follows
    before = page.get_by_text("at position", exact=False).first.inner_text()
    page.mouse.click(box["x"] + box["width"] * 0.25, box["y"] + box["height"] * 0.3)
    page.wait_for_function("(before) => { const e = [...document.querySelectorAll('[data-testid=stMarkdownContainer]')]"
                           ".find(x => x.innerText.includes('at position')); return e && e.innerText !== before; }",
                           arg=before, timeout=30_000)
    _no_exception(page)

    # switch the lens mode
    jacobian_loaded = page.locator('[data-testid="stSidebar"]').get_by_text("No Jacobian lens loaded").count() == 0
    modes = page.locator('[data-testid="stRadio"]')
    modes.get_by_text("Side by side", exact=True).click()
    if jacobian_loaded:
        # two panels (heatmap + labels each), plus the J lens's stability marks: the shipped lens keeps its
        # split halves, so Inspect marks unstable cells by default (hatching traces and a "stable %" strip)
        _wait_heatmap(page, "g.data.filter(t => t.legendgroup !== 'unstable' && t.name !== 'stable %').length === 4")
        # the plain heatmap paints first; the marks arrive in the same view once computed (docs/app.md)
        _wait_heatmap(page, "g.data.filter(t => t.name === 'stable %').length === 1")
        assert _heatmap(page, "g.data.filter(t => t.legendgroup !== 'unstable' && t.name !== 'stable %').length") == 4
        page.screenshot(path=str(shots / "inspect-side-by-side.png"))
        # the default reading lens against the logit lens: "Difference (Jacobian − logit)", or the shipped
        # variant that beat the J lens ("R++", jlens_core.lenses.shipped.DEFAULT_READING_LENS)
        modes.get_by_text(re.compile(r"^Difference \(.+ − logit\)$")).click()
        _wait_heatmap(page, "g.data.length === 2 && g.data[0].name === 'difference'")
        page.screenshot(path=str(shots / "inspect-difference.png"))
    else:
        page.get_by_text("No Jacobian lens is loaded", exact=False).wait_for()
        modes.get_by_text("Jacobian lens", exact=True).click()
        page.get_by_text("No Jacobian lens is loaded", exact=False).wait_for()
    modes.get_by_text("Logit lens", exact=True).click()
    _wait_heatmap(page, "g.data.length === 2 && g.data[0].name === 'Logit lens'")
    _no_exception(page)
    if jacobian_loaded:  # the shipped lens: its spectra and directions
        page.get_by_test_id("stSidebarNav").get_by_text("Jacobians").click()
        page.get_by_text("decoded through the unembedding", exact=False).first.wait_for(timeout=180_000)
        _no_exception(page)
        page.screenshot(path=str(shots / "jacobians.png"))
        # the shipped lens's stored evaluation shows on arrival, without computing anything
        page.get_by_test_id("stSidebarNav").get_by_text("Evaluate").click()
        page.get_by_text("The stored evaluation of the shipped lenses", exact=False).wait_for(timeout=60_000)
        page.locator('[data-testid="stPlotlyChart"]').first.wait_for(timeout=60_000)
        _no_exception(page)
    page.close()


def test_generate_on_the_default_model(server, browser, shots):
    """Generate 8 tokens from the Inspect page: the heatmap grows by 8 columns, marked as generated."""
    page = _page(browser, height=1300)
    page.goto(server + "/?prompt=" + quote("Once upon a time, in a small village by the sea, there lived"))
    _wait_heatmap(page, "g.data[0].text && g.data[0].text.length > 0", timeout=FIRST_LOAD_S * 1000)
    before = _heatmap(page, "g.data[0].text[0].length")
    _settled(page)
    page.get_by_text("Generate a continuation", exact=True).click()
    new_tokens = page.get_by_role("spinbutton", name="New tokens").first
    try:
        new_tokens.wait_for(timeout=30_000)
    except Exception:
        page.screenshot(path=str(shots / "generate-failed.png"), full_page=True)
        raise
    new_tokens.fill("8")
    new_tokens.press("Enter")
    _wait_heatmap(page, f"g.data[0].text[0].length === {before + 8}", timeout=180_000)
    _no_exception(page)
    ticks = _heatmap(page, "g.layout.xaxis.ticktext")
    assert sum("✎" in tick for tick in ticks) == 8
    page.get_by_text("Continuation (8 tokens, greedy", exact=False).wait_for()
    assert "gen=8" in page.url
    page.get_by_text("Most common tokens", exact=False).first.scroll_into_view_if_needed()
    page.screenshot(path=str(shots / "inspect-generate.png"), full_page=True)
    page.close()


def test_jspace_labels_arrive_after_the_plain_heatmap(server, browser, shots):
    """The J-space display mode on the default model: the plain heatmap is drawn first, the J-space labels (each
    cell's largest atom, every atom on hover) are written into the same view when computed, nothing moves."""
    page = _page(browser)
    prompt = "In the old harbour town, the fishermen mended their nets while the gulls circled over the"
    # three layers (and the output row): a decomposition with its controls is three pursuits over the vocabulary
    page.goto(server + "/?mode=jacobian&cells=jspace&band=20-22&prompt=" + quote(prompt))
    _wait_heatmap(page, "g.data[0].text && g.data[0].text.length > 0", timeout=FIRST_LOAD_S * 1000)
    # the first paint: the lens's top-1 tokens, the labels announced as coming
    assert "largest atom" not in _heatmap(page, "g.layout.title.text")
    page.get_by_text("J-space labels: computing", exact=False).wait_for(timeout=30_000)
    _idle(page)  # the run that drew the plain heatmap has finished: the layout the labels must not move
    top = _heatmap(page, "g.getBoundingClientRect().top")
    plain_text = _heatmap(page, "g.data[0].text")
    # layer by layer ("... so far" in the title), then every layer
    _wait_heatmap(page, "g.layout.title.text.includes('largest atom') && !g.layout.title.text.includes('so far')",
                  timeout=600_000)
    _idle(page)
    _no_exception(page)
    assert _heatmap(page, "g.getBoundingClientRect().top") == pytest.approx(top, abs=2)  # the same view, no jump
    labelled = _heatmap(page, "g.data[0].text")
    assert labelled[-1] == plain_text[-1]  # the output row keeps its top-1 tokens
    assert len(labelled) == 4 and labelled[1] != plain_text[1]  # layers 20-22 now show atoms
    assert "random dictionary" in _heatmap(page, "g.data[1].hovertext[1 * g.data[0].x.length + 3]")
    assert "cells=jspace" in page.url
    page.screenshot(path=str(shots / "inspect-jspace.png"))
    page.close()


def test_intervene_swap_on_the_default_model(server, browser, shots):
    """The Intervene panel: swap France -> Germany on the Eiffel Tower prompt; the model answers Berlin."""
    page = _page(browser, height=1400)
    page.goto(server + "/?prompt=" + quote("The capital of the country where the Eiffel Tower stands is"))
    _wait_heatmap(page, "g.data[0].text && g.data[0].text.length > 0", timeout=FIRST_LOAD_S * 1000)
    _settled(page)  # a click while the script still runs, or before the marks' redraw, can be lost
    page.get_by_text("Intervene", exact=True).scroll_into_view_if_needed()
    token = page.get_by_role("textbox", name="A (the concept to replace)")
    token.fill("France")
    token.press("Enter")
    _idle(page)  # the rerun that A starts rebuilds the B box: a selection made during it is lost
    replacement = page.locator('[data-testid="stSelectbox"]').filter(has_text="B (the replacement)")
    replacement.locator("input").click()
    replacement.locator("input").fill("Germany")
    # Enter picks the highlighted option: wait until the filtered list shows it
    page.get_by_role("option").filter(has_text="Germany").first.wait_for(timeout=30_000)
    page.keyboard.press("Enter")
    _idle(page)
    page.get_by_role("button", name="Run").click()
    page.get_by_text("Edited continuation", exact=True).wait_for(timeout=120_000)
    _no_exception(page)
    page.get_by_text("Edit: Swap(' France' -> ' Germany'", exact=False).wait_for()
    edited = page.locator('[data-testid="stColumn"]').filter(has_text="Edited continuation").last.inner_text()
    clean = page.locator('[data-testid="stColumn"]').filter(has_text="Clean continuation").last.inner_text()
    assert "Paris" in clean and "Berlin" in edited
    page.get_by_text("Edited continuation", exact=True).scroll_into_view_if_needed()
    page.screenshot(path=str(shots / "inspect-intervene.png"))
    page.close()


def _fit_sample(page) -> tuple[int, int]:
    """(prompts done, points on the convergence chart), as the page shows them."""
    progress = page.locator('[data-testid="stProgress"]')
    text = progress.first.inner_text() if progress.count() else ""
    done = int(text.split("/")[0].strip()) if "/" in text and text.split("/")[0].strip().isdigit() else 0
    points = page.evaluate("""(() => { let n = 0;
        for (const g of document.querySelectorAll('[data-testid=stPlotlyChart] .js-plotly-plot')) {
            if (!g.layout || !g.layout.title || !String(g.layout.title.text).includes('Convergence')) continue;
            for (const t of (g._fullData || [])) if (t.name !== '1/n guide') n += (t._length || 0);
        } return n; })()""")
    return done, points


def test_fit_with_a_checkpoint_outside_the_workspace_is_refused(server, browser, shots, tiny_dir, tmp_path_factory):
    outside = tmp_path_factory.getbasetemp().parent / f"jlens-outside-{os.getpid()}"
    assert not outside.exists()
    page = _page(browser, height=1500)
    page.goto(f"{server}/fit?model={quote(tiny_dir)}&lens=none")
    page.get_by_text("Fit a Jacobian lens").wait_for()
    _idle(page)
    name = page.get_by_label("Run name", exact=True)
    name.fill("escape")
    name.press("Enter")
    box = page.get_by_label("Checkpoint", exact=True)
    box.fill(str(outside / "lens.ckpt"))
    box.press("Enter")
    _idle(page)
    page.get_by_role("button", name="Start fit").click()
    page.get_by_text("outside the workspace", exact=False).first.wait_for(timeout=60_000)
    assert page.get_by_text("Could not start the fit: The checkpoint", exact=False).count()
    page.screenshot(path=str(shots / "fit-refused.png"))
    time.sleep(2.0)  # had anything been launched, it would have written by now
    assert not outside.exists()
    assert page.get_by_text("escape ·", exact=False).count() == 0  # no run was created
    _no_exception(page)
    page.close()


def test_fit_and_watch_it_converge(server, browser, shots, tiny_dir, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Text number {i}. {LONG_TEXT}" for i in range(400)))
    page = _page(browser, height=1500)
    page.goto(f"{server}/fit?model={quote(tiny_dir)}&lens=none")
    page.get_by_text("Fit a Jacobian lens").wait_for()
    page.get_by_label("Run name", exact=True).fill("browser-fit")
    page.get_by_label("Run name", exact=True).press("Enter")
    page.get_by_text("Path or dataset", exact=True).click()
    path_box = page.get_by_label("Corpus path or Hugging Face dataset", exact=True)
    path_box.fill(str(corpus))
    path_box.press("Enter")
    for label, value in (("Prompts", "400"), ("max_seq_len", "40"), ("dim_batch", "1"),
                         ("min chars per text", "50")):
        box = page.get_by_label(label, exact=True)
        box.fill(value)
        box.press("Enter")
        time.sleep(0.3)
    page.get_by_role("button", name="Start fit").click()

    # follow the fit while it runs: the page refreshes itself from the fit's files
    samples, reloaded, deadline = [], False, time.time() + 240
    while time.time() < deadline and len(samples) < 6:
        _no_exception(page)
        done, points = _fit_sample(page)
        if done and points and (not samples or samples[-1] != (done, points)):
            samples.append((done, points))
            if len(samples) == 2:
                page.screenshot(path=str(shots / "fit-running.png"))
            if len(samples) == 3 and not reloaded:  # a running fit survives a browser reload
                page.reload()
                page.get_by_text("browser-fit", exact=False).first.wait_for()
                reloaded = True
        time.sleep(0.5)
    assert len(samples) >= 4, f"the page did not follow the fit: {samples}"
    assert samples[-1][0] > samples[0][0] and samples[-1][1] > samples[0][1], samples  # progress and curves grew
    assert page.get_by_text("running", exact=False).count()
    page.get_by_test_id("stMainBlockContainer").get_by_role("button", name="Stop", exact=True).click()
    page.get_by_text("Resume continues from the checkpoint", exact=False).wait_for(timeout=60_000)
    time.sleep(1.5)  # let the page settle on the stopped state
    done, points = _fit_sample(page)
    assert done >= samples[0][0] and points >= samples[0][1], (done, points, samples)  # the work is kept
    page.screenshot(path=str(shots / "fit-stopped.png"))
    _no_exception(page)
    page.close()
