"""Lenses compared under one protocol: macro pass@k with paired intervals (docs/method.md §8, §9.1).

:func:`macro_comparison` takes the per-word tables :func:`~jlens_core.evaluation.passk.pass_at_k_detail`
writes (``pass_at_k_detail.csv``; several runs, e.g. the ``all`` and ``word`` readouts, concatenated)
and scores every lens x readout on the same items:

* **Item score**: the fraction of the item's scored intermediates whose best rank is ``<= k``
  (copied intermediates left out with ``exclude_copied``); **set score**: the mean over its scored
  items; **macro**: the unweighted mean over the sets (the ``macro mean`` row of ``jlens eval``).
* **Intervals**: a stratified, paired percentile bootstrap. Each replicate resamples the items of
  every set with replacement, the same draw for every variant, so the interval of a *difference*
  (variant minus baseline) and of a *ratio* (variant over baseline) account for the items both were
  scored on. A difference whose interval excludes 0 is a win or a loss; otherwise it is a tie.
* **Held-out items**: ``keep`` restricts the comparison to some items (e.g. those a learned lens's
  weights never saw, :func:`heldout_items`).

:func:`gap_comparison` scores the decoy control the same way: per lens, the gap between its real
intermediates and their decoys (``jlens eval --decoys``), and that gap against the baseline lens's gap,
paired on the same items and the same resamples.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Collection, Iterable, Sequence

import numpy as np
import pandas as pd

from ..corpus import check_heldout_fraction, heldout_score
from .labelled_items import set_name_of
from .passk import load_eval_set

N_BOOT = 2000

BOTH_HALVES_COLUMNS = ("both_halves", "both_low", "both_high")  # with the halves' ranks (docs/method.md §8)
COMPARISON_COLUMNS = ("lens", "vocab", "k", "macro", "ci_low", "ci_high", "baseline", "diff", "diff_low",
                      "diff_high", "ratio", "ratio_low", "ratio_high", "verdict", "n_sets", "items_scored",
                      "words_scored", "exclude_copied")


def _scored_intermediates(detail: pd.DataFrame, exclude_copied: bool) -> pd.DataFrame:
    """The rows that count: scored intermediates (the copied ones left out with ``exclude_copied``)."""
    inter = detail[(detail["role"] == "intermediate") & detail["scored"].astype(bool)]
    if exclude_copied and "copied" in inter:
        inter = inter[~inter["copied"].astype(bool)]
    return inter


def _item_scores(inter: pd.DataFrame, k: int, *, both_halves: bool = False) -> pd.DataFrame:
    """``[item rows, variants]``: each (set, item)'s score per ``(lens, vocab)`` variant (NaN: not scored),
    from :func:`_scored_intermediates`'s rows; ``both_halves``: the score of "found by both halves" instead
    (each half lens ranks the word within the top k, docs/method.md §8; NaN for a lens without halves)."""
    if both_halves:
        inter = inter[inter["best_rank_even"].notna() & inter["best_rank_odd"].notna()]
        passed = ((inter["best_rank_even"] <= k) & (inter["best_rank_odd"] <= k)).astype(float)
    else:
        passed = (inter["best_rank"] <= k).astype(float)
    scores = passed.groupby([inter["set"], inter["item"], inter["lens"], inter["vocab"]]).mean()
    return scores.unstack(["lens", "vocab"])  # index (set, item); columns (lens, vocab)


def _macro(scores: np.ndarray, set_of_row: np.ndarray, n_sets: int) -> np.ndarray:
    """``[..., variants]``: the mean over sets of the mean over each set's rows (NaN rows left out)."""
    per_set = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a variant that scored no item of a set: NaN, left out
        for s in range(n_sets):
            rows = scores[..., set_of_row == s, :]
            per_set.append(np.nanmean(rows, axis=-2))
        return np.nanmean(np.stack(per_set, axis=0), axis=0)


def _stratified_draws(rng: np.random.Generator, set_of_row: np.ndarray, n_sets: int, n_boot: int) -> np.ndarray:
    """``[n_boot, items]``: row indices, each replicate resampling every set's rows with replacement (the same
    draw is then shared by every variant: the pairing)."""
    return np.concatenate([rng.choice(np.flatnonzero(set_of_row == s), size=(n_boot, int((set_of_row == s).sum())))
                           for s in range(n_sets)], axis=1)


def _select_items(frame: pd.DataFrame, keep: Collection[tuple[str, int]] | None) -> pd.DataFrame:
    if keep is None:
        return frame
    wanted = {(str(s), int(i)) for s, i in keep}
    return frame[np.asarray([(str(s), int(i)) in wanted for s, i in zip(frame["set"], frame["item"])], dtype=bool)]


