"""Studies over item sets: where a concept first enters a lens's top k, the layer band, per-item trajectories
(docs/method.md §8.1).

:func:`study` reads every item of one or more sets **once** (one forward pass per item: every lens and
layer is read from the same recorded residuals) and keeps, per item x lens x concept, the concept's rank
at every layer at the item's readout position (and, with ``all_positions``, at every position). The items,
readout positions, complete single-token spellings and the unscored rule are pass@k's
(:mod:`~jlens_core.evaluation.passk`, docs/method.md §8).

* **Capability filter**: with ``answered_only`` (on by default when the items carry an ``answer``, else
  a ``target``) an item is kept when the model's greedy next token after the prompt is a first token of
  the answer (the answer's first token with and without a leading space). Counts kept and dropped are
  in :attr:`Study.summary`; an item without an answer is kept and counted as such.
* **Per concept**: its rank by layer, the first layer where it is in the top ``k``, the last layer of
  that run, its best rank (and the layer).
* **Per lens** (over the kept items' scored concepts, the *units*): the fraction in the top ``k`` by layer
  with its 95 % Wilson interval; the first-appearance histogram and its cumulative share; the **band**:
  onset = the first layer whose fraction reaches half the curve's maximum, end = the last layer of the
  contiguous run from the onset that stays at or above it, each with a seeded percentile bootstrap
  interval over items.
* **Lenses compared** (:meth:`Study.compare`) paired over items: the same resampled items for both lenses
  (the lens comparison's stratified draws, :mod:`~jlens_core.evaluation.lens_comparison`).

A :class:`Study` saves to one JSON file that :func:`load_study` reopens without the model, and writes a
self-contained HTML page (:meth:`Study.to_html`).
"""

from __future__ import annotations

