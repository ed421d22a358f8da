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
    return _finish(fig, axes, out, title, legend_size=8)


def _finish(fig, axes, out: str | Path, title: str, *, legend_size: int) -> Path:
    """Grid and legend on every panel, the title, then :func:`_save`."""
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=legend_size)
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


def plot_jspace_structure(frame: pd.DataFrame, gains: pd.DataFrame | None, out: str | Path, title: str = "") -> Path:
    """The J-space by layer (docs/method.md §11.6): explained fraction (J, random and shuffled dictionaries) and
    occupancy per gauge, medians with their 95 % bootstrap intervals; and, when ``gains`` has rows, the MLP gain of
    J-lens vectors and of MLP neuron directions (medians, quartile bands).

    Args:
        frame: ``Structure.frame()`` (``layer, gauge`` and each measure with ``_lo`` / ``_hi``).
        gains: ``Structure.mlp_frame()`` or None.
    """
    plt = _pyplot()
    gauges = list(dict.fromkeys(frame["gauge"]))
    panels = 2 + (1 if gains is not None and len(gains) else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4), constrained_layout=True)
    styles = {"centred": "-", "raw": "--"}
    for gauge in gauges:
        part = frame[frame["gauge"] == gauge].sort_values("layer")
        ls = styles.get(gauge, ":")
        for col, colour, name in (("explained", "#d6762b", "J"), ("random_explained", "#777777", "random"),
                                  ("shuffled_explained", "#6c8ebf", "shuffled")):
            axes[0].plot(part["layer"], part[col], ls, color=colour, marker=".", label=f"{name} ({gauge})")
            axes[0].fill_between(part["layer"], part[f"{col}_lo"], part[f"{col}_hi"], color=colour, alpha=0.15)
        for col, colour, name in (("occupancy", "#d6762b", "active atoms (J)"), ("steps90", "#b03a2e", "steps to 90 % (J)"),
                                  ("random_steps90", "#777777", "steps to 90 % (random)")):
            axes[1].plot(part["layer"], part[col], ls, color=colour, marker=".", label=f"{name}, {gauge}")
            axes[1].fill_between(part["layer"], part[f"{col}_lo"], part[f"{col}_hi"], color=colour, alpha=0.15)
    axes[0].set(xlabel="layer", ylabel="explained fraction (median)", title="explained by k atoms", ylim=(0, 1))
    axes[1].set(xlabel="layer", ylabel="atoms", title="occupancy")
    if panels == 3 and gains is not None:
        g = gains.sort_values("layer")
        for col, colour, name in (("jlens_gain", "#d6762b", "J-lens vectors"), ("neuron_gain", "#4c9a5a",
                                                                                 "MLP neuron directions")):
            axes[2].plot(g["layer"], g[col], color=colour, marker=".", label=name)
            axes[2].fill_between(g["layer"], g[f"{col}_q1"], g[f"{col}_q3"], color=colour, alpha=0.15)
        axes[2].axhline(1.0, color="#999999", lw=0.8)
        axes[2].set(xlabel="layer l", ylabel="gain of MLP l+1 (/ isotropic median)", title="MLP gain", yscale="log")
    return _finish(fig, axes, out, title, legend_size=7)
