"""Pinned tokens' rank across layers at one position, per lens (the cell detail's lower figure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .labels import LENS_DASHES, LENS_NAMES, esc
from .plotly_lib import go


def pinned_ranks_figure(readings: Mapping[str, Any], position: int) -> go.Figure | None:
    """Rank across layers of each pinned token at ``position``, per lens (log scale, rank 1 on top).

    Args:
        readings: ``{lens name: PromptReading}`` (a ``None`` value is skipped).
        position: a read position (model index).

    Returns:
        The figure, or None when no reading has a pinned token read at ``position``.
    """
    fig = go.Figure()
    for name, reading in readings.items():
        if reading is None or not reading.pinned:
            continue
        try:
            pi = reading.position_index(position)
        except KeyError:
            continue
        for token, ranks in reading.pinned_ranks.items():
            fig.add_trace(go.Scatter(x=reading.layers, y=ranks[:, pi], mode="lines+markers",
                                     name=f"{esc(repr(token))} · {LENS_NAMES.get(name, name)}",
                                     line={"dash": LENS_DASHES.get(name, "dot")},
                                     hovertemplate="layer %{x}: rank %{y}<extra>%{fullData.name}</extra>"))
    if not fig.data:
        return None
    fig.update_yaxes(type="log", autorange="reversed", title="rank (1 = top)")
    fig.update_xaxes(title="layer")
    fig.update_layout(height=320, margin={"l": 10, "r": 10, "t": 40, "b": 10},
                      title=f"Pinned tokens' rank at position {position}")
    return fig


__all__ = ["pinned_ranks_figure"]
