"""Evaluation figures: per-layer KL and cross-entropy curves, and pass@k bars."""

from __future__ import annotations

import pandas as pd

from .labels import LENS_COLORS, LENS_NAMES
from .plotly_lib import go, make_subplots


def eval_curves_figure(frame: pd.DataFrame) -> go.Figure:
    """Per-layer mean KL to final and next-token CE, per lens, with ±1 standard-error bars.

    Args:
        frame: :func:`~jlens_core.evaluation.by_layer.evaluate`'s table (``lens, layer, kl_bits, ce_bits, kl_se,
            ce_se``).
    """
    fig = make_subplots(rows=1, cols=2, subplot_titles=("KL(final ‖ lens), bits", "next-token cross-entropy, bits"))
    for name in dict.fromkeys(frame["lens"]):
        sub = frame[frame["lens"] == name].sort_values("layer")
        for col, (key, se) in enumerate((("kl_bits", "kl_se"), ("ce_bits", "ce_se")), start=1):
            fig.add_trace(go.Scatter(x=sub["layer"], y=sub[key], mode="lines+markers", name=LENS_NAMES.get(name, name),
                                     legendgroup=name, showlegend=col == 1,
                                     line={"color": LENS_COLORS.get(name)},
                                     error_y={"type": "data", "array": sub[se].fillna(0), "visible": True,
                                              "thickness": 1},
                                     hovertemplate="layer %{x}: %{y:.3f} bits<extra>" + name + "</extra>"),
                          row=1, col=col)
            fig.update_xaxes(title="layer", row=1, col=col)
    fig.update_layout(height=380, margin={"l": 10, "r": 10, "t": 40, "b": 10})
    return fig


def pass_at_k_figure(frame: pd.DataFrame) -> go.Figure:
    """pass@k per evaluation set and lens (grouped bars, one panel per k).

    Args:
        frame: :func:`~jlens_core.evaluation.passk.pass_at_k`'s table (``lens, set, k, pass_rate``).
    """
    ks = sorted(frame["k"].unique())
    fig = make_subplots(rows=1, cols=len(ks), subplot_titles=[f"pass@{k}" for k in ks], shared_yaxes=True)
    for col, k in enumerate(ks, start=1):
        sub = frame[frame["k"] == k]
        for name in dict.fromkeys(sub["lens"]):
            rows = sub[sub["lens"] == name]
            fig.add_trace(go.Bar(x=rows["set"], y=rows["pass_rate"], name=LENS_NAMES.get(name, name), legendgroup=name,
                                 showlegend=col == 1, marker_color=LENS_COLORS.get(name),
                                 hovertemplate="%{x}: %{y:.0%}<extra>" + name + "</extra>"), row=1, col=col)
    fig.update_yaxes(tickformat=".0%", range=[0, 1])
    fig.update_layout(barmode="group", height=360, margin={"l": 10, "r": 10, "t": 40, "b": 10})
    return fig


__all__ = ["eval_curves_figure", "pass_at_k_figure"]
