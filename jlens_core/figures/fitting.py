"""Fit figures: convergence of the running mean, per-prompt Jacobian norms, Jacobian spectra, tuned-lens training."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from ..fitting.diagnostics import convergence_frame, diagnostics_frame, norm_matrix, one_over_n_guide
from .labels import LENS_COLORS
from .plotly_lib import go, make_subplots


def convergence_figure(conv: pd.DataFrame, guide: pd.DataFrame | None = None) -> go.Figure:
    """Relative change of the running mean vs prompts averaged, per layer, log-log, with a 1/n guide.

    Args:
        conv: :func:`~jlens_core.fitting.diagnostics.convergence_frame` (``layer, n_prompts, rel_change``).
        guide: :func:`~jlens_core.fitting.diagnostics.one_over_n_guide` of it (None: no guide).
    """
    fig = go.Figure()
    layers = sorted(conv["layer"].unique()) if not conv.empty else []
    n_layers = max(1, len(layers))
    for i, layer in enumerate(layers):
        sub = conv[conv["layer"] == layer]
        colour = f"hsl({int(260 * i / n_layers)}, 65%, 45%)"
        fig.add_trace(go.Scatter(x=sub["n_prompts"], y=sub["rel_change"], mode="lines", name=f"L{layer}",
                                 line={"width": 1.4, "color": colour},
                                 hovertemplate=f"L{layer}" + ": n=%{x}, Δ=%{y:.3g}<extra></extra>"))
    if guide is not None and not guide.empty:
        fig.add_trace(go.Scatter(x=guide["n_prompts"], y=guide["rel_change"], mode="lines", name="1/n guide",
                                 line={"dash": "dash", "color": "black", "width": 2}))
    fig.update_xaxes(type="log", title="prompts averaged")
    fig.update_yaxes(type="log", title="relative change of the running mean")
    fig.update_layout(height=380, margin={"l": 10, "r": 10, "t": 40, "b": 10}, title="Convergence",
                      legend={"font": {"size": 9}})
    return fig


def norm_heatmap(norms: pd.DataFrame) -> go.Figure:
    """Per-prompt ``||J_l||_F / sqrt(d)`` as a prompt x layer heatmap.

    Args:
        norms: :func:`~jlens_core.fitting.diagnostics.norm_matrix` (prompts x layers).
    """
    fig = go.Figure(go.Heatmap(z=norms.to_numpy().T, x=norms.index.tolist(), y=[f"L{c}" for c in norms.columns],
                               colorscale="Magma", colorbar={"title": {"text": "‖J‖F/√d"}},
                               hovertemplate="prompt %{x}, %{y}: %{z:.3g}<extra></extra>"))
    fig.update_xaxes(title="prompt index")
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(height=380, margin={"l": 10, "r": 10, "t": 40, "b": 10}, title="Per-prompt Jacobian norm")
    return fig


def fit_figures(diagnostics: Iterable[dict]) -> tuple[go.Figure, go.Figure]:
    """``(convergence, norms)`` of a fit's diagnostics records, as the Fit page draws them.

    Args:
        diagnostics: ``lens.diagnostics`` of a fitted lens, or a ``.diagnostics.jsonl`` read with
            :func:`~jlens_core.fitting.diagnostics.read_diagnostics`.

    Raises:
        ValueError: no records (a lens fitted without them).
    """
    frame = diagnostics_frame(diagnostics)
    if frame.empty:
        raise ValueError("The lens has no fit diagnostics to draw: fit it with this version of jlens, which keeps them.")
    conv = convergence_frame(frame)
    return convergence_figure(conv, one_over_n_guide(conv)), norm_heatmap(norm_matrix(frame))


def half_agreement_figure(table: pd.DataFrame) -> go.Figure:
    """The split halves' agreement by layer (docs/method.md §3.3): bars of ``||e - o||_F / ||m||_F`` and markers of
    the predicted relative standard error of the full lens, in percent.

    Args:
        table: ``lens.half_diagnostics()`` or :func:`~jlens_core.fitting.diagnostics.half_agreement_frame`
            (``layer, n_even, n_odd, half_rel_diff, predicted_rel_se``).
    """
    fig = go.Figure()
    if not table.empty:
        x = [f"L{layer}" for layer in table["layer"]]
        n = f"{int(table['n_even'].iloc[0])} + {int(table['n_odd'].iloc[0])} prompts"
        fig.add_trace(go.Bar(x=x, y=100 * table["half_rel_diff"], name="halves differ (‖e−o‖/‖J‖)",
                             marker={"color": "#8c96c6"}, hovertemplate="%{x}: %{y:.2f} %<extra>halves</extra>"))
        fig.add_trace(go.Scatter(x=x, y=100 * table["predicted_rel_se"], mode="markers", name="predicted SE of the lens",
                                 marker={"color": "black", "symbol": "line-ew-open", "size": 12, "line": {"width": 2}},
                                 hovertemplate="%{x}: ±%{y:.2f} %<extra>predicted SE</extra>"))
        fig.update_layout(title=f"Halves agreement by layer ({n})")
    else:
        fig.update_layout(title="Halves agreement by layer (none yet)")
    fig.update_yaxes(title="% of ‖J‖F", rangemode="tozero")
    fig.update_layout(height=300, margin={"l": 10, "r": 10, "t": 40, "b": 10}, legend={"font": {"size": 9}},
                      barmode="overlay")
    return fig


def layer_stats_figure(stats: pd.DataFrame) -> go.Figure:
    """Four panels over layers: Frobenius norm / sqrt(d), spectral norm, distance from I, effective rank.

    Args:
        stats: :func:`~jlens_core.lenses.spectra.layer_stats` (``layer, fro_norm, spectral_norm, dist_identity,
            effective_rank``).
    """
    panels = (("fro_norm", "‖J‖F / √d"), ("spectral_norm", "spectral norm"),
              ("dist_identity", "‖J − I‖F / √d"), ("effective_rank", "effective rank"))
    fig = make_subplots(rows=1, cols=4, subplot_titles=[t for _, t in panels], horizontal_spacing=0.06)
    for col, (key, label) in enumerate(panels, start=1):
        fig.add_trace(go.Scatter(x=stats["layer"], y=stats[key], mode="lines+markers", name=label,
                                 line={"color": LENS_COLORS["jacobian"]},
                                 hovertemplate="layer %{x}: %{y:.4g}<extra>" + label + "</extra>"), row=1, col=col)
        fig.update_xaxes(title="layer", row=1, col=col)
    fig.update_layout(height=300, showlegend=False, margin={"l": 10, "r": 10, "t": 40, "b": 10})
    return fig


def spectrum_figure(spectra: Mapping[int, np.ndarray]) -> go.Figure:
    """Singular values (descending, log scale) of one or more layers (``{layer: singular values}``)."""
    fig = go.Figure()
    for layer, s in spectra.items():
        fig.add_trace(go.Scatter(x=np.arange(1, len(s) + 1), y=s, mode="lines", name=f"L{layer}",
                                 hovertemplate="σ%{x}: %{y:.4g}<extra>" + f"L{layer}" + "</extra>"))
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey", annotation_text="identity")
    fig.update_yaxes(type="log", title="singular value")
    fig.update_xaxes(title="index")
    fig.update_layout(height=340, margin={"l": 10, "r": 10, "t": 40, "b": 10}, title="Singular-value spectrum")
    return fig


def tune_figure(history: Sequence[Mapping[str, Any]]) -> go.Figure:
    """Tuned-lens training: KL(final || lens) per step (train batch) and on held-out texts (bits).

    Args:
        history: the training records (``step, train_kl_bits`` and optionally ``heldout_kl_bits``).
    """
    frame = pd.DataFrame(list(history))
    fig = go.Figure()
    if not frame.empty:
        fig.add_trace(go.Scatter(x=frame["step"], y=frame["train_kl_bits"], mode="lines", name="train batch",
                                 line={"color": LENS_COLORS["tuned"]}))
        if "heldout_kl_bits" in frame:
            held = frame.dropna(subset=["heldout_kl_bits"])
            fig.add_trace(go.Scatter(x=held["step"], y=held["heldout_kl_bits"], mode="lines+markers", name="held-out",
                                     line={"color": "#222", "dash": "dot"}))
    fig.update_layout(title="Tuned-lens training: KL(final ‖ lens), mean over layers", height=340,
                      xaxis_title="step", yaxis_title="KL (bits)", margin={"l": 10, "r": 10, "t": 50, "b": 10})
    return fig


__all__ = ["convergence_figure", "fit_figures", "layer_stats_figure", "norm_heatmap", "spectrum_figure",
           "tune_figure"]
