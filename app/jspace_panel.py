"""Inspect's "J-space of this cell" panel (docs/method.md §11): the selected cell's residual decomposed into a lens's
J-space, its atoms as coefficient bars and the explained fraction beside the random and shuffled dictionaries'.

Computed when *Decompose* is clicked (a decomposition with its controls is three pursuits over the vocabulary) and
kept in the session for that cell and those settings.
"""

from __future__ import annotations

from typing import Any

import streamlit as st

import common
from jlens_core import decompose
from jlens_core.figures.tokens import jspace_bars, jspace_grid
from jlens_core.lenses.kinds import is_baseline
from jlens_core.reading.inputs import record_residuals

ss = st.session_state


def panel(ctx: common.Context, full_ids: Any, text: str, layer: int, position: int, *,
          layers: list[int], positions: tuple[int, ...], tokens: list[str]) -> None:
    """The expander for the cell (``layer``, ``position``) of the prompt ``full_ids`` (``[1, seq]``), and the grid of
    every shown cell (``layers`` x ``positions``; ``tokens`` their display strings) on request."""
    lenses = {name: lens for name, lens in ctx.lenses().items() if hasattr(lens, "matrix")}
    with st.expander("J-space (this cell, or every shown cell)", expanded=False):
        names = list(lenses)
        preferred = jspace_lens(ctx, ss.get("mode") or "") or names[0]
        c1, c2, c3, c4 = st.columns([2, 1, 1, 1])
        name = c1.selectbox("Lens", names, index=names.index(preferred), key="js_lens", format_func=common.lens_label)
        k = int(c2.number_input("k (atoms)", 1, min(50, int(ctx.model.d_model)), 25, key="js_k"))
        gauge = c3.radio("Gauge", ["centred", "raw"], key="js_gauge", horizontal=True,
                         help="centred: read vectors minus their mean over the vocabulary; raw: as they are")
        lens = lenses[name]
        grid_key = (ctx.model_key, text, tuple(layers), tuple(positions), name, k, gauge)
        if st.button("Decompose every shown cell", key="js_grid_run",
                     help="Each shown layer the lens reads, every shown position: the cell labelled with its largest "
                          "atom, coloured by the explained fraction (no controls; the hover lists every atom)"):
            with st.spinner("Decomposing every shown cell…"):
                ss._js_grid = (grid_key, _grid(ctx.model, lens, full_ids, layers, positions, k, gauge, tokens))
        stored_grid = ss.get("_js_grid")
        if stored_grid and stored_grid[0] == grid_key:
            st.plotly_chart(stored_grid[1], key="js_grid", config={"displaylogo": False})
        if layer not in lens.source_layers:
            st.caption(f"Layer {layer} is not a source layer of the {common.lens_label(name)}: pick a layer it reads "
                       "(the output row has no J-space).")
            return
        key = (ctx.model_key, text, int(layer), int(position), name, k, gauge)
        if c4.button("Decompose", key="js_run", help="Greedy nonnegative pursuit over the vocabulary's read "
                                                     "vectors, with a random and a shuffled dictionary beside it"):
            with st.spinner("Decomposing…"):
                h = record_residuals(ctx.model, full_ids, [layer])[layer][int(position)].float()
                ss._js_result = (key, decompose(ctx.model, lens, h, layer, k=k, gauge=gauge))
        stored = ss.get("_js_result")
        if not stored or stored[0] != key:
            st.caption("Click Decompose for this cell's J-space.")
            return
        dec = stored[1]
        st.markdown(f"Explained **{float(dec.explained[0]):.1%}** of the residual's squared norm by "
                    f"**{int(dec.occupancy[0])}** atoms; a random dictionary of the same size explains "
                    f"{float(dec.random_explained[0]):.1%}, the shuffled J dictionary "
                    f"{float(dec.shuffled_explained[0]):.1%}.")
        atoms = [(t, c) for t, _, c in dec.atoms(0)]
        st.plotly_chart(jspace_bars(atoms), key="js_bars", config={"displaylogo": False})


def jspace_lens(ctx: common.Context, mode: str) -> str | None:
    """The lens whose J-space Inspect shows: the lens drawn (``mode``) if it is a fitted lens with matrices, else
    the one picked in this panel, else the first fitted lens with matrices, else the logit lens (None: none loaded)."""
    lenses = {name: lens for name, lens in ctx.lenses().items() if hasattr(lens, "matrix")}
    if mode in lenses and not is_baseline(lenses[mode]):
        return mode
    if ss.get("js_lens") in lenses:
        return str(ss.js_lens)
    return next((n for n in lenses if not is_baseline(lenses[n])), next(iter(lenses), None))


def _grid(model: Any, lens: Any, full_ids: Any, layers: list[int], positions: tuple[int, ...], k: int, gauge: str,
          tokens: list[str]) -> Any:
    """The figure of every shown cell's decomposition (layers the lens does not read are left out)."""
    rows = [layer for layer in layers if layer in lens.source_layers]
    cols = list(positions)
    recorded = record_residuals(model, full_ids, rows)
    explained, labels, hovers = [], [], []
    for layer in rows:
        dec = decompose(model, lens, recorded[layer][cols].float(), layer, k=k, gauge=gauge, controls=False)
        atoms = [dec.atoms(i) for i in range(dec.n)]
        explained.append([float(v) for v in dec.explained])
        labels.append([a[0][0] if a else "" for a in atoms])
        hovers.append([f"L{layer}, position {p}: explained {float(dec.explained[i]):.1%}<br>"
                       + "<br>".join(f"{t!r} {c:.2f}" for t, _, c in atoms[i]) for i, p in enumerate(cols)])
    return jspace_grid(rows, [tokens[p] for p in cols], explained, labels, hovers)
