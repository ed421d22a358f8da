"""The app's figures: the library's (``jlens_core.figures``), re-exported under the names the pages use.

One implementation: a notebook's ``reading.figure()`` and the app's Inspect page draw the same functions.
Nothing here is Streamlit-specific; the pages pass these figures to ``st.plotly_chart``.
"""

from __future__ import annotations

from jlens_core.figures.debugging import divergence_figure
from jlens_core.figures.evaluation import eval_curves_figure, pass_at_k_figure
from jlens_core.figures.fitting import (
           convergence_figure,
           layer_stats_figure,
           norm_heatmap,
           spectrum_figure,
           tune_figure,
)
from jlens_core.figures.heatmaps import cell_from_point, heatmap_figure
from jlens_core.figures.interventions import comparison_figure
from jlens_core.figures.labels import LENS_NAMES, LENS_SHORT, row_labels, shown
from jlens_core.figures.ranks import pinned_ranks_figure
from jlens_core.figures.tokens import topk_bars

__all__ = ["LENS_NAMES", "LENS_SHORT", "cell_from_point", "comparison_figure", "convergence_figure",
           "divergence_figure", "eval_curves_figure", "heatmap_figure", "layer_stats_figure", "norm_heatmap",
           "pass_at_k_figure", "pinned_ranks_figure", "row_labels", "shown", "spectrum_figure", "topk_bars",
           "tune_figure"]
