"""figures/html_page: a reading as one offline HTML file (content, size, ``jlens inspect --html``), and in Chromium
with the network blocked: the heatmap draws, a hover shows the top-k, a click fills the cell detail (slow)."""

from __future__ import annotations

import base64
import gzip
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import save_tiny
from helpers import random_lens

from jlens_core import LogitLens, read_prompts
from jlens_core.cli.main import main
from jlens_core.figures.html_page import detail_data, reading_page
from jlens_core.figures.labels import shown

TEXT = "The capital of France is Paris. Water boils at one hundred degrees."
CHROMIUM = os.environ.get("JLENS_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def readings(llama):
    lenses = {"logit": LogitLens.for_model(llama), "jacobian": random_lens(llama, layers=[0, 2])}
    return read_prompts(llama, lenses, TEXT, top_k=5, pinned=[" Paris", "is"])


def packed(page: str, name: str) -> str:
    text = re.search(rf'<script id="{name}" type="application/octet-stream">(.*?)</script>', page, re.DOTALL).group(1)
    return gzip.decompress(base64.b64decode(text)).decode("utf-8")


def test_the_page_holds_plotly_the_figure_and_the_detail(readings):
    page = reading_page(readings, settings={"lens specs": "logit, random"})
    assert "https://" not in page.replace("https://plot.ly", "")  # nothing to fetch (plotly.js's own links aside)
    assert packed(page, "plotly-packed").lstrip().startswith("/**\n* plotly.js v")
    payload = json.loads(packed(page, "reading-packed"))
    figure, detail = payload["figure"], payload["detail"]
    assert [t["type"] for t in figure["data"]] == ["heatmap", "scatter"] * 2  # two lenses side by side
    assert payload["layers"] == readings["logit"].layers
    # header: model, lenses, settings
    for text in ("tiny-llama", "Logit lens", "Jacobian lens", "top-1 probability", "side by side", "logit, random",
                 "&#x27; Paris&#x27;"):
        assert text in page
    # the compact detail decodes to the readings' numbers
    jac = readings["jacobian"]
    lens = detail["lenses"]["jacobian"]
    index = np.frombuffer(base64.b64decode(lens["top"]), dtype=f"<u{detail['index_bytes']}")
    probs = np.frombuffer(base64.b64decode(lens["probs"]), dtype="<f2").astype(np.float32)
    assert len(index) == jac.top_ids.size and jac.layers[1] == 2
    names = [detail["tokens"][i] for i in index.reshape(jac.top_ids.shape)[1, 3]]
    assert names == [shown(t) for t in jac.top_tokens(2, 3)]
    assert np.allclose(probs.reshape(jac.top_probs.shape), jac.top_probs, rtol=1e-3, atol=1e-4)
    assert lens["stats"]["kl_bits"][1 * jac.n_positions + 3] == pytest.approx(jac.kl_bits[1, 3], rel=1e-3)
    assert lens["pinned"][" Paris"] == jac.pinned_ranks[" Paris"].ravel().tolist()
    assert lens["layers"] == jac.layers and detail["positions"] == jac.positions.tolist()


def test_one_lens_and_bad_input(readings):
    one = json.loads(packed(reading_page({"logit": readings["logit"]}, stat="kl_bits"), "reading-packed"))
    assert len(one["figure"]["data"]) == 2 and list(one["detail"]["lenses"]) == ["logit"]
    assert detail_data({"logit": readings["logit"]})["index_bytes"] == 2
    with pytest.raises(ValueError, match="No readings"):
        reading_page({})


def test_to_html_and_inspect_html(readings, tmp_path, capsys):
    path = readings["jacobian"].to_html(tmp_path / "one.html", others={"logit": readings["logit"]}, mode="diff")
    assert path.is_file() and "difference" in path.read_text()
    model_dir = tmp_path / "tiny"
    save_tiny(model_dir)
    out = tmp_path / "page.html"
    assert main(["inspect", "--model", str(model_dir), "--lens", "logit,logit", "--prompt", TEXT,
                 "--html", str(out), "--pin", "is"]) == 0
    page = out.read_text()
    assert "Wrote" in capsys.readouterr().err and "lens specs</th><td>logit, logit" in page
    assert main(["inspect", "--model", str(model_dir), "--lens", ",", "--prompt", TEXT]) == 2


@pytest.mark.slow
@pytest.mark.skipif(not Path(CHROMIUM).is_file(), reason=f"chromium is not installed ({CHROMIUM} not found)")
def test_the_page_works_offline_in_chromium(readings, tmp_path):
    """Opened from disk with every non-file request aborted: it draws, hovers and fills the detail on a click."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="Python Playwright is not installed")
    path = readings["logit"].to_html(tmp_path / "page.html", others={"jacobian": readings["jacobian"]})
    shots = Path(os.environ.get("JLENS_SCREENSHOTS") or tmp_path)
    blocked = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1300, "height": 1100})

        def route(r):
            if r.request.url.startswith("file://"):
                r.continue_()
            else:
                blocked.append(r.request.url)
                r.abort()

        page.route("**/*", route)
        page.goto(path.as_uri())
        page.wait_for_function("() => { const g = document.getElementById('heatmap'); "
                               "return g && g.data && g.data.length === 4; }", timeout=30_000)
        assert page.locator("#status").inner_text() == ""
        drag = page.locator("#heatmap .nsewdrag").first
        box = drag.bounding_box()
        page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.5)
        page.wait_for_selector(".hoverlayer .hovertext", timeout=10_000)
        hover = page.locator(".hoverlayer .hovertext").first.text_content()
        assert "1. " in hover and "5. " in hover and "%" in hover and "top-1 probability" in hover
        page.mouse.click(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.5)
        page.wait_for_function("() => document.getElementById('detail').innerText.includes('position')",
                               timeout=10_000)
        detail = page.locator("#detail").inner_text()
        assert "Logit lens" in detail and "Jacobian lens" in detail and "kl_bits" in detail and "%" in detail
        assert 'rank of " Paris"' in detail
        page.wait_for_selector("#ranks.js-plotly-plot .scatterlayer .trace", timeout=10_000)  # pinned ranks drawn
        page.screenshot(path=str(shots / "html-export-tiny.png"), full_page=True)
        browser.close()
    assert blocked == []  # nothing was even asked for
