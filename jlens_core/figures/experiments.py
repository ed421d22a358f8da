"""The figure and the self-contained page of a workspace experiment's result
(:class:`~jlens_core.experiments.core.ExperimentResult`, docs/experiments.md)."""

from __future__ import annotations

import html
import math
from typing import Any

import pandas as pd

from .._version import __version__
from .plotly_lib import go, make_subplots


def _error_bars(summary: pd.DataFrame) -> dict[str, Any]:
    rate = summary["rate"].fillna(0)
    return {"type": "data", "symmetric": False, "array": (summary["wilson_high"] - rate).fillna(0).tolist(),
            "arrayminus": (rate - summary["wilson_low"]).fillna(0).tolist()}


def _second_panel(result: Any) -> tuple[str, list[Any]] | None:
    """The experiment's own panel: the depth test, the report correlation, or the band curve."""
    extras = result.extras
    if "depth" in extras:
        table = extras["depth"]
        return "success by the first swapped layer (depth test)", [
            go.Scatter(x=part["start"], y=part["rate"], mode="lines+markers", name=f"{swap} swap from layer")
            for swap, part in table.groupby("swap")]
    if "report_correlation" in extras:
        table = extras["report_correlation"]
        return "report correlation by layer (Spearman)", [
            go.Scatter(x=table["layer"], y=table["spearman"], mode="lines+markers", name="lens vs output ranks")]
    if "damage" in extras:
        table = extras["damage"]
        return "accuracy by ablation strength", [
            go.Scatter(x=part["strength"], y=part["accuracy"], mode="lines+markers", name=f"{task} · {arm}")
            for (task, arm), part in table.groupby(["task", "arm"])]
    if "by_strength" in extras:
        table = extras["by_strength"]
        return "median reciprocal rank by strength", [
            go.Scatter(x=part["strength"], y=part["median_reciprocal_rank"], mode="lines+markers", name=vector)
            for vector, part in table.groupby("vector")]
    if result.band.curve:
        curve = result.band.curve
        return "band curve", [go.Scatter(x=list(curve), y=list(curve.values()), mode="lines+markers",
                                         name="concept in top 5")]
    return None


def experiment_figure(result: Any) -> go.Figure:
    """Each arm's top-1 success rate with its Wilson 95 % interval (left), and the experiment's own panel (right):
    the depth test, the report correlation by layer or the band curve; the band is shaded."""
    summary = result.summary[result.summary["trials"] > 0]
    panel = _second_panel(result)
    cols = 2 if panel else 1
    fig = make_subplots(rows=1, cols=cols, column_widths=[0.5, 0.5] if panel else None,
                        subplot_titles=["top-1 success by arm (95 % Wilson)"] + ([panel[0]] if panel else []))
    fig.add_trace(go.Bar(x=summary["arm"], y=summary["rate"], error_y=_error_bars(summary), name="top-1",
                         showlegend=False, hovertemplate="%{x}: %{y:.0%}<extra></extra>"), row=1, col=1)
    fig.update_yaxes(range=[0, 1.05], tickformat=".0%", row=1, col=1)
    if panel:
        for trace in panel[1]:
            fig.add_trace(trace, row=1, col=2)
        if "damage" not in result.extras and "by_strength" not in result.extras:
            fig.add_vrect(x0=result.band.layers[0] - 0.5, x1=result.band.layers[-1] + 0.5, fillcolor="#ddd",
                          opacity=0.4, line_width=0, row=1, col=2)
            fig.update_xaxes(title_text="layer", row=1, col=2)
    fig.update_layout(title=f"{result.name} · {result.model} · band {result.band.label} · "
                            f"{result.n_gated}/{len(result.gate)} gated", height=420, margin={"t": 70})
    return fig


def _table(frame: pd.DataFrame) -> str:
    return frame.to_html(index=False, escape=True, na_rep="–", float_format=lambda x: f"{x:.3g}", border=0,
                         classes="tab")


def _value(value: Any) -> str:
    if isinstance(value, pd.DataFrame):
        return _table(value)
    if isinstance(value, dict):
        if value and all(isinstance(v, pd.DataFrame) for v in value.values()):
            return "".join(f"<h4>{html.escape(str(k))}</h4>{_table(v)}" for k, v in value.items())
        return "<table class='tab'>" + "".join(
            f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_number(v))}</td></tr>" for k, v in value.items()) \
            + "</table>"
    return f"<p>{html.escape(_number(value))}</p>"


def _number(value: Any) -> str:
    if isinstance(value, float):
        return "–" if math.isnan(value) else f"{value:.3g}"
    return str(value)


def experiment_page(result: Any) -> str:
    """The result as one self-contained HTML page: settings, figure (Plotly inlined), summary, the experiment's
    own tables, the gate and every trial. Nothing is fetched."""
    figure = experiment_figure(result).to_html(include_plotlyjs=True, full_html=False)
    header = {"experiment": result.name, "model": result.model, "lens": result.lens,
              "band": f"{result.band.label}: {result.band.rule}", "gate": f"{result.n_gated} of {len(result.gate)} passed",
              "time": f"{result.seconds:.1f} s", "jlens": __version__}
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in header.items())
    notes = "".join(f"<p class='note'>{html.escape(n)}</p>" for n in result.notes)
    extras = "".join(f"<h3>{html.escape(k.replace('_', ' '))}</h3>{_value(v)}" for k, v in result.extras.items())
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>jlens experiment · "
            f"{html.escape(result.name)}</title><style>body {{ font-family: system-ui, sans-serif; margin: 1em 2em; }}"
            " table.tab { border-collapse: collapse; font-size: 12px; } table.tab td, table.tab th { padding: 2px 8px;"
            " border-bottom: 1px solid #eee; } .note { color: #a33; } th { text-align: left; }</style></head><body>"
            f"<h2>jlens experiment · {html.escape(result.name)}</h2><table>{rows}</table>{notes}{figure}"
            f"<h3>Summary</h3>{_table(result.summary)}{extras}<h3>Gate</h3>{_table(result.gate)}"
            f"<h3>Trials</h3>{_table(result.trials)}</body></html>")


__all__ = ["experiment_figure", "experiment_page"]
