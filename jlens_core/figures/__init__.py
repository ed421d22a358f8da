"""Plotly figures of readings, evaluations, interventions and fits: the app draws these, a notebook too.

One module per kind of figure: :mod:`.heatmaps` (the layer x position heatmap: one lens, side by
side, difference, stacked), :mod:`.ranks` (pinned tokens' rank across layers), :mod:`.tokens` (top-k
bars of a cell, most common tokens), :mod:`.generation` (a continuation's next-token distribution),
:mod:`.interventions` (a clean and an edited run), :mod:`.evaluation` (per-layer KL / CE curves,
pass@k, swap success), :mod:`.fitting` (convergence, Jacobian norms and spectra, tuned-lens
training), :mod:`.debugging` (two runs' divergence) and :mod:`.html_page` (a reading as one offline
HTML file). :mod:`.png_plots` writes static matplotlib PNGs (the CLI's ``--plot``,
``pip install jacobian-lens[plot]``). :mod:`.labels` holds the names, colours and token text they share (no plotly).

plotly is an optional dependency (``pip install jacobian-lens[app]``); importing a figure module without it
raises an ImportError that says so. Every number comes from the objects drawn: nothing is computed here
but the colour scales.
"""