import html
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from .._atomic import atomic_write_text
from .._version import __version__
from ..interventions.intervals import wilson_interval
from ..lenses.kinds import is_baseline
from ..lenses.protocol import Lens
from ..models.model import LensModel
from ..reading.inputs import checked_lenses
from ..reading.readout_protocol import Readout, no_other_keywords
from ..reading.tokens import TokenDisplay
from ..reading.word_readout import kept_ids_mask
from .labelled_items import set_name_of
from .lens_comparison import _stratified_draws
from .passk import (
    ItemScanner,
    ProtocolKeywords,
    check_items,
    check_readout_options,
    readout_of,
    word_spellings,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

log = logging.getLogger(__name__)

STUDY_FORMAT = "jlens-study"
STUDY_VERSION = 1
N_BOOT = 1000
ROLES = ("intermediate", "target", "both")
TABLE_COLUMNS = ("set", "item", "lens", "concept", "layer", "position", "readout", "rank")
TABLE_DTYPES = {"set": object, "item": np.int64, "lens": object, "concept": object, "layer": np.int64,
                "position": np.int64, "readout": bool, "rank": np.int64}
ITEM_COLUMNS = ("set", "item", "name", "prompt", "lens", "role", "concept", "scored", "spellings", "position",
                "readout_token", "answer", "answered", "kept", "first_layer", "last_layer", "best_rank", "best_layer",
                "final_rank")
BY_LAYER_COLUMNS = ("set", "lens", "layer", "units", "hits", "fraction", "ci_low", "ci_high", "first_here",
                    "cumulative")
SUMMARY_COLUMNS = ("set", "lens", "kind", "k", "n_items", "kept", "dropped", "no_answer", "items_used", "units",
                   "unscored", "ever", "peak", "peak_layer", "onset", "onset_low", "onset_high", "end", "end_low",
                   "end_high", "mean_first_layer")
COMPARE_COLUMNS = ("set", "lens", "baseline", "k", "items", "onset", "onset_baseline", "onset_diff", "onset_diff_low",
                   "onset_diff_high", "ever", "ever_baseline", "ever_diff", "ever_diff_low", "ever_diff_high",
                   "first_diff", "first_diff_low", "first_diff_high", "verdict")

Progress = Callable[[int, int], None]
ItemsSpec = str | os.PathLike | Sequence[Mapping] | Mapping[str, Any]


class StudyCancelled(Exception):
    """:func:`study` was stopped between items by its ``stop`` callable."""


# -- items -----------------------------------------------------------------------------------------------
def study_sets(items: ItemsSpec) -> dict[str, list[dict]]:
    """``{set name: checked items}`` from what :func:`study` takes.

    ``items``: a shipped set's name or a ``.json`` / ``.jsonl`` path (named by its stem), a list of items
    (the set ``"items"``), or ``{set name: items, a name or a path}``. Items are pass@k's
    (``prompt``, ``intermediates``, optional ``target``, ``answer``, ``readout``, ``name``).

    Raises:
        FileNotFoundError: no such set or file. ValueError: malformed items, or no set at all.
    """
    if isinstance(items, (str, os.PathLike)):
        return {set_name_of(str(items)): check_items(items)}
    if isinstance(items, Mapping):
        if not items:
            raise ValueError("items is an empty mapping: give {set name: items} with at least one set.")
        return {str(name): check_items(value) for name, value in items.items()}
    return {"items": check_items(items)}


def _answer(item: Mapping) -> str | None:
    answer = item.get("answer", item.get("target"))
    return str(answer) if isinstance(answer, str) and answer.strip() else None


# -- the band ----------------------------------------------------------------------------------------------
def band_of(curve: Sequence[float] | np.ndarray) -> tuple[int, int] | None:
    """``(onset, end)`` indices into ``curve`` (docs/method.md §8.1), ``None`` when the curve is all zero.

    onset: the first index whose value reaches half the curve's maximum; end: the last index of the
    contiguous run from the onset whose values stay at or above that half.
    """
    values = np.asarray(curve, dtype=np.float64)
    if values.size == 0 or not np.nanmax(values) > 0:
        return None
    above = values >= np.nanmax(values) / 2
    onset = int(np.argmax(above))
    end = onset
    while end + 1 < values.size and above[end + 1]:
        end += 1
    return onset, end


def _onset_diff(curve_a: np.ndarray, curve_b: np.ndarray, layers_a: Sequence[int], layers_b: Sequence[int]) -> float:
    """Onset layer of ``curve_a``'s band minus ``curve_b``'s (NaN when either has none)."""
    band_a, band_b = band_of(curve_a), band_of(curve_b)
    return float(layers_a[band_a[0]] - layers_b[band_b[0]]) if band_a is not None and band_b is not None else math.nan


def _first_run(hits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(first, last)`` indices ``[units]`` of each row's first run of True (``-1`` when none)."""
    any_hit = hits.any(axis=1)
    first = np.where(any_hit, hits.argmax(axis=1), -1)
    last = first.copy()
    for row in np.flatnonzero(any_hit):
        end = first[row]
        while end + 1 < hits.shape[1] and hits[row, end + 1]:
            end += 1
        last[row] = end
    return first, last


def _percentiles(values: Sequence[float]) -> tuple[float, float]:
    arr = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=np.float64)
    if arr.size == 0:
        return math.nan, math.nan
    low, high = np.percentile(arr, [2.5, 97.5])
    return float(low), float(high)


# -- the study --------------------------------------------------------------------------------------------
class StudyOptions(ProtocolKeywords, total=False):
    """:func:`study`'s further keywords (see its Args)."""

    k: int
    n_boot: int
    seed: int
    stop: Callable[[], bool] | None


def study(model: LensModel, lenses: Mapping[str, Lens] | Lens, items: ItemsSpec, readout: Readout | Any = None, *,
          layers: Iterable[int] | None = None, role: str = "intermediate", answered_only: bool | None = None,
          all_positions: bool = False, progress: Progress | None = None, **options: Unpack[StudyOptions]) -> Study:
    """Study where each item's concepts enter every lens's top ``k``, layer by layer (module docstring).

    Args:
        model: the model the lenses belong to.
        lenses: ``{name: lens}`` (or one lens, named by its kind).
        items: a shipped set's name, a ``.json`` / ``.jsonl`` path, a list of items, or ``{set name: items}``
            (:func:`study_sets`).
        readout: the :class:`~jlens_core.reading.readout_protocol.Readout` (its ``k``: the top-k cut-off, default 10),
            or a readout rule alone (the older spelling); ``k=``, ``spelling=``, ``synonyms=``, ``vocab=`` give its
            fields one by one.
        k: the top-k cut-off (>= 1; ranks are 1-based).
        answered_only: keep only items the model answers (greedy next token = a first token of the answer);
            ``None``: on when some item carries an ``answer`` or ``target``.
        all_positions: also keep every concept's rank at every position of the prompt (the tidy table's
            ``readout`` column marks the readout position; the statistics use it alone).
        layers: layers read (default: every readable layer of each lens, the output included).
        spelling, synonyms, vocab: pass@k's protocol (:func:`~jlens_core.evaluation.passk.pass_at_k_detail`).
        role: the concepts studied: ``"intermediate"`` (default), ``"target"`` or ``"both"``.
        n_boot, seed: the bootstrap of the band's and the comparisons' intervals (replicates, seed).
        progress: called as ``progress(items_done, n_items)`` over every set's items.
        stop: called between items; ``True`` stops the study (:class:`StudyCancelled`).

    Returns:
        A :class:`Study`; ``info["seconds"]`` is the time of the reading, ``info["forwards"]`` the forward
        passes (one per item).

    Raises:
        ValueError: a bad ``k`` / ``role`` / readout / spelling / vocab, malformed items, no lens, or no item
            left after the filter in any set (one sentence; a single empty set among others is a note in
            ``info["notes"]``). FileNotFoundError: no such set. LensFileError: a lens of another model.
        StudyCancelled: ``stop()`` returned True.
    """
    keywords: dict[str, Any] = dict(options)
    protocol = readout_of(readout, keywords)
    n_boot, seed = keywords.pop("n_boot", N_BOOT), keywords.pop("seed", 0)
    stop = keywords.pop("stop", None)
    no_other_keywords("study", keywords)
    k, spelling, vocab = 10 if protocol.k is None else protocol.k, protocol.spelling, protocol.vocab
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k={k!r} must be an integer >= 1 (ranks are 1-based: k=1 is top-1).")
    if role not in ROLES:
        raise ValueError(f"role={role!r} is not a role: use one of {list(ROLES)}.")
    readout, synonyms = check_readout_options(protocol.position, protocol.synonyms, vocab)
    lens_map, lens_layers = checked_lenses(model, lenses, layers)
    sets = study_sets(items)
    roles = ("intermediate", "target") if role == "both" else (role,)
    n_total = sum(len(v) for v in sets.values())
    display = TokenDisplay.for_model(model)
    scan = ItemScanner(model, lens_map, lens_layers, readout=readout, spelling=spelling, synonyms=synonyms,
                       kept_np=kept_ids_mask(display, vocab, model.vocab_size), all_positions=all_positions,
                       greedy=True)
    table_parts: list[pd.DataFrame] = []
    item_rows: list[dict] = []
    set_info: dict[str, dict] = {}
    started = time.perf_counter()
    done = 0
    for set_name, set_items in sets.items():
        has_answer = [_answer(item) is not None for item in set_items]
        use_filter = any(has_answer) if answered_only is None else bool(answered_only)
        counts = {"n_items": len(set_items), "kept": 0, "dropped": 0, "no_answer": 0, "filter": use_filter}
        for index, item in enumerate(set_items):
            if stop is not None and stop():
                raise StudyCancelled(f"The study was stopped after {done} of {n_total} items.")
            answer = _answer(item)
            seen = scan(item, index)
            read, positions = seen.read, seen.positions
            answered: bool | None = None
            if answer is not None:
                item_synonyms = synonyms if synonyms is not None else item.get("synonyms")
                firsts = word_spellings(model.tokenizer, answer, spelling="first_token", synonyms=item_synonyms,
                                        vocab_size=model.vocab_size)
                answered = seen.greedy in set(firsts.values())
            kept = answered is not False or not use_filter
            if answer is None:
                counts["no_answer"] += 1
            counts["kept" if kept else "dropped"] += 1
            words = [(r, w, s) for (r, w), s in zip(read.words, read.spellings) if r in roles]
            read_pos = positions.index(read.position)
            for lens_name in lens_map:
                ls = lens_layers[lens_name]
                for concept_role, word, spelled in words:
                    row = {"set": set_name, "item": index, "name": read.name, "prompt": item["prompt"],
                           "lens": lens_name, "role": concept_role, "concept": word, "scored": bool(spelled),
                           "spellings": list(spelled), "position": read.position,
                           "readout_token": display.texts[int(read.ids[0, read.position])], "answer": answer,
                           "answered": answered, "kept": kept, "first_layer": math.nan, "last_layer": math.nan,
                           "best_rank": math.nan, "best_layer": math.nan, "final_rank": math.nan}
                    if spelled:
                        ranks_np = seen.ranks(lens_name, spelled)  # [L, P]
                        at_readout = ranks_np[:, read_pos]  # [L]
                        first, last = _first_run((at_readout <= k)[None, :])
                        best = int(at_readout.min())
                        row.update(best_rank=best, best_layer=ls[int(np.argmax(at_readout == best))],
                                   final_rank=int(seen.final_ranks(spelled)[read_pos]))
                        if first[0] >= 0:
                            row.update(first_layer=ls[int(first[0])], last_layer=ls[int(last[0])])
                        grid_layers = np.repeat(np.asarray(ls), len(positions))
                        grid_pos = np.tile(np.asarray(positions), len(ls))
                        table_parts.append(pd.DataFrame({
                            "set": set_name, "item": index, "lens": lens_name, "concept": word,
                            "layer": grid_layers, "position": grid_pos, "readout": grid_pos == read.position,
                            "rank": ranks_np.reshape(-1)}))
                    item_rows.append(row)
            del seen
            done += 1
            if progress is not None:
                progress(done, n_total)
        set_info[set_name] = counts
    seconds = time.perf_counter() - started
    notes = [f"Set {name!r}: none of its {c['n_items']} items is answered by the model (greedy next token = a "
             "first token of the answer), so it has no statistics; study it with answered_only=False "
             "(jlens study --no-filter)." for name, c in set_info.items() if c["filter"] and c["kept"] == 0]
    if all(c["kept"] == 0 for c in set_info.values()):
        raise ValueError(f"No item is left after the capability filter: the model answers none of the {n_total} "
                         "items (greedy next token = a first token of the answer); study them with "
                         "answered_only=False (jlens study --no-filter).")
    table = (pd.concat(table_parts, ignore_index=True) if table_parts
             else pd.DataFrame(columns=list(TABLE_COLUMNS))).astype(TABLE_DTYPES)
    info = {"format": STUDY_FORMAT, "version": STUDY_VERSION, "jlens": __version__, "model": str(model.name),
            "n_layers": int(model.n_layers), "k": int(k), "answered_only": answered_only,
            "all_positions": bool(all_positions), "readout": readout, "spelling": spelling, "synonyms": synonyms,
            "vocab": vocab, "role": role, "n_boot": int(n_boot), "seed": int(seed),
            "lenses": {name: {"kind": str(getattr(lens, "kind", name)), "layers": [int(x) for x in lens_layers[name]]}
                       for name, lens in lens_map.items()},
            "sets": set_info, "notes": notes, "seconds": round(seconds, 3), "forwards": done}
    log.info("study: %d items x %d lenses in %.1f s", done, len(lens_map), seconds)
    return Study(table, pd.DataFrame(item_rows, columns=list(ITEM_COLUMNS)), info)


class Study:
    """The result of :func:`study`: per-item ranks and the per-lens statistics derived from them.

    Attributes:
        table: the tidy table, one row per set x item x lens x scored concept x layer (x position with
            ``all_positions``): columns :data:`TABLE_COLUMNS` (``readout``: the row is at the readout
            position; ``rank``: 1-based over the vocabulary of the readout).
        items: one row per set x item x lens x concept, columns :data:`ITEM_COLUMNS`: ``scored`` (the
            concept has a complete single-token spelling), ``answered`` (greedy next token is a first
            token of the answer; ``None`` without an answer), ``kept`` (passes the filter),
            ``first_layer`` / ``last_layer`` (first layer in the top k and the last of that run; NaN:
            never), ``best_rank`` / ``best_layer``, ``final_rank`` (in the model's output).
        info: the settings, the model, the lenses (kind, layers), per set the counts kept / dropped /
            without an answer, ``notes``, ``seconds`` and ``forwards``.
    """

    def __init__(self, table: pd.DataFrame, items: pd.DataFrame, info: Mapping[str, Any]) -> None:
        self.table = table
        self.items = items
        self.info = dict(info)
        self._by_layer: pd.DataFrame | None = None
        self._summary: pd.DataFrame | None = None
        self._comparisons: dict[str, pd.DataFrame] = {}  # by baseline: each is a seeded bootstrap per lens

    # -- what it holds -------------------------------------------------------------------------------------
    @property
    def k(self) -> int:
        return int(self.info["k"])

    @property
    def sets(self) -> list[str]:
        return list(self.info["sets"])

    @property
    def lenses(self) -> list[str]:
        return list(self.info["lenses"])

    def kind(self, lens: str) -> str:
        """The kind of a lens (``logit``, ``jacobian``, ``tuned``, ...): its colour in the figures."""
        return str(self.info["lenses"][lens]["kind"])

    def layers(self, lens: str) -> list[int]:
        return [int(x) for x in self.info["lenses"][lens]["layers"]]

    @property
    def notes(self) -> list[str]:
        return list(self.info.get("notes") or [])

    def unscored(self) -> pd.DataFrame:
        """The concepts left out because no single token spells them: ``set, item, name, concept`` (once each)."""
        rows = self.items[~self.items["scored"].astype(bool)]
        return rows[["set", "item", "name", "role", "concept"]].drop_duplicates().reset_index(drop=True)

    def _units(self, set_name: str, lens: str) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """``(hits [units, L] bool, item of each unit [units], layers)``: the kept items' scored concepts."""
        rows = self.items[(self.items["set"] == set_name) & (self.items["lens"] == lens)
                          & self.items["scored"].astype(bool) & self.items["kept"].astype(bool)]
        layers = self.layers(lens)
        tab = self.table
        sub = tab[(tab["set"] == set_name) & (tab["lens"] == lens) & tab["readout"].astype(bool)]
        if rows.empty or sub.empty:
            return np.zeros((0, len(layers)), dtype=bool), np.zeros(0, dtype=np.int64), layers
        ranks = sub.pivot_table(index=["item", "concept"], columns="layer", values="rank", aggfunc="min")
        ranks = ranks.reindex(columns=layers)
        keys = list(zip(rows["item"], rows["concept"]))
        ranks = ranks.reindex(pd.MultiIndex.from_tuples(keys, names=["item", "concept"]))
        values = ranks.to_numpy(dtype=np.float64)  # [units, L]
        return values <= self.k, np.asarray(rows["item"], dtype=np.int64), layers

    # -- per lens ---------------------------------------------------------------------------------------------
    @property
    def by_layer(self) -> pd.DataFrame:
        """Per set x lens x layer: ``units`` (kept items' scored concepts), ``hits`` (in the top k there),
        ``fraction`` with its 95 % Wilson ``ci_low``/``ci_high``, ``first_here`` (units whose first layer in
        the top k is this one: the histogram) and ``cumulative`` (share of units in by this layer)."""
        if self._by_layer is None:
            rows = []
            for set_name in self.sets:
                for lens in self.lenses:
                    hits, _, layers = self._units(set_name, lens)
                    first, _ = _first_run(hits)
                    n = hits.shape[0]
                    for j, layer in enumerate(layers):
                        h = int(hits[:, j].sum())
                        low, high = wilson_interval(h, n)
                        rows.append({"set": set_name, "lens": lens, "layer": layer, "units": n, "hits": h,
                                     "fraction": h / n if n else math.nan, "ci_low": low, "ci_high": high,
                                     "first_here": int((first == j).sum()),
                                     "cumulative": float(((first >= 0) & (first <= j)).sum() / n) if n else math.nan})
            self._by_layer = pd.DataFrame(rows, columns=list(BY_LAYER_COLUMNS))
        return self._by_layer

    def _item_groups(self, hits: np.ndarray, unit_item: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(item ids, hits per item [items, L], units per item [items])``: the bootstrap resamples items."""
        item_ids, inverse = np.unique(unit_item, return_inverse=True)
        per_item = np.zeros((item_ids.size, hits.shape[1]), dtype=np.float64)
        np.add.at(per_item, inverse, hits.astype(np.float64))
        return item_ids, per_item, np.bincount(inverse, minlength=item_ids.size).astype(np.float64)

    def _draws(self, n_items: int) -> np.ndarray:
        """``[n_boot, n_items]`` resampled item rows (the lens comparison's draws; one stratum: the set)."""
        rng = np.random.default_rng(int(self.info.get("seed", 0)))
        return _stratified_draws(rng, np.zeros(n_items, dtype=np.int64), 1, int(self.info.get("n_boot", N_BOOT)))

    @property
    def summary(self) -> pd.DataFrame:
        """Per set x lens, columns :data:`SUMMARY_COLUMNS`: the counts (items, kept, dropped by the filter,
        without an answer, used, units, unscored concepts), ``ever`` (share of units in the top k at some
        layer), the curve's ``peak`` and ``peak_layer``, the band's ``onset`` and ``end`` layers with
        bootstrap intervals, ``mean_first_layer`` (over units that enter)."""
        if self._summary is None:
            rows = []
            unscored = self.unscored()
            for set_name in self.sets:
                counts = self.info["sets"][set_name]
                for lens in self.lenses:
                    hits, unit_item, layers = self._units(set_name, lens)
                    first, _ = _first_run(hits)
                    row: dict[str, Any] = {
                        "set": set_name, "lens": lens, "kind": self.kind(lens), "k": self.k,
                        "n_items": counts["n_items"], "kept": counts["kept"], "dropped": counts["dropped"],
                        "no_answer": counts["no_answer"], "items_used": int(np.unique(unit_item).size),
                        "units": int(hits.shape[0]), "unscored": int((unscored["set"] == set_name).sum()),
                        "ever": float((first >= 0).mean()) if hits.shape[0] else math.nan,
                        "peak": math.nan, "peak_layer": math.nan, "onset": math.nan, "onset_low": math.nan,
                        "onset_high": math.nan, "end": math.nan, "end_low": math.nan, "end_high": math.nan,
                        "mean_first_layer": (float(np.mean([layers[j] for j in first if j >= 0]))
                                             if (first >= 0).any() else math.nan)}
                    if hits.shape[0]:
                        curve = hits.mean(axis=0)
                        row["peak"] = float(curve.max())
                        if curve.max() > 0:
                            row["peak_layer"] = layers[int(curve.argmax())]
                        band = band_of(curve)
                        if band is not None:
                            row.update(onset=layers[band[0]], end=layers[band[1]])
                        _, per_item, units = self._item_groups(hits, unit_item)
                        draws = self._draws(per_item.shape[0])  # [n_boot, items]
                        curves = per_item[draws].sum(axis=1) / units[draws].sum(axis=1)[:, None]  # [n_boot, L]
                        bands = [band_of(c) for c in curves]
                        row["onset_low"], row["onset_high"] = _percentiles(
                            [layers[b[0]] for b in bands if b is not None])
                        row["end_low"], row["end_high"] = _percentiles([layers[b[1]] for b in bands if b is not None])
                    rows.append(row)
            self._summary = pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS))
        return self._summary

    def band(self, set_name: str, lens: str) -> tuple[int, int] | None:
        """``(onset layer, end layer)`` of a lens's band on a set, ``None`` when it never enters the top k."""
        row = self.summary[(self.summary["set"] == set_name) & (self.summary["lens"] == lens)]
        if row.empty or not np.isfinite(row["onset"].iloc[0]):
            return None
        return int(row["onset"].iloc[0]), int(row["end"].iloc[0])

    def compare(self, lens: str, baseline: str, set_name: str | None = None) -> pd.DataFrame:
        """``lens`` against ``baseline``, paired over items (the same resampled items for both): per set, the
        onset difference (layers), the difference in the share ever in the top k, and the mean difference of
        first layers over units both find, each with a 95 % percentile bootstrap interval.

        ``verdict`` is ``"earlier"`` / ``"later"`` when the onset difference's interval excludes 0, else
        ``"tie"`` (``"no band"`` when either lens never enters).

        Returns:
            One row per set (``set_name``: that set alone), columns :data:`COMPARE_COLUMNS`.

        Raises:
            ValueError: a lens or set the study does not hold.
        """
        for name in (lens, baseline):
            if name not in self.info["lenses"]:
                raise ValueError(f"The study has no lens {name!r}; it holds {self.lenses}.")
        if set_name is not None and set_name not in self.info["sets"]:
            raise ValueError(f"The study has no set {set_name!r}; it holds {self.sets}.")
        rows = []
        for name in [set_name] if set_name is not None else self.sets:
            hits_a, items_a, layers_a = self._units(name, lens)
            hits_b, items_b, layers_b = self._units(name, baseline)
            row: dict[str, Any] = {c: math.nan for c in COMPARE_COLUMNS}
            row.update({"set": name, "lens": lens, "baseline": baseline, "k": self.k,
                        "items": int(np.unique(items_a).size), "verdict": "no band"})
            if hits_a.shape[0] == 0 or not np.array_equal(items_a, items_b):
                rows.append(row)
                continue
            ids, per_a, units = self._item_groups(hits_a, items_a)
            _, per_b, _ = self._item_groups(hits_b, items_b)
            first_a, _ = _first_run(hits_a)
            first_b, _ = _first_run(hits_b)
            lay_a, lay_b = np.asarray(layers_a, dtype=np.float64), np.asarray(layers_b, dtype=np.float64)
            fa = np.where(first_a >= 0, lay_a[np.maximum(first_a, 0)], np.nan)  # [units] first layer, NaN never
            fb = np.where(first_b >= 0, lay_b[np.maximum(first_b, 0)], np.nan)
            pos = np.searchsorted(ids, items_a)
            ever_a = np.bincount(pos, weights=(first_a >= 0).astype(float), minlength=ids.size)  # [items]
            ever_b = np.bincount(pos, weights=(first_b >= 0).astype(float), minlength=ids.size)
            both = np.isfinite(fa) & np.isfinite(fb)
            d_first = np.bincount(pos, weights=np.where(both, fa - fb, 0.0), minlength=ids.size)
            n_both = np.bincount(pos, weights=both.astype(float), minlength=ids.size)

            band_a, band_b = band_of(per_a.sum(0) / units.sum()), band_of(per_b.sum(0) / units.sum())
            draws = self._draws(ids.size)  # [n_boot, items], shared by both lenses: paired
            n_draw = units[draws].sum(axis=1)  # [n_boot]
            boot_onset = [_onset_diff(per_a[d].sum(0) / n, per_b[d].sum(0) / n, layers_a, layers_b)
                          for d, n in zip(draws, n_draw)]
            boot_ever = (ever_a[draws].sum(1) - ever_b[draws].sum(1)) / n_draw
            with np.errstate(invalid="ignore", divide="ignore"):
                boot_first = d_first[draws].sum(1) / n_both[draws].sum(1)
            row.update(onset=layers_a[band_a[0]] if band_a else math.nan,
                       onset_baseline=layers_b[band_b[0]] if band_b else math.nan,
                       ever=float(ever_a.sum() / units.sum()), ever_baseline=float(ever_b.sum() / units.sum()))
            row["onset_diff"] = row["onset"] - row["onset_baseline"]
            row["ever_diff"] = row["ever"] - row["ever_baseline"]
            row["first_diff"] = float(d_first.sum() / n_both.sum()) if n_both.sum() else math.nan
            row["onset_diff_low"], row["onset_diff_high"] = _percentiles(boot_onset)
            row["ever_diff_low"], row["ever_diff_high"] = _percentiles(boot_ever)
            row["first_diff_low"], row["first_diff_high"] = _percentiles(boot_first)
            if np.isfinite(row["onset_diff"]):
                low, high = row["onset_diff_low"], row["onset_diff_high"]
                row["verdict"] = "earlier" if high < 0 else "later" if low > 0 else "tie"
            rows.append(row)
        return pd.DataFrame(rows, columns=list(COMPARE_COLUMNS))

    def comparisons(self, baseline: str | None = None) -> pd.DataFrame:
        """Every other lens against ``baseline`` (default: the logit lens when studied, else the first lens)."""
        if baseline is None:
            baseline = next((n for n in self.lenses if is_baseline(self.kind(n))), self.lenses[0])
        if baseline not in self._comparisons:  # the CLI, its HTML page and every app rerun ask again
            parts = [self.compare(name, baseline) for name in self.lenses if name != baseline]
            self._comparisons[baseline] = (pd.concat(parts, ignore_index=True) if parts
                                           else pd.DataFrame(columns=list(COMPARE_COLUMNS)))
        return self._comparisons[baseline]

    def item_table(self, set_name: str | None = None) -> pd.DataFrame:
        """One row per set x item x concept: ``name, prompt, concept, scored, answered, kept`` and, per lens,
        ``first · <lens>`` (first layer in the top k; NaN never) and ``best rank · <lens>``."""
        frame = self.items if set_name is None else self.items[self.items["set"] == set_name]
        keys = ["set", "item", "name", "prompt", "role", "concept", "scored", "answered", "kept"]
        base = frame[frame["lens"] == self.lenses[0]][keys].reset_index(drop=True)
        for lens in self.lenses:
            sub = frame[frame["lens"] == lens].reset_index(drop=True)
            base[f"first · {lens}"] = sub["first_layer"].to_numpy()
            base[f"best rank · {lens}"] = sub["best_rank"].to_numpy()
        return base

    def curve(self, set_name: str, lens: str) -> pd.DataFrame:
        """The by-layer rows of one set and lens (:attr:`by_layer`)."""
        frame = self.by_layer
        return frame[(frame["set"] == set_name) & (frame["lens"] == lens)].reset_index(drop=True)

    # -- files and pages --------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The study file's content (JSON-ready): ``info``, the item rows and the tidy table, by column."""
        def columns(frame: pd.DataFrame) -> dict[str, list]:
            out = {}
            for name in frame.columns:
                values = frame[name].tolist()
                out[name] = [None if isinstance(v, float) and not math.isfinite(v) else
                             v.item() if isinstance(v, np.generic) else v for v in values]
            return out

        return {"format": STUDY_FORMAT, "version": STUDY_VERSION, "info": self.info, "items": columns(self.items),
                "table": columns(self.table)}

    def save(self, path: str | os.PathLike) -> Path:
        """Write the study file (JSON, atomically; its folder is made); :func:`load_study` reopens it without the
        model. Returns the path written."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return atomic_write_text(path, json.dumps(self.to_dict(), separators=(",", ":")), shared=True)

    def figure(self, set_name: str | None = None) -> Any:
        """The study's figure for one set (default: the first): :func:`~jlens_core.figures.study.study_figure`."""
        from ..figures.study import study_figure

        return study_figure(self, set_name or self.sets[0])

    def to_html(self, path: str | os.PathLike | None = None) -> str:
        """A self-contained HTML page (figures, summary, comparisons, items; works offline); written to
        ``path`` when given. Returns the page."""
        from ..figures.study import study_page

        page = study_page(self)
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, page, shared=True)
        return page

    def _repr_html_(self) -> str:
        """In a notebook: the settings line and the summary table (``figure()`` draws the curves)."""
        cols = ["set", "lens", "kept", "dropped", "units", "ever", "peak", "onset", "onset_low", "onset_high", "end"]
        head = html.escape(repr(self))
        return f"<p>{head}</p>" + self.summary[cols].to_html(index=False, na_rep="–", float_format="{:.2f}".format)

    def __repr__(self) -> str:
        return (f"Study({len(self.sets)} set(s), {len(self.lenses)} lens(es), k={self.k}, "
                f"{self.info.get('forwards')} items in {self.info.get('seconds')} s)")


