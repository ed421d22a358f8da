"""The plotly import the figure modules share, with the sentence that says how to install it."""

from __future__ import annotations

from .._extras import require_extra

require_extra("app", "jlens's figures (Plotly)")
import plotly.graph_objects as go  # after the check that names the extra
from plotly.subplots import make_subplots

__all__ = ["go", "make_subplots"]
