"""The Study page in a real browser (Debian's ``chromium`` driven by Playwright, as in ``tests/test_browser.py``),
on the embedded default model with its shipped lenses: a study of a few two_hop items draws one line per lens,
and an item opens in Inspect with its concept pinned (in the URL and in the pin box)."""

from __future__ import annotations

from urllib.parse import parse_qs, urlparse

import test_browser
from test_browser import CHROMIUM, FIRST_LOAD_S, _idle, _no_exception, _page

pytestmark = test_browser.pytestmark
server, browser, shots = test_browser.server, test_browser.browser, test_browser.shots  # its fixtures
STUDY_FIG = '.st-key-study_fig [data-testid="stPlotlyChart"] .js-plotly-plot'


def test_study_page_draws_and_opens_an_item_in_inspect(server, browser, shots):
    assert CHROMIUM
    page = _page(browser, height=1600)
    page.goto(server + "/study?sets=two_hop&n=6&filter=0")
    try:
        page.get_by_role("button", name="Run study").wait_for(timeout=FIRST_LOAD_S * 1000)
    except Exception:
        page.screenshot(path=str(shots / "study-failed.png"), full_page=True)
        raise
    _idle(page, timeout=FIRST_LOAD_S * 1000)  # the model and the shipped lenses load first
    page.get_by_role("button", name="Run study").click()
    page.wait_for_function(f"(() => {{ const g = document.querySelector('{STUDY_FIG}'); "
                           "return !!(g && g.data && g.data.length > 0); })()", timeout=300_000)
    _no_exception(page)
    names = page.evaluate(f"(() => document.querySelector('{STUDY_FIG}').data"
                          ".filter(t => t.mode === 'lines+markers').map(t => t.name))()")
    assert names[:2] == ["Logit lens", "Jacobian lens"]
    page.screenshot(path=str(shots / "study.png"), full_page=True)
    _idle(page)
    with page.expect_popup() as opened:  # the link opens Inspect in a new tab, from its URL
        page.get_by_role("link", name="Open in Inspect").click()
    inspect = opened.value
    inspect.set_default_timeout(120_000)
    inspect.locator('.st-key-heatmap [data-testid="stPlotlyChart"] .js-plotly-plot').wait_for()
    query = parse_qs(urlparse(inspect.url).query)
    assert query["pin"] == [" France"] and query["prompt"][0].startswith("The capital of the country")
    assert inspect.get_by_label("Pin tokens", exact=True).input_value() == " France"
    _no_exception(inspect)
    inspect.close()
    page.close()


def test_the_study_page_file_draws_offline(browser, tmp_path):
    """``Study.to_html``: every set's figure is drawn from the page alone (a file URL, nothing fetched)."""
    from helpers import tiny

    from jlens_core import LogitLens, study

    model = tiny()
    items = [{"name": f"i{n}", "prompt": p, "intermediates": ["capital", "time"]}
             for n, p in enumerate(["The capital of France is", "Once upon a time there"])]
    result = study(model, {"logit": LogitLens.for_model(model)}, {"a": items, "b": items[:1]}, k=50,
                   answered_only=False, n_boot=50)
    path = tmp_path / "study.html"
    result.to_html(path)
    page = _page(browser)
    page.goto(path.as_uri())
    page.wait_for_function("document.getElementById('status').textContent === ''", timeout=60_000)
    assert page.evaluate("document.querySelectorAll('#fig-0 .main-svg, #fig-1 .main-svg').length") >= 2
    names = page.evaluate("Array.from(document.querySelectorAll('.js-plotly-plot'), g => g.data.filter("
                          "t => t.mode === 'lines+markers').map(t => t.name))")
    assert names == [["Logit lens"], ["Logit lens"]] and result.sets == ["a", "b"]
    page.close()
