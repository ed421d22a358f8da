"""How often a lens's cells are unstable on held-out prose, and whether the flag means something (docs/method.md §6.2).

For a lens with split halves (``lens.halves()``, or ``--halves EVEN ODD``), reads held-out prose (the corpus's
``eval`` split, never fitted on) with stability marks and reports, per layer below the output:

* the fraction of cells flagged unstable (the shown token not within the top ``--stability-k`` under both halves);
* how often a cell's top-1 agrees with the model's own final top-1 at that position, for stable and for
  unstable cells apart (with Wilson 95 % intervals). The flag's point: unstable cells should agree less.
  Unstable cells gather in early layers, so the summary also compares them within layers (layer-matched).

Positions before the lens's ``skip_first`` (never fitted) and the output row (the model itself) are left out.

    python scripts/stability_figures.py --lens assets/lenses/smollm2-135m.safetensors --out runs/stability

writes ``stability_by_layer.csv``, ``stability_summary.json`` and (with matplotlib) ``stability_by_layer.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from jlens_core import load_corpus, load_model, read_prompt
from jlens_core.interventions.intervals import wilson_interval
from jlens_core.lenses.loading import load_lens
from jlens_core.reading.stability import STABILITY_K, lens_halves

COLUMNS = ("layer", "n_cells", "n_unstable", "unstable_fraction", "agree_stable", "agree_stable_low",
           "agree_stable_high", "agree_unstable", "agree_unstable_low", "agree_unstable_high")


def _rate(hits: int, n: int) -> tuple[float, float, float]:
    """``(hits / n, low, high)`` with the Wilson 95 % interval (NaN for ``n = 0``)."""
    low, high = wilson_interval(hits, n)
    return (hits / n if n else float("nan")), low, high


def stability_figures(model: Any, lens: Any, texts: Sequence[str], *, halves: tuple[Any, Any] | None = None,
                      stability_k: int = STABILITY_K, max_seq_len: int = 128,
                      progress: bool = False) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Per layer: unstable fraction and top-1 agreement with the model's output, stable vs unstable cells.

    Returns:
        ``(per_layer, summary)``: a frame with :data:`COLUMNS` (one row per source layer) and the totals over
        every layer (``agree_stable``, ``agree_unstable`` with intervals, ``unstable_fraction``, counts).

    Raises:
        ValueError: the lens has no halves and none are given.
    """
    pair = halves or lens_halves(lens)
    if pair is None:
        raise ValueError("This lens keeps no split halves: pass halves=(even, odd) (--halves EVEN ODD), or refit it "
                         "with `jlens fit` (halves are kept by default).")
    counts: dict[int, np.ndarray] = {}  # layer -> [cells, unstable, stable & agree, unstable & agree]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(texts), desc="reading", unit="text", file=sys.stderr)
    for text in texts:
        reading = read_prompt(model, lens, text, halves=pair, stability_k=stability_k, max_seq_len=max_seq_len,
                              top_k=1)
        fitted = reading.fitted  # [n_positions]
        agree = reading.top_ids[:, :, 0] == reading.final_top1_ids[None, :]  # [n_layers, n_positions]
        stable = reading.stability.stable
        for li, layer in enumerate(reading.layers):
            if layer == reading.output_layer:
                continue
            s, a = stable[li, fitted], agree[li, fitted]
            row = counts.setdefault(layer, np.zeros(4, dtype=np.int64))
            row += [len(s), int((~s).sum()), int((s & a).sum()), int((~s & a).sum())]
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    rows = []
    for layer in sorted(counts):
        n, unstable, agree_s, agree_u = (int(x) for x in counts[layer])
        rows.append({"layer": layer, "n_cells": n, "n_unstable": unstable,
                     "unstable_fraction": unstable / n if n else float("nan"),
                     **dict(zip(COLUMNS[4:7], _rate(agree_s, n - unstable))),
                     **dict(zip(COLUMNS[7:], _rate(agree_u, unstable)))})
    total = np.sum(list(counts.values()), axis=0) if counts else np.zeros(4, dtype=np.int64)
    n, unstable, agree_s, agree_u = (int(x) for x in total)
    stable_rate, unstable_rate = _rate(agree_s, n - unstable), _rate(agree_u, unstable)
    summary = {"n_texts": len(texts), "n_cells": n, "n_unstable": unstable,
               "unstable_fraction": unstable / n if n else float("nan"), "stability_k": int(stability_k),
               "agree_stable": stable_rate[0], "agree_stable_ci": list(stable_rate[1:]),
               "agree_unstable": unstable_rate[0], "agree_unstable_ci": list(unstable_rate[1:]),
               **_layer_matched(counts)}
    return pd.DataFrame(rows, columns=list(COLUMNS)), summary


