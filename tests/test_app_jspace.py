"""Inspect's "J-space of this cell" panel (docs/method.md §11) under ``streamlit.testing.v1.AppTest``: the clicked
cell's decomposition, its bars and explained fractions equal the library's."""

from __future__ import annotations

import pytest
from test_app import PROMPT, chart, make_app, ok, runs_root, select_point, values  # noqa: F401 (runs_root: autouse)

from jlens_core import JacobianLens, decompose
from jlens_core.figures.labels import esc, shown
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
