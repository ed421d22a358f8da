"""Token figures: the top-k bars of one cell (per lens, or clean vs edited) and a reading's most common tokens."""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from .labels import LENS_COLORS, LENS_NAMES, esc, shown
from .plotly_lib import go, make_subplots


def topk_bars(cells: Mapping[str, dict | None], *, k: int = 10) -> go.Figure:
    """Horizontal bars of the top-k tokens at one cell, one panel per lens (or per run).

    Args:
        cells: ``{name: {"top_tokens": [...], "top_probs": [...]}}`` (a :meth:`PromptReading.cell`; None: an
            empty panel), most probable first.
        k: bars per panel.
    """
    names = list(cells)
    fig = make_subplots(rows=1, cols=len(names), subplot_titles=[LENS_NAMES.get(n, n) for n in names],
                        horizontal_spacing=0.18)
    for col, name in enumerate(names, start=1):
        cell = cells[name]
        if cell is None:
            continue
        tokens = [esc(shown(t)) for t in cell["top_tokens"][:k]][::-1]
        probs = cell["top_probs"][:k][::-1]
        fig.add_trace(go.Bar(x=probs, y=[f"{len(tokens) - i}. {t}" for i, t in enumerate(tokens)], orientation="h",
                             marker_color=LENS_COLORS.get(name), name=LENS_NAMES.get(name, name),
                             text=[f"{p:.1%}" for p in probs], textposition="auto",
                             hovertemplate="%{y}: %{x:.2%}<extra></extra>"), row=1, col=col)
        fig.update_xaxes(tickformat=".0%", row=1, col=col)
    fig.update_layout(height=max(260, 26 * k + 80), showlegend=False, margin={"l": 10, "r": 10, "t": 40, "b": 10})
    return fig


def most_common_figure(tables: Mapping[str, pd.DataFrame], *, top_n: int = 15) -> go.Figure:
    """Bars of the tokens most often top-1 in a band of layers, one panel per lens.

    Args:
        tables: ``{lens name: most_common_tokens(reading, ...)}`` (columns ``token, count, n_layers``).
        top_n: bars per panel.
    """
    names = list(tables)
    fig = make_subplots(rows=1, cols=max(1, len(names)), subplot_titles=[LENS_NAMES.get(n, n) for n in names],
                        horizontal_spacing=0.18)
    for col, name in enumerate(names, start=1):
        table = tables[name].head(top_n).iloc[::-1]
        fig.add_trace(go.Bar(x=table["count"], y=[esc(shown(str(t))) for t in table["token"]], orientation="h",
                             marker_color=LENS_COLORS.get(name), name=LENS_NAMES.get(name, name),
                             customdata=table["n_layers"],
                             hovertemplate="%{y}: top-1 in %{x} cells, %{customdata} layers<extra></extra>"),
                      row=1, col=col)
        fig.update_xaxes(title="cells where it is top-1", row=1, col=col)
    fig.update_layout(height=max(260, 22 * top_n + 90), showlegend=False, title="Most common top-1 tokens",
                      margin={"l": 10, "r": 10, "t": 60, "b": 10})
    return fig


__all__ = ["most_common_figure", "topk_bars"]


def jspace_bars(atoms: list[tuple[str, float]], *, title: str = "") -> go.Figure:
    """Horizontal bars of one cell's J-space atoms (docs/method.md §11.2): ``[(token, coefficient), ...]``, largest
    first; a coefficient is a length in residual units (on the unit atom)."""
    tokens = [esc(shown(t)) for t, _ in atoms][::-1]
    values = [float(c) for _, c in atoms][::-1]
    fig = go.Figure(go.Bar(x=values, y=[f"{len(tokens) - i}. {t}" for i, t in enumerate(tokens)], orientation="h",
                           marker_color=LENS_COLORS.get("jacobian"), text=[f"{v:.2f}" for v in values],
                           textposition="auto", hovertemplate="%{y}: %{x:.3f}<extra></extra>"))
    fig.update_layout(height=max(220, 22 * len(tokens) + 80), showlegend=False, title=title or None,
                      xaxis_title="coefficient (residual units)", margin={"l": 10, "r": 10, "t": 40, "b": 10})
    return fig


def jspace_grid(layers: list[int], tokens: list[str], explained: list[list[float]], labels: list[list[str]],
                hovers: list[list[str]]) -> go.Figure:
    """A layer x position grid of J-space decompositions (docs/method.md §11.2): each cell coloured by its explained
    fraction and labelled with its largest atom; the hover lists every atom with its coefficient.

    Args:
        layers: the rows (bottom to top); tokens: the columns' token texts.
        explained, labels, hovers: ``[layer][position]`` (NaN / "" where a cell was not decomposed).
    """
    x = [f"{i}: {esc(shown(t))}" for i, t in enumerate(tokens)]
    y = [f"L{layer}" for layer in layers]
    fig = go.Figure(go.Heatmap(z=explained, x=x, y=y, text=[[esc(shown(t)) for t in row] for row in labels],
                               texttemplate="%{text}", hovertext=hovers, hoverinfo="text", colorscale="Oranges",
                               zmin=0, zmax=1, colorbar={"title": "explained", "tickformat": ".0%"}))
    fig.update_layout(height=max(260, 22 * len(layers) + 120), margin={"l": 10, "r": 10, "t": 30, "b": 10},
                      xaxis={"tickangle": -45})
    return fig
