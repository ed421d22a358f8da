"""The fit's per prompt x layer diagnostics as tables for plots.

A fit keeps one record per prompt x source layer (``lens.diagnostics``, and the
``<lens>.diagnostics.jsonl`` that ``jlens fit`` streams): the convergence of the running mean
(relative change vs prompts averaged, which falls about as ``1/n`` once settled) and the per-prompt
Jacobian norms ``||J_l^prompt||_F / sqrt(d)`` (heavy-tailed outliers stand out).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd

log = logging.getLogger(__name__)

DIAGNOSTIC_COLUMNS = ("prompt_index", "layer", "seq_len", "n_valid", "seconds", "jacobian_norm", "rel_change",
                      "n_prompts")


def read_diagnostics(path: str | os.PathLike) -> list[dict]:
    """Records of a ``<lens>.diagnostics.jsonl`` file, skipping a partly written last line.

    A fit appends one JSON record per prompt x layer and flushes once per prompt, so a reader may
    see half a line at the end; it is left out. A missing file reads as no records.
    """
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                log.debug("%s:%d: not (yet) a complete JSON record; skipped", path, lineno)
                continue
            if isinstance(rec, dict):
                records.append(rec)
    return records


def diagnostics_frame(records: Iterable[dict]) -> pd.DataFrame:
    """The fit's per prompt x layer records as a table, with ``n_prompts`` added.

    ``n_prompts`` is the number of prompts in the running mean after this one (1 for the first
    prompt that counted; skipped prompts have no records and do not count). ``rel_change`` is NaN
    where undefined (the first prompt).

    Returns:
        DataFrame with columns :data:`DIAGNOSTIC_COLUMNS`, sorted by prompt then layer.
    """
    frame = pd.DataFrame(list(records))
    if frame.empty:
        return pd.DataFrame({c: pd.Series(dtype="float64") for c in DIAGNOSTIC_COLUMNS})
    for col in DIAGNOSTIC_COLUMNS[:-1]:
        if col not in frame:
            frame[col] = np.nan
    frame = frame[list(DIAGNOSTIC_COLUMNS[:-1])].copy()
    frame["rel_change"] = pd.to_numeric(frame["rel_change"], errors="coerce").astype("float64")
    frame["jacobian_norm"] = pd.to_numeric(frame["jacobian_norm"], errors="coerce").astype("float64")
    frame = frame.drop_duplicates(["prompt_index", "layer"], keep="last")
    order = {idx: i + 1 for i, idx in enumerate(sorted(frame["prompt_index"].unique()))}
    frame["n_prompts"] = frame["prompt_index"].map(order).astype("int64")
    return frame.sort_values(["prompt_index", "layer"]).reset_index(drop=True)


def convergence_frame(diagnostics: pd.DataFrame | Iterable[dict]) -> pd.DataFrame:
    """Relative change of the running mean per layer vs prompts averaged, for a log-log plot.

    Returns:
        DataFrame ``n_prompts, layer, rel_change`` of the records where it is defined and positive.
    """
    frame = diagnostics if isinstance(diagnostics, pd.DataFrame) else diagnostics_frame(diagnostics)
    if frame.empty:
        return pd.DataFrame({"n_prompts": pd.Series(dtype="int64"), "layer": pd.Series(dtype="int64"),
                             "rel_change": pd.Series(dtype="float64")})
    out = frame.loc[frame["rel_change"].notna() & (frame["rel_change"] > 0), ["n_prompts", "layer", "rel_change"]]
    return out.reset_index(drop=True)


def one_over_n_guide(convergence: pd.DataFrame) -> pd.DataFrame:
    """A ``c / n`` reference line for :func:`convergence_frame`, through the median of the last half.

    ``c`` is the median over the records of the later half of the prompts of ``rel_change * n``,
    so the guide sits on the curves where they have settled. The relative shift of the running mean
    falls about as ``1/n`` only once settled (docs/method.md §3): the first prompts' shifts carry
    their own prompt-to-prompt spread, so a guide anchored at the start (the median of the first
    records times 2, as the CLI's PNG once drew) is offset from the settled curves by however
    unusual those prompts were. Anchoring where the curves have settled makes a gap between curve
    and guide mean what it should: the fit has not settled yet, or falls slower than ``1/n``. The
    app's chart and :func:`jlens_core.figures.png_plots.plot_convergence` both draw this guide.

    Returns:
        DataFrame ``n_prompts, rel_change`` (two points, first and last prompt), empty when there
        is nothing to guide.
    """
    if convergence.empty:
        return pd.DataFrame({"n_prompts": pd.Series(dtype="float64"), "rel_change": pd.Series(dtype="float64")})
    n = convergence["n_prompts"].astype("float64")
    late = convergence[n >= n.max() / 2]
    c = float(np.median(late["rel_change"] * late["n_prompts"]))
    lo, hi = float(n.min()), float(n.max())
    return pd.DataFrame({"n_prompts": [lo, hi], "rel_change": [c / lo, c / hi]})


def norm_matrix(diagnostics: pd.DataFrame | Iterable[dict]) -> pd.DataFrame:
    """``||J_l^prompt||_F / sqrt(d)`` as a prompt x layer table (index ``prompt_index``, columns layers)."""
    frame = diagnostics if isinstance(diagnostics, pd.DataFrame) else diagnostics_frame(diagnostics)
    if frame.empty:
        return pd.DataFrame()
    return frame.pivot_table(index="prompt_index", columns="layer", values="jacobian_norm", aggfunc="last")


def half_agreement_frame(records: Iterable[dict]) -> pd.DataFrame:
    """The split halves' agreement by layer (docs/method.md §3.3) from a fit's records, as it stands after the
    last prompt: per layer its last ``half_rel_diff`` and the ``predicted_rel_se`` of the full mean that gives
    (:func:`~jlens_core.lenses.lens.predicted_rel_se`, with the prompts of each half counted in the records). The same
    numbers as :meth:`~jlens_core.lenses.lens.JacobianLens.half_diagnostics` of the fit's lens in one process;
    under ``torchrun``, each record is its rank's view between syncs.

    Returns:
        DataFrame ``layer, n_even, n_odd, half_rel_diff, predicted_rel_se``; empty when no record has both
        halves yet (a fit without halves, or before its second prompt).
    """
    from ..lenses.lens import predicted_rel_se  # the one formula (torch: imported when a frame is made)

    columns = ["layer", "n_even", "n_odd", "half_rel_diff", "predicted_rel_se"]
    rows = [r for r in records if r.get("half") in (0, 1)]
    halves = {r["prompt_index"]: r["half"] for r in rows}
    n_odd = sum(halves.values())
    n_even = len(halves) - n_odd
    last: dict[int, float] = {}
    for r in rows:
        if r.get("half_rel_diff") is not None:
            last[int(r["layer"])] = float(r["half_rel_diff"])
    if not last or not n_even or not n_odd:
        return pd.DataFrame({c: pd.Series(dtype="float64") for c in columns})
    return pd.DataFrame([{"layer": layer, "n_even": n_even, "n_odd": n_odd, "half_rel_diff": rel,
                          "predicted_rel_se": predicted_rel_se(rel, n_even, n_odd)} for layer, rel in sorted(last.items())])


__all__ = ["DIAGNOSTIC_COLUMNS", "convergence_frame", "diagnostics_frame", "half_agreement_frame", "norm_matrix",
           "one_over_n_guide", "read_diagnostics"]
