"""Static (matplotlib) figures for reports and the README: per-layer evaluation curves, fit convergence.

The app draws the same data interactively with Plotly; these write PNG files. matplotlib is an
optional dependency (``pip install jlens[plot]``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("Plots need matplotlib: pip install matplotlib (or jlens[plot]).") from exc
    return plt


def plot_eval_curves(frame: pd.DataFrame, out: str | Path, title: str = "") -> Path:
    """Per-layer KL(final || lens) and next-token cross-entropy (bits), one line per lens, ±2 SE bands.

    Args:
        frame: the output of :func:`jlens_core.reading.evaluation.evaluate` (``lens, layer, kl_bits, ce_bits``
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
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def convergence_frame(diagnostics: list[dict]) -> pd.DataFrame:
    """Diagnostics records to a frame with ``n`` (prompts counted so far, 1-based) per record."""
    frame = pd.DataFrame(diagnostics)
    if frame.empty:
        raise ValueError("The lens has no fit diagnostics to plot.")
    order = {idx: n for n, idx in enumerate(sorted(frame["prompt_index"].unique()), start=1)}
    frame["n"] = frame["prompt_index"].map(order)
    return frame


def plot_convergence(diagnostics: list[dict], out: str | Path, title: str = "") -> Path:
    """Relative change of the running mean vs prompts (log-log, per layer, with a 1/n guide), and the
    per-prompt Jacobian norm ``||J||_F / sqrt(d)`` as a prompt x layer heatmap."""
    plt = _pyplot()
    frame = convergence_frame(diagnostics)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), constrained_layout=True)
    layers = sorted(frame["layer"].unique())
    cmap = plt.get_cmap("viridis")
    for i, layer in enumerate(layers):
        part = frame[(frame["layer"] == layer) & frame["rel_change"].notna()]
        axes[0].plot(part["n"], part["rel_change"], color=cmap(i / max(len(layers) - 1, 1)), lw=1,
                     label=f"layer {layer}" if i in (0, len(layers) - 1) else None)
    rel = frame["rel_change"].dropna()
    if not rel.empty:
        n = np.arange(2, frame["n"].max() + 1)
        axes[0].plot(n, rel.iloc[: len(layers)].median() * 2 / n, "k--", lw=1, label="∝ 1/n")
    axes[0].set(xscale="log", yscale="log", xlabel="prompts", ylabel="relative change of the running mean",
                title="convergence")
    axes[0].grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    grid = frame.pivot_table(index="layer", columns="n", values="jacobian_norm")
    im = axes[1].imshow(grid.values, aspect="auto", origin="lower", cmap="magma",
                        extent=(0.5, grid.shape[1] + 0.5, grid.index.min() - 0.5, grid.index.max() + 0.5))
    fig.colorbar(im, ax=axes[1], label="||J||_F / sqrt(d)")
    axes[1].set(xlabel="prompt", ylabel="source layer", title="per-prompt Jacobian norm")
    if title:
        fig.suptitle(title)
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
