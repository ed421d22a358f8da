"""Debugging figures: two hidden-state dumps' per-layer divergence (the Compare runs page)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from .plotly_lib import go


def divergence_figure(curve: pd.DataFrame, *, op: str, atol: float, first_layer: int | None) -> go.Figure:
    """Per-layer max abs / relative error between two dumps, first divergence marked.

    Args:
        curve: :func:`~jlens_core.debugging.diff.divergence_curve`'s table (``layer, max_abs_err, max_rel_err``).
        op: the operation compared (the title); atol: the tolerance line; first_layer: the first layer beyond it.
    """
    fig = go.Figure()
    floor = 1e-12
    fig.add_trace(go.Scatter(x=curve["layer"], y=np.maximum(curve["max_abs_err"], floor), mode="lines+markers",
                             name="max abs error", hovertemplate="layer %{x}: %{y:.3g}<extra>max abs</extra>"))
    fig.add_trace(go.Scatter(x=curve["layer"], y=np.maximum(curve["max_rel_err"], floor), mode="lines+markers",
                             name="max rel error", line={"dash": "dot"},
                             hovertemplate="layer %{x}: %{y:.3g}<extra>max rel</extra>"))
    fig.add_hline(y=max(atol, floor), line_dash="dash", line_color="grey", annotation_text=f"atol {atol:g}")
    if first_layer is not None:
        fig.add_vline(x=first_layer, line_color="crimson", annotation_text=f"first divergence: layer {first_layer}")
    fig.update_yaxes(type="log", title="error")
    fig.update_xaxes(title="layer (-1 = embedding)")
    fig.update_layout(height=380, margin={"l": 10, "r": 10, "t": 40, "b": 10}, title=f"Divergence of {op}")
    return fig


__all__ = ["divergence_figure"]
