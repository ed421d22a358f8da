"""Static (matplotlib) figures for reports and the README: per-layer evaluation curves, fit convergence.

The app draws the same data interactively with Plotly, from the same tables
(:mod:`jlens_core.fitting.diagnostics`); these write PNG files, atomically. matplotlib is an optional
dependency (``pip install jacobian-lens[plot]``). Imports :mod:`jlens_core.fitting` (light: no torch).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from .._atomic import atomic_write
from .._extras import require_extra
from ..fitting.diagnostics import convergence_frame, diagnostics_frame, norm_matrix, one_over_n_guide


def _pyplot():
    require_extra("plot", "PNG plots")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_eval_curves(frame: pd.DataFrame, out: str | Path, title: str = "") -> Path:
    """Per-layer KL(final || lens) and next-token cross-entropy (bits), one line per lens, ±2 SE bands.

    Args:
        frame: the output of :func:`jlens_core.evaluation.by_layer.evaluate` (``lens, layer, kl_bits, ce_bits``
            and optionally ``kl_se, ce_se``).
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for name, part in frame.groupby("lens", sort=False):
        part = part.sort_values("layer")
        for ax, col in zip(axes, ("kl_bits", "ce_bits")):
            ax.plot(part["layer"], part[col], marker=".", label=name)
            se = col.replace("_bits", "_se")
            if se in part:
                ax.fill_between(part["layer"], part[col] - 2 * part[se], part[col] + 2 * part[se], alpha=0.2)
    axes[0].set(xlabel="layer", ylabel="KL(final || lens) [bits]", title="KL to the model's output")
    axes[1].set(xlabel="layer", ylabel="cross-entropy [bits]", title="next-token cross-entropy")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(fig, out)


def plot_convergence(diagnostics: Iterable[dict], out: str | Path, title: str = "") -> Path:
    """Relative change of the running mean vs prompts (log-log, per layer, with the ``1/n`` guide of
    :func:`~jlens_core.fitting.diagnostics.one_over_n_guide`), and the per-prompt Jacobian norm
    ``||J||_F / sqrt(d)`` as a layer x prompt heatmap. The tables are those the app draws.

    Args:
        diagnostics: the fit's records (``lens.diagnostics``, or a ``<lens>.diagnostics.jsonl`` read
            with :func:`~jlens_core.fitting.diagnostics.read_diagnostics`).

    Raises:
        ValueError: no records.
    """
    frame = diagnostics_frame(diagnostics)
    if frame.empty:
        raise ValueError("The lens has no fit diagnostics to plot: fit it with this version of jlens, which keeps them.")
    conv = convergence_frame(frame)
    guide = one_over_n_guide(conv)
    norms = norm_matrix(frame).T  # [layer, prompt]
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), constrained_layout=True)
    layers = sorted(conv["layer"].unique())
    cmap = plt.get_cmap("viridis")
    for i, layer in enumerate(layers):
        part = conv[conv["layer"] == layer]
        axes[0].plot(part["n_prompts"], part["rel_change"], color=cmap(i / max(len(layers) - 1, 1)), lw=1,
                     label=f"layer {layer}" if i in (0, len(layers) - 1) else None)
    if not guide.empty:
        axes[0].plot(guide["n_prompts"], guide["rel_change"], "k--", lw=1, label="∝ 1/n")
    axes[0].set(xscale="log", yscale="log", xlabel="prompts", ylabel="relative change of the running mean",
                title="convergence")
    axes[0].grid(alpha=0.3, which="both")
    if layers:
        axes[0].legend(fontsize=8)
    im = axes[1].imshow(norms.values, aspect="auto", origin="lower", cmap="magma",
                        extent=(0.5, norms.shape[1] + 0.5, norms.index.min() - 0.5, norms.index.max() + 0.5))
    fig.colorbar(im, ax=axes[1], label="||J||_F / sqrt(d)")
    axes[1].set(xlabel="prompt", ylabel="source layer", title="per-prompt Jacobian norm")
    if title:
        fig.suptitle(title)
    return _save(fig, out)


def _save(fig, out: str | Path) -> Path:
    """Write ``fig`` to ``out`` atomically (the format from its suffix, PNG without one) and close it."""
    out = Path(out)
    fmt = out.suffix.lstrip(".").lower() or "png"
    try:
        atomic_write(out, lambda tmp: fig.savefig(tmp, dpi=110, format=fmt))
    finally:
        _pyplot().close(fig)
    return out
