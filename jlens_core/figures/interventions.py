"""Intervention figures: a clean and an edited run's next-token top-k, and swap success per lens and alpha."""

from __future__ import annotations

from typing import Any

import pandas as pd

from .labels import LENS_COLORS, LENS_NAMES
from .plotly_lib import go
from .tokens import topk_bars

CONTROL_COLOURS = {"random": "#999999", "norm-matched": "#555555"}


def run_cells(next_tokens: pd.DataFrame, which: str) -> dict[str, Any]:
    """``{"top_tokens", "top_probs"}`` of one run in a comparison's ``next_tokens`` table (``which``:
    ``"clean"`` or ``"edited"``), as :func:`~jlens_core.figures.tokens.topk_bars` takes a cell."""
    return {"top_tokens": [str(t) for t in next_tokens[f"{which}_token"]],
            "top_probs": [float(p) for p in next_tokens[f"{which}_prob"]]}


def comparison_figure(comparison: Any, *, k: int = 10) -> go.Figure:
    """The next token after the prompt, clean vs edited: top-k bars side by side (the Intervene panel's bars).

    Args:
        comparison: a :class:`~jlens_core.interventions.compare.RunComparison`.
        k: bars per run.
    """
    frame = comparison.next_tokens
    fig = topk_bars({"clean": run_cells(frame, "clean"), "edited": run_cells(frame, "edited")}, k=k)
    first = comparison.first_difference
    fig.update_layout(title="Next token, clean vs edited: " + ("the same continuation" if first is None else
                                                              f"the continuations part at generated token {first}"),
                      margin={"l": 10, "r": 10, "t": 70, "b": 10})
    return fig


def swap_success_figure(summary: pd.DataFrame) -> go.Figure:
    """Swap success rate per lens (and the random controls) against alpha, with 95 % intervals.

    Args:
        summary: :class:`~jlens_core.interventions.swap_success.SwapReport`'s ``summary`` (``lens, alpha,
            rate, ci_low, ci_high, eligible``).
    """
    fig = go.Figure()
    for name in dict.fromkeys(summary["lens"]):
        rows = summary[summary["lens"] == name].sort_values("alpha")
        colour = LENS_COLORS.get(name) or CONTROL_COLOURS.get(name)
        fig.add_trace(go.Scatter(x=rows["alpha"], y=rows["rate"], mode="lines+markers",
                                 name=LENS_NAMES.get(name, name), line={"color": colour},
                                 error_y={"type": "data", "symmetric": False, "array": rows["ci_high"] - rows["rate"],
                                          "arrayminus": rows["rate"] - rows["ci_low"], "thickness": 1},
                                 customdata=rows["eligible"],
                                 hovertemplate="α %{x}: %{y:.0%} of %{customdata} items<extra>" + name + "</extra>"))
    fig.update_yaxes(tickformat=".0%", range=[0, 1], title="answer moved to B")
    fig.update_xaxes(title="α (1 exchanges the coordinates)")
    fig.update_layout(height=360, margin={"l": 10, "r": 10, "t": 40, "b": 10}, title="Swap success")
    return fig


__all__ = ["comparison_figure", "run_cells", "swap_success_figure"]