def _check_detail(detail: pd.DataFrame, name: str = "detail") -> pd.DataFrame:
    need = {"set", "item", "lens", "role", "scored", "best_rank"}
    missing = sorted(need - set(detail.columns))
    if missing:
        raise ValueError(f"The {name} table lacks columns {missing}: give pass_at_k_detail.csv as jlens eval writes it.")
    return detail if "vocab" in detail else detail.assign(vocab="all")


def macro_comparison(detail: pd.DataFrame, k: Sequence[int] | int = (1, 5, 10), *,
                     baseline: tuple[str, str] | str = "jacobian", exclude_copied: bool = False,
                     keep: Collection[tuple[str, int]] | None = None, n_boot: int = N_BOOT,
                     seed: int = 0) -> pd.DataFrame:
    """Macro pass@k of every lens x readout in ``detail``, with paired bootstrap intervals against ``baseline``.

    Args:
        detail: per-word rows with columns ``set, item, lens, vocab, role, scored, best_rank`` (and
            ``copied``), as in ``pass_at_k_detail.csv``; several runs may be concatenated.
        k: one or more cut-offs (>= 1).
        baseline: the variant the differences are taken against, ``(lens, vocab)`` or a lens name
            (then its ``"all"`` readout).
        exclude_copied: leave intermediates the prompt already holds out of every score.
        keep: ``(set, item)`` pairs to score (default: every item).
        n_boot, seed: the bootstrap (replicates, seed).

    Returns:
        One row per variant x k, columns :data:`COMPARISON_COLUMNS`: ``macro`` and its 95 % interval;
        ``diff`` = macro - baseline's and ``ratio`` = macro / baseline's, each with a paired 95 %
        interval; ``verdict`` ``"win"``/``"loss"`` when the difference's interval excludes 0, else
        ``"tie"`` (``"baseline"`` on the baseline's own row); coverage (``n_sets``, ``items_scored``,
        ``words_scored``). When ``detail`` has the halves' ranks (``pass_at_k_detail(..., stability=True)``),
        three more columns: ``both_halves`` (the macro share found by *both* half lenses, docs/method.md §8)
        and its interval ``both_low`` / ``both_high`` (the same resamples; NaN for a lens without halves).

    Raises:
        ValueError: a ``k`` below 1, a detail frame without the needed columns, no scored item left
            (after ``keep``), or a baseline that is not in ``detail``.
    """
    ks = [k] if isinstance(k, int) else [int(x) for x in k]
    if not ks or any(x < 1 for x in ks):
        raise ValueError(f"k={k} must be one or more integers >= 1 (ranks are 1-based: k=1 is top-1).")
    frame = _select_items(_check_detail(detail), keep)
    base = (baseline, "all") if isinstance(baseline, str) else (str(baseline[0]), str(baseline[1]))
    inter = _scored_intermediates(frame, exclude_copied)
    with_halves = all(column in inter for column in ("best_rank_even", "best_rank_odd"))
    words_per_variant = inter.groupby(["lens", "vocab"]).size()  # [variants]
    rng = np.random.default_rng(seed)
    rows = []
    for kk in ks:
        table = _item_scores(inter, kk)
        if table.empty:
            raise ValueError("No scored intermediate is left to compare: check the detail table and the items kept.")
        variants = list(table.columns)
        if base not in variants:
            raise ValueError(f"The baseline {base[0]!r} (readout {base[1]!r}) is not in the detail table, which holds "
                             f"{', '.join(f'{lens} ({vocab})' for lens, vocab in variants)}.")
        set_names = list(dict.fromkeys(table.index.get_level_values(0)))
        set_of_row = np.asarray([set_names.index(s) for s in table.index.get_level_values(0)])
        values = table.to_numpy(dtype=np.float64)  # [items, variants]
        point = _macro(values, set_of_row, len(set_names))  # [variants]
        # one stratified draw per replicate, shared by every variant (paired)
        draws = _stratified_draws(rng, set_of_row, len(set_names), n_boot)  # [n_boot, items]
        replicates = _macro(values[draws], set_of_row[draws[0]], len(set_names))  # [n_boot, variants]
        b = variants.index(base)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratios = replicates / replicates[:, b:b + 1]
        ratios[~np.isfinite(ratios)] = np.nan  # a resample where the baseline finds nothing has no ratio
        diffs = replicates - replicates[:, b:b + 1]
        both = _both_halves_macro(inter, kk, variants, table.index, draws, set_of_row, len(set_names)) \
            if with_halves else None
        for j, (lens, vocab) in enumerate(variants):
            low, high = np.nanpercentile(diffs[:, j], [2.5, 97.5])
            r_low, r_high = (np.nanpercentile(ratios[:, j], [2.5, 97.5]) if np.isfinite(ratios[:, j]).any()
                             else (math.nan, math.nan))
            verdict = "baseline" if j == b else ("win" if low > 0 else "loss" if high < 0 else "tie")
            column = values[:, j]
            rows.append({"lens": lens, "vocab": vocab, "k": kk, "macro": float(point[j]),
                         "ci_low": float(np.nanpercentile(replicates[:, j], 2.5)),
                         "ci_high": float(np.nanpercentile(replicates[:, j], 97.5)), "baseline": f"{base[0]} ({base[1]})",
                         "diff": float(point[j] - point[b]), "diff_low": float(low), "diff_high": float(high),
                         "ratio": float(point[j] / point[b]) if point[b] > 0 else math.nan,
                         "ratio_low": float(r_low), "ratio_high": float(r_high), "verdict": verdict,
                         "n_sets": len(set_names), "items_scored": int(np.isfinite(column).sum()),
                         "words_scored": int(words_per_variant[(lens, vocab)]),
                         "exclude_copied": bool(exclude_copied)})
            if both is not None:
                rows[-1].update(dict(zip(BOTH_HALVES_COLUMNS, both[j])))
    return pd.DataFrame(rows, columns=list(COMPARISON_COLUMNS) + (list(BOTH_HALVES_COLUMNS) if with_halves else []))


