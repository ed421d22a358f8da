"""Fitting a Jacobian lens: ``estimator`` (the per-prompt ``J_l`` of docs/method.md §2), ``fused`` (its analytic
backward for Llama-like layers), ``fit`` (the running mean, checkpoints, sharding, torchrun),
``diagnostics`` (the fit's per prompt x layer records as tables). Imports :mod:`jlens_core.models`,
:mod:`jlens_core.lenses` and the leaves; never :mod:`jlens_core.reading`.
"""