def _layer_matched(counts: dict[int, np.ndarray]) -> dict[str, float]:
    """Stable vs unstable agreement within layers: unstable cells gather in early layers, where every cell agrees
    less, so the pooled rates mix the flag with the depth. Over the layers with both kinds of cells, the unstable
    cells' agreement against the stable cells' agreement of their own layers (each layer weighted by its unstable
    cells; a direct standardisation)."""
    both = [c for c in counts.values() if 0 < c[1] < c[0]]
    weight = sum(int(c[1]) for c in both)
    if not weight:
        return {"matched_layers": 0, "agree_stable_layer_matched": float("nan"),
                "agree_unstable_layer_matched": float("nan")}
    stable = sum(int(c[1]) * int(c[2]) / int(c[0] - c[1]) for c in both) / weight
    unstable = sum(int(c[3]) for c in both) / weight
    return {"matched_layers": len(both), "agree_stable_layer_matched": stable,
            "agree_unstable_layer_matched": unstable}


def plot(per_layer: pd.DataFrame, path: Path, title: str) -> Path | None:
    """Two panels: the unstable fraction per layer, and the agreement with the model's output for stable vs
    unstable cells (with intervals). None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    x = per_layer["layer"].to_numpy()
    top.bar(x, per_layer["unstable_fraction"], color="#888888")
    top.set_ylabel("unstable cells")
    top.set_ylim(0, 1)
    for name, colour in (("stable", "#1f77b4"), ("unstable", "#d62728")):
        y = per_layer[f"agree_{name}"].to_numpy()
        err = np.abs(np.vstack([y - per_layer[f"agree_{name}_low"], per_layer[f"agree_{name}_high"] - y]))
        bottom.errorbar(x, y, yerr=err, marker="o", ms=3, capsize=2, color=colour, label=f"{name} cells")
    bottom.set_ylabel("top-1 = model's own top-1")
    bottom.set_xlabel("layer")
    bottom.set_ylim(0, 1)
    bottom.legend()
    top.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lens", required=True, help="a lens file with halves (or a shipped lens name)")
    parser.add_argument("--halves", nargs=2, default=None, metavar=("EVEN", "ODD"),
                        help="the halves as two lens files, for a lens file without them")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--corpus", default="stdlib-docs")
    parser.add_argument("--n-texts", type=int, default=40)
    parser.add_argument("--max-seq-len", type=int, default=128)
    parser.add_argument("--stability-k", type=int, default=STABILITY_K)
    parser.add_argument("--out", default="runs/stability")
    args = parser.parse_args(argv)
    model = load_model(args.model)
    lens = load_lens(args.lens, model=model)
    halves = tuple(load_lens(p, model=model) for p in args.halves) if args.halves else None
    texts = load_corpus(args.corpus, split="eval", n=args.n_texts)
    started = time.perf_counter()
    try:
        per_layer, summary = stability_figures(model, lens, texts, halves=halves,  # type: ignore[arg-type]
                                               stability_k=args.stability_k, max_seq_len=args.max_seq_len,
                                               progress=True)
    except ValueError as exc:
        print(f"stability_figures: {exc}", file=sys.stderr)
        return 2
    summary.update(lens=str(args.lens), model=str(model.name), corpus=args.corpus, split="eval",
                   max_seq_len=args.max_seq_len, seconds=round(time.perf_counter() - started, 1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    per_layer.to_csv(out / "stability_by_layer.csv", index=False)
    (out / "stability_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    figure = plot(per_layer, out / "stability_by_layer.png",
                  f"{Path(str(args.lens)).name}: {summary['n_cells']} cells of {len(texts)} held-out texts")
    print(per_layer.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"\nunstable {summary['unstable_fraction']:.1%} of cells; top-1 = model's own: stable cells "
          f"{summary['agree_stable']:.1%} [{summary['agree_stable_ci'][0]:.1%}, {summary['agree_stable_ci'][1]:.1%}], "
          f"unstable cells {summary['agree_unstable']:.1%} [{summary['agree_unstable_ci'][0]:.1%}, "
          f"{summary['agree_unstable_ci'][1]:.1%}] ({summary['seconds']} s)")
    print(f"within layers ({summary['matched_layers']} layers with both kinds, weighted by unstable cells): "
          f"stable {summary['agree_stable_layer_matched']:.1%}, unstable {summary['agree_unstable_layer_matched']:.1%}")
    print(f"Wrote {out / 'stability_by_layer.csv'}, {out / 'stability_summary.json'}"
          + (f", {figure}" if figure else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