def _both_halves_macro(inter: pd.DataFrame, k: int, variants: list, index: pd.Index, draws: np.ndarray,
                       set_of_row: np.ndarray, n_sets: int) -> list[tuple[float, float, float]]:
    """Per variant ``(macro, low, high)`` of "found by both halves", on the items and resamples of the main
    comparison (``index``, ``draws``): paired with it."""
    if not (inter["best_rank_even"].notna() & inter["best_rank_odd"].notna()).any():
        return [(math.nan, math.nan, math.nan)] * len(variants)
    table = _item_scores(inter, k, both_halves=True).reindex(index=index, columns=pd.Index(variants))
    values = table.to_numpy(dtype=np.float64)  # [items, variants]
    point = _macro(values, set_of_row, n_sets)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a lens without halves: all NaN
        replicates = _macro(values[draws], set_of_row[draws[0]], n_sets)  # [n_boot, variants]
        low, high = np.nanpercentile(replicates, [2.5, 97.5], axis=0)
    return [(float(p), float(lo), float(hi)) for p, lo, hi in zip(point, low, high)]


GAP_COLUMNS = ("lens", "vocab", "k", "real", "decoy", "gap", "gap_low", "gap_high", "baseline", "gap_diff",
               "gap_diff_low", "gap_diff_high", "verdict", "items_scored")


