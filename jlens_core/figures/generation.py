"""A continuation's figure: at each generated step, the model's probability of the token it wrote and of its top-1."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .labels import GENERATED_COLOUR, esc, shown
from .plotly_lib import go


def generation_figure(generation: Any, decode: Callable[[Sequence[int]], str], *, k: int = 5) -> go.Figure:
    """Per generated token: the probability the model gave it (bars) and its top-1 probability (line),
    the step's top-k in the hover.

    Args:
        generation: a :class:`~jlens_core.reading.generation.Generation`.
        decode: names token ids (``model.decode``).
        k: tokens listed in each step's hover.
    """
    ids = np.asarray(generation.generated_ids).tolist()
    top_ids, top_probs = np.asarray(generation.top_ids), np.asarray(generation.top_probs)
    names: dict[int, str] = {}

    def name(token_id: int) -> str:
        if token_id not in names:
            names[token_id] = esc(shown(decode([int(token_id)])))
        return names[token_id]

    chosen, hover = [], []
    for step, token in enumerate(ids):
        row_ids, row_probs = top_ids[step].tolist(), top_probs[step].tolist()
        chosen.append(row_probs[row_ids.index(token)] if token in row_ids else np.nan)
        hover.append(f"step {step}: <b>{name(token)}</b><br>" + "<br>".join(
            f"{j + 1}. {name(i)}  {p:.1%}" for j, (i, p) in enumerate(zip(row_ids[:k], row_probs[:k]))))
    steps = list(range(len(ids)))
    fig = go.Figure()
    fig.add_trace(go.Bar(x=steps, y=chosen, name="written token", marker_color=GENERATED_COLOUR, hovertext=hover,
                         hovertemplate="%{hovertext}<extra></extra>"))
    fig.add_trace(go.Scatter(x=steps, y=top_probs[:, 0] if len(ids) else [], mode="lines+markers", name="top-1",
                             line={"color": "#333", "dash": "dot"}, hoverinfo="skip"))
    fig.update_xaxes(tickvals=steps, ticktext=[name(t) for t in ids], tickangle=-60, title="generated token")
    fig.update_yaxes(tickformat=".0%", range=[0, 1], title="model probability")
    fig.update_layout(height=340, margin={"l": 10, "r": 10, "t": 50, "b": 10}, hovermode="closest",
                      title=f"The model's continuation ({len(ids)} tokens, {generation.stop_reason}); "
                            "bars missing: the token was outside the step's top-k (sampled)")
    return fig


__all__ = ["generation_figure"]