def load_study(path: str | os.PathLike) -> Study:
    """Reopen a study file written by :meth:`Study.save` (no model needed).

    Raises:
        FileNotFoundError: no such file. ValueError: not a study file (one sentence naming it).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No study file {str(path)!r}: write one with Study.save or jlens study --out.")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"{path} is not a study file: it is not JSON.") from None
    if not isinstance(data, Mapping) or data.get("format") != STUDY_FORMAT:
        raise ValueError(f"{path} is not a study file (no \"format\": \"{STUDY_FORMAT}\"): open one that "
                         "Study.save or jlens study wrote.")
    if int(data.get("version", 0)) > STUDY_VERSION:
        raise ValueError(f"{path} is a study file of version {data.get('version')}, newer than this jlens reads "
                         f"({STUDY_VERSION}): update jlens.")
    items = pd.DataFrame(data["items"], columns=list(ITEM_COLUMNS))
    for name in ("first_layer", "last_layer", "best_rank", "best_layer", "final_rank"):
        items[name] = pd.to_numeric(items[name], errors="coerce").astype(np.float64)
    table = pd.DataFrame(data["table"], columns=list(TABLE_COLUMNS)).astype(TABLE_DTYPES)
    return Study(table, items, data["info"])


__all__ = ["BY_LAYER_COLUMNS", "COMPARE_COLUMNS", "ITEM_COLUMNS", "N_BOOT", "ROLES", "STUDY_FORMAT", "SUMMARY_COLUMNS",
           "TABLE_COLUMNS", "Study", "StudyCancelled", "band_of", "load_study", "study", "study_sets"]