def gap_comparison(real: pd.DataFrame, decoy: pd.DataFrame, k: int = 10, *, baseline: str = "jacobian",
                   vocab: str = "all", keep: Collection[tuple[str, int]] | None = None, n_boot: int = N_BOOT,
                   seed: int = 0) -> pd.DataFrame:
    """The decoy control per lens: macro pass@k on the real intermediates minus on their decoys, and that gap
    minus ``baseline``'s gap (docs/method.md §8).

    A lens that reads the step finds an item's own intermediates far more often than another item's
    (the decoys, :func:`~jlens_core.evaluation.passk.decoy_items`); one that favours a kind of word finds both.
    Item scores are as in :func:`macro_comparison`; each item's gap is its real score minus its decoy
    score, and the macro of the per-item gap (differences) carries the same stratified bootstrap, one draw
    shared by every lens and by both tables, so the intervals are paired.

    Args:
        real: per-word rows of ``jlens eval`` (``pass_at_k_detail.csv``).
        decoy: the same of ``jlens eval --decoys`` on the same sets (same ``set``/``item`` indices).
        k: the cut-off (>= 1).
        baseline: the lens whose gap the others are set against (it must be in both tables).
        vocab: the readout compared (``"all"`` or ``"word"``).
        keep: ``(set, item)`` pairs to score (default: every item).
        n_boot, seed: the bootstrap (replicates, seed).

    Returns:
        One row per lens in both tables, columns :data:`GAP_COLUMNS`: ``real`` and ``decoy`` macro pass@k;
        ``gap`` (real - decoy, as a macro of item gaps) with its 95 % interval; ``gap_diff`` = gap - the
        baseline's gap with its paired 95 % interval; ``verdict`` ``"win"``/``"loss"``/``"tie"`` on
        ``gap_diff`` (``"baseline"`` on the baseline's row); ``items_scored`` (items with both scores).

    Raises:
        ValueError: ``k`` below 1, a table without the needed columns, no lens in both tables, no scored
            item left, or a baseline missing from either table.
    """
    if k < 1:
        raise ValueError(f"k={k} must be an integer >= 1 (ranks are 1-based: k=1 is top-1).")
    real = _select_items(_check_detail(real, "real"), keep)
    decoy = _select_items(_check_detail(decoy, "decoy"), keep)
    real, decoy = real[real["vocab"] == vocab], decoy[decoy["vocab"] == vocab]
    if real.empty or decoy.empty:
        raise ValueError(f"No scored intermediate is left to compare (readout {vocab!r}): check the tables and the "
                         "items kept.")
    lenses = [lens for lens in dict.fromkeys(real["lens"]) if lens in set(decoy["lens"])]
    if baseline not in lenses:
        raise ValueError(f"The baseline {baseline!r} must be in both the real and the decoy table (readout {vocab!r}); "
                         f"both hold {lenses or 'no lens'}: run jlens eval and jlens eval --decoys with it.")
    suffix = "\x00decoy"  # a lens name no user writes: keeps a lens's real and decoy columns apart
    both = pd.concat([real, decoy.assign(lens=decoy["lens"] + suffix)], ignore_index=True)
    table = _item_scores(_scored_intermediates(both, False), k)
    if table.empty:
        raise ValueError("No scored intermediate is left to compare: check the tables and the items kept.")
    columns = list(table.columns)
    set_names = list(dict.fromkeys(table.index.get_level_values(0)))
    set_of_row = np.asarray([set_names.index(s) for s in table.index.get_level_values(0)])
    values = table.to_numpy(dtype=np.float64)  # [items, lens x {real, decoy}]
    reals = np.stack([values[:, columns.index((lens, vocab))] for lens in lenses], axis=1)  # [items, lenses]
    decoys = np.stack([values[:, columns.index((lens + suffix, vocab))] for lens in lenses], axis=1)
    gaps = reals - decoys  # [items, lenses]
    b = lenses.index(baseline)
    gap_diffs = gaps - gaps[:, b:b + 1]  # [items, lenses]
    n_sets = len(set_names)
    draws = _stratified_draws(np.random.default_rng(seed), set_of_row, n_sets, n_boot)  # [n_boot, items]
    point_gap, point_diff = _macro(gaps, set_of_row, n_sets), _macro(gap_diffs, set_of_row, n_sets)  # [lenses]
    boot_gap = _macro(gaps[draws], set_of_row[draws[0]], n_sets)  # [n_boot, lenses]
    boot_diff = _macro(gap_diffs[draws], set_of_row[draws[0]], n_sets)
    point_real, point_decoy = _macro(reals, set_of_row, n_sets), _macro(decoys, set_of_row, n_sets)
    rows = []
    for j, lens in enumerate(lenses):
        g_low, g_high = np.nanpercentile(boot_gap[:, j], [2.5, 97.5])
        d_low, d_high = np.nanpercentile(boot_diff[:, j], [2.5, 97.5])
        verdict = "baseline" if j == b else ("win" if d_low > 0 else "loss" if d_high < 0 else "tie")
        rows.append({"lens": lens, "vocab": vocab, "k": int(k), "real": float(point_real[j]),
                     "decoy": float(point_decoy[j]), "gap": float(point_gap[j]), "gap_low": float(g_low),
                     "gap_high": float(g_high), "baseline": baseline, "gap_diff": float(point_diff[j]),
                     "gap_diff_low": float(d_low), "gap_diff_high": float(d_high), "verdict": verdict,
                     "items_scored": int(np.isfinite(gaps[:, j]).sum())})
    return pd.DataFrame(rows, columns=list(GAP_COLUMNS))


def heldout_items(sets: Iterable[str], heldout_fraction: float = 0.5, *, seed: int = 0) -> set[tuple[str, int]]:
    """The ``(set, item index)`` pairs :func:`~jlens_core.fitting.expert_weights.split_items` holds out
    (the same seeded hash of each prompt), for scoring a learned lens on items its weights never saw.

    Raises:
        ValueError: ``heldout_fraction`` outside (0, 1); FileNotFoundError / ValueError: a set that cannot be loaded.
    """
    fraction = check_heldout_fraction(heldout_fraction)
    held: set[tuple[str, int]] = set()
    for spec in dict.fromkeys(str(s) for s in sets):
        for index, item in enumerate(load_eval_set(spec)):
            if heldout_score(str(item["prompt"]), seed) < fraction:
                held.add((set_name_of(spec), index))
    return held


__all__ = ["BOTH_HALVES_COLUMNS", "COMPARISON_COLUMNS", "GAP_COLUMNS", "N_BOOT", "gap_comparison", "heldout_items", "macro_comparison"]
