"""How a reading shows itself in Jupyter (``PromptReading._repr_html_``): a compact heatmap, offline.

Plotly's own notebook renderer is followed: plotly.js is written into the notebook once per kernel (its
``notebook`` renderer's ``activate``, the bundle as a ``<script>``, not fetched), and each reading's output
is the figure's HTML without the bundle (``include_plotlyjs=False``: tens of kilobytes, drawn with the
``window.Plotly`` the first output defined). Not ``include_plotlyjs="cdn"``: that fetches the bundle from the
network. Not ``"require"``: plotly 6+ no longer loads through require.js and writes the whole 4.8 MB bundle
into every output, as ``True`` does. No MathJax either (the renderer's default fetches it from a CDN).

Without plotly the hook returns None and Jupyter falls back to the reading's ``repr``.
"""

from __future__ import annotations

import sys
from typing import Any

COMPACT: dict[str, Any] = {"hover_k": 5, "max_text_cells": 1500}  # fewer tokens per hover; text in small grids
_BUNDLE_WRITTEN = {"done": False}  # plotly.js written into this kernel's notebook


def compact_figure(reading: Any) -> Any:
    """The reading's heatmap, compact: top-1 probability, 5 tokens per hover, at most 600 px high."""
    from .heatmaps import reading_figure

    fig = reading_figure(reading, "top1_prob", **COMPACT)
    fig.update_layout(height=min(600, int(fig.layout.height or 600)))
    return fig


def write_bundle_once() -> bool:
    """Write plotly.js into the running notebook once (Plotly's ``notebook`` renderer); False outside IPython."""
    if _BUNDLE_WRITTEN["done"]:
        return True
    shell = sys.modules.get("IPython")
    if shell is None or shell.get_ipython() is None:
        return False
    import plotly.io as pio

    pio.renderers["notebook"].activate()
    _BUNDLE_WRITTEN["done"] = True
    return True


def reading_html(reading: Any) -> str | None:
    """The compact heatmap as an HTML fragment without the plotly.js bundle (None without plotly)."""
    try:
        import plotly.io as pio

        fig = compact_figure(reading)
    except ImportError:
        return None
    write_bundle_once()
    return pio.to_html(fig, full_html=False, include_plotlyjs=False, include_mathjax=False,
                       config={"displaylogo": False})


__all__ = ["COMPACT", "compact_figure", "reading_html", "write_bundle_once"]
