"""The plotly import the figure modules share, with the sentence that says how to install it."""

from __future__ import annotations

try:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
except ImportError as exc:  # pragma: no cover - plotly is in the app and dev extras
    raise ImportError("jlens's figures need plotly: pip install jlens[app] (or pip install plotly).") from exc

__all__ = ["go", "make_subplots"]
