"""Inspect's J-space (docs/method.md §11) under ``streamlit.testing.v1.AppTest``: the clicked cell's decomposition,
its bars and explained fractions equal the library's; the heatmap's J-space display mode labels every cell with its
largest atom once computed in the background, after the plain heatmap."""

from __future__ import annotations

import pytest
from test_app import PROMPT, chart, hold_extras, make_app, ok, rerun_until, runs_root, select_point, values  # noqa: F401 (runs_root: autouse)

from jlens_core import JacobianLens, decompose
from jlens_core.figures.heatmaps import text_chars
from jlens_core.figures.labels import cell_text, esc, shown
from jlens_core.reading.inputs import record_residuals


def test_a_clicked_cell_shows_its_jspace(tiny_dir, tiny_model, lens_file):
    at = ok(make_app(model=tiny_dir, lens=lens_file, prompt=PROMPT).run())
    # the default cell is the output row: no J-space there
    assert any("output row has no J-space" in c.value for c in at.caption)
    ok(select_point(at, "heatmap", x=5, y=1, curve_number=3))  # layer 1, position 5
    at.number_input(key="js_k").set_value(4)
    at.button(key="js_run").click().run()
    lens = JacobianLens.load(lens_file)
    h = record_residuals(tiny_model, tiny_model.encode(PROMPT), [1])[1][5].float()
    dec = decompose(tiny_model, lens, h, 1, k=4)
    text = next(m.value for m in ok(at).markdown if m.value.startswith("Explained"))
    assert f"**{float(dec.explained[0]):.1%}**" in text and f"{float(dec.random_explained[0]):.1%}" in text
    bars = chart(at, "js_bars")["data"][0]
    assert list(values(bars["x"])[::-1]) == pytest.approx([c for _, _, c in dec.atoms(0)], rel=1e-5)


def test_every_shown_cell_labelled_with_its_largest_atom(tiny_dir, tiny_model, lens_file):
    at = ok(make_app(model=tiny_dir, lens=lens_file, prompt=PROMPT).run())
    at.number_input(key="js_k").set_value(3)
    at.button(key="js_grid_run").click().run()
    grid = chart(ok(at), "js_grid")["data"][0]
    lens = JacobianLens.load(lens_file)
    ids = tiny_model.encode(PROMPT)
    h = record_residuals(tiny_model, ids, [1])[1].float()
    assert [str(y) for y in grid["y"]] == ["L0", "L1", "L2"]  # the shown layers the lens reads (not the output)
    dec = decompose(tiny_model, lens, h, 1, k=3, controls=False)
    n = ids.shape[-1]
    assert list(values(grid["z"])[1]) == pytest.approx([float(v) for v in dec.explained[:n]], abs=1e-6)
    assert grid["text"][1][5] == esc(shown(dec.atoms(5)[0][0]))  # the largest atom, as the figures show tokens
    assert all(f"{t!r} {c:.2f}" in grid["hovertext"][1][5] for t, _, c in dec.atoms(5))


def _labelled(at):
    def every_layer(a) -> bool:
        title = chart(a, "heatmap")["layout"]["title"]["text"]
        return "largest atom" in title and "so far" not in title

    return rerun_until(at, every_layer, "J-space labels")


def test_jspace_display_mode_labels_every_cell_after_the_first_paint(tiny_dir, tiny_model, lens_file, monkeypatch):
    release = hold_extras(monkeypatch)  # the first paint is seen without the labels
    at = ok(make_app(model=tiny_dir, lens=lens_file, prompt=PROMPT, mode="jacobian").run())
    plain = chart(at, "heatmap")
    at.selectbox(key="cell_text").set_value("jspace")
    at.number_input(key="js_k").set_value(4)
    ok(at.run())
    first = chart(at, "heatmap")  # the plain heatmap, drawn at once; the labels announced, not waited for
    assert first["data"][0]["text"] == plain["data"][0]["text"]
    assert any("J-space labels: computing" in c.value for c in at.caption)
    release.set()
    fig = chart(_labelled(at), "heatmap")
    assert not any("J-space labels: computing" in c.value for c in at.caption)
    lens = JacobianLens.load(lens_file)
    ids = tiny_model.encode(PROMPT)
    n = int(ids.shape[-1])
    h = record_residuals(tiny_model, ids, [1])[1].float()
    dec = decompose(tiny_model, lens, h, 1, k=4)  # the library's, every position in one batch
    text, hover = fig["data"][0]["text"], fig["data"][1]["hovertext"]
    chars = text_chars(n, len(text) * n)
    assert text[1] == [cell_text(dec.atoms(i)[0][0], chars) for i in range(n)]  # layer 1: each cell's largest atom
    assert text[-1] == plain["data"][0]["text"][-1]  # the output row has no J-space: its top-1 token stays
    cell = hover[1 * n + 5]  # layer 1, position 5
    assert f"explain {float(dec.explained[5]):.1%} (random dictionary {float(dec.random_explained[5]):.1%})" in cell
    assert all(f"{esc(shown(t))} {c:.2f}" in cell for t, _, c in dec.atoms(5))
    # another prompt: drawn plain at once, then labelled
    at.text_area(key="prompt").set_value("The capital of Spain is")
    ok(at.run())
    assert "largest atom" not in chart(at, "heatmap")["layout"]["title"]["text"]
    assert "largest atom" in chart(_labelled(at), "heatmap")["layout"]["title"]["text"]


def test_the_url_opens_the_jspace_display_mode(tiny_dir, lens_file):
    at = ok(make_app(model=tiny_dir, lens=lens_file, prompt=PROMPT, mode="jacobian", cells="jspace").run())
    assert at.selectbox(key="cell_text").value == "jspace" and at.query_params["cells"] == "jspace"
    _labelled(at)
    at.selectbox(key="cell_text").set_value("top-1")
    fig = chart(ok(at.run()), "heatmap")
    assert "largest atom" not in fig["layout"]["title"]["text"] and "cells" not in at.query_params


def test_a_new_prompt_stops_the_old_prompts_jspace_labels(tiny_dir, lens_file, monkeypatch):
    release = hold_extras(monkeypatch)
    import cache  # the app's module (hold_extras put the app's folder on the path)

    old, new = "Rain fell on the quiet town all night.", "The river ran fast under the old stone bridge."
    at = ok(make_app(model=tiny_dir, lens=lens_file, prompt=old, mode="jacobian", cells="jspace").run())
    at.text_area(key="prompt").set_value(new)
    ok(at.run())  # the old prompt's job waits (held), the new prompt's starts
    release.set()
    _labelled(at)
    texts = [key[2] for key in cache.jspace_store()._done]
    assert new in texts and old not in texts  # the old job stopped before its first layer: nothing of it computed
    at.text_area(key="prompt").set_value(old)  # asked again, it runs
    ok(at.run())
    _labelled(at)
    assert old in [key[2] for key in cache.jspace_store()._done]
