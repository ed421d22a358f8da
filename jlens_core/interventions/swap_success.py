"""Swap success: does the model's answer follow when a lens's read coordinates are swapped? (docs/method.md §7)

An item names a prompt whose answer goes through an unstated concept (``source``), a
``replacement`` concept, the clean ``answer`` and the ``swap_answer`` the replacement implies::

    {"prompt": "The capital of the country where the Eiffel Tower stands is",
     "source": "France", "replacement": "Germany", "answer": "Paris", "swap_answer": "Berlin"}

An item is **eligible** when the model's clean greedy next token is a complete single-token spelling
of ``answer`` (as written, lower-cased or capitalised, with or without a leading space). For each
lens and ``alpha``, a :class:`~jlens_core.interventions.lens_edits.Swap` of ``source -> replacement``
(directions: the spelling with a leading space where one token stands for it) is applied at the
chosen layers and every prompt position but the first; the item **succeeds** when the edited greedy
next token spells ``swap_answer``. The swap success of a lens is the fraction of eligible items that
succeed, with a 95 % Wilson interval. Controls: the logit lens (always included) and random unit
directions in place of ``v_A, v_B`` (the same alphas; the floor). Items whose words have no
single-token spelling are skipped and counted.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from .._paths import ASSETS_DIR
from ..lenses.lens import LogitLens
from ..lenses.protocol import Lens
from ..models.model import LensModel
from ..reading.edit_hooks import EditRunner
from ..reading.tokens import spellings
from .lens_edits import MAX_ALPHA, Swap, random_directions
from .read_directions import check_layers, default_layers

log = logging.getLogger(__name__)

ITEM_FIELDS = ("prompt", "source", "replacement", "answer", "swap_answer")
SWAP_SETS = {"swaps": "written for jlens: geography, people, objects, numbers (>= 60 items)"}
DEFAULT_ALPHAS = (0.5, 1.0, 2.0, 4.0)
RANDOM = "random"
SUMMARY_COLUMNS = ("lens", "alpha", "eligible", "successes", "rate", "ci_low", "ci_high")


def load_swap_set(spec: str | Path) -> list[dict]:
    """Items of a swap set: a shipped name (``"swaps"``) or a ``.jsonl`` / ``.json`` file.

    Raises:
        FileNotFoundError: no such set or file.
        ValueError: a file with no items, or an item without one of ``prompt, source, replacement,
            answer, swap_answer`` (names the item).
    """
    path = Path(spec)
    if str(spec) in SWAP_SETS:
        path = ASSETS_DIR / "evaluations" / f"{spec}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"No swap set {str(spec)!r}: give a shipped set ({', '.join(SWAP_SETS)}) or a "
                                ".jsonl / .json file of items with " + ", ".join(ITEM_FIELDS) + ".")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        data = json.loads(text)
        items = data.get("items") if isinstance(data, dict) else data
    else:
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not items:
        raise ValueError(f"{str(path)!r} holds no items.")
    for i, item in enumerate(items):
        missing = [k for k in ITEM_FIELDS if not isinstance(item, dict) or not str(item.get(k) or "").strip()]
        if missing:
            name = item.get("name", f"#{i}") if isinstance(item, dict) else f"#{i}"
            raise ValueError(f"Item {name} of {str(path)!r} has no {', '.join(missing)}: every item needs "
                             + ", ".join(ITEM_FIELDS) + ".")
    return items


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95 % Wilson score interval of a binomial proportion (``(nan, nan)`` for ``n = 0``)."""
    if n <= 0:
        return math.nan, math.nan
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def direction_spelling(tokenizer: Any, word: str, vocab_size: int | None = None) -> str | None:
    """The spelling whose read direction stands for ``word``: the first single-token one
    (leading-space forms first), or ``None``."""
    return next(iter(spellings(tokenizer, word, vocab_size=vocab_size)), None)


@dataclass
class SwapReport:
    """What :func:`swap_success` returns.

    Attributes:
        summary: one row per (lens, alpha), columns :data:`SUMMARY_COLUMNS` (``lens`` includes
            ``"random"``, the random-direction control); rates over the eligible items.
        best: one row per lens: the alpha with the highest rate, its rate and interval.
        items: one row per item: ``name, eligible, reason`` (why not eligible / skipped), the clean
            next token, and per lens x alpha the edited next token and success.
        n_items, n_eligible, n_skipped: counts (skipped: a word with no single-token spelling).
        layers: the edited layers per lens; seconds: wall time; seconds_per_item.
    """

    summary: pd.DataFrame
    best: pd.DataFrame
    items: pd.DataFrame
    n_items: int
    n_eligible: int
    n_skipped: int
    layers: dict[str, list[int]] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def seconds_per_item(self) -> float:
        return self.seconds / max(1, self.n_items)


def _greedy_next(model: LensModel, ids: torch.Tensor, edits: list | None = None, clean=None) -> int:
    runner = EditRunner(model, edits, int(ids.shape[1]))
    positions = torch.arange(int(ids.shape[1]))
    with torch.no_grad():
        logits = runner.run(lambda: model.hf_model(input_ids=ids).logits[0, -1], positions, clean=clean)
    return int(logits.float().argmax())


def swap_success(model: LensModel, lenses: Mapping[str, Lens], items: Iterable[dict], *,
                 layers: Sequence[int] | None = None, alphas: Sequence[float] = DEFAULT_ALPHAS,
                 random_control: bool = True, seed: int = 0,
                 progress: Callable[[int, int], None] | None = None) -> SwapReport:
    """Swap success of each lens on ``items`` (see the module docstring).

    Args:
        model: an :class:`~jlens_core.HFLensModel`.
        lenses: ``{name: lens}``; the logit lens is added as ``"logit"`` when missing.
        items: dicts with ``prompt, source, replacement, answer, swap_answer`` (``name`` optional).
        layers: layers to edit (default per lens: ``n_layers // 3`` to its last source layer).
        alphas: swap scales to try; the best per lens is reported beside each.
        random_control: add the random-direction control (``"random"``, with the first lens's layers).
        seed: seeds the random directions (one pair per item).
        progress: called as ``progress(done, total)`` after each item.

    Raises:
        ValueError: no alphas, an alpha out of range, a layer outside a lens.
    """
    items = list(items)
    alphas = [float(a) for a in alphas]
    if not alphas:
        raise ValueError("alphas is empty: give at least one swap scale.")
    lenses = dict(lenses)
    if not any(lens.kind == "logit" for lens in lenses.values()):
        lenses["logit"] = LogitLens.for_model(model)
    for alpha in alphas:  # bad settings fail before any work
        if not 0 <= alpha <= MAX_ALPHA:
            raise ValueError(f"Swap scale alpha={alpha:g} is out of range: give numbers in [0, {MAX_ALPHA:g}].")
    chosen = {name: check_layers(model, lens, layers) if layers is not None else default_layers(model, lens)
              for name, lens in lenses.items()}
    first = next(iter(chosen.values()))
    vocab = model.vocab_size
    rows = []
    start = time.perf_counter()
    for i, item in enumerate(items):
        row: dict[str, Any] = {"name": item.get("name", f"#{i}"), "eligible": False, "reason": ""}
        spelled = {k: direction_spelling(model.tokenizer, str(item[k]), vocab) for k in ITEM_FIELDS[1:]}
        missing = [f"{k} {item[k]!r}" for k, v in spelled.items() if v is None]
        words = {k: v for k, v in spelled.items() if v is not None}  # all of them when none is missing
        ids = model.encode(str(item["prompt"]))
        if missing:
            row["reason"] = "skipped: no single-token spelling of " + ", ".join(missing)
        else:
            answer_ids = set(spellings(model.tokenizer, str(item["answer"]), vocab_size=vocab).values())
            swap_ids = set(spellings(model.tokenizer, str(item["swap_answer"]), vocab_size=vocab).values())
            clean_next = _greedy_next(model, ids)
            row["clean_next"] = model.decode([clean_next])
            if clean_next not in answer_ids:
                row["reason"] = f"not eligible: the model says {row['clean_next']!r}"
            else:
                row["eligible"] = True
                runs: dict[str, tuple[Lens, list[int], dict[int, tuple[torch.Tensor, torch.Tensor]] | None]] = {
                    name: (lenses[name], chosen[name], None) for name in lenses}
                if random_control:
                    runs[RANDOM] = (next(iter(lenses.values())), first,
                                    random_directions(first, model.d_model, seed * 100003 + i))
                for name, (lens, run_layers, directions) in runs.items():
                    swap = Swap(model, lens, words["source"], words["replacement"], 1.0, layers=run_layers,
                                directions=directions)
                    runner = EditRunner(model, [swap], int(ids.shape[1]))
                    clean = runner.clean_residuals(lambda: model.hf_model(input_ids=ids))  # noqa: B023
                    for alpha in alphas:
                        swap.alpha = alpha
                        edited = _greedy_next(model, ids, [swap], clean=clean)
                        row[f"{name}@{alpha:g}"] = edited in swap_ids
                        row[f"{name}@{alpha:g} next"] = model.decode([edited])
        rows.append(row)
        if progress is not None:
            progress(i + 1, len(items))
    seconds = time.perf_counter() - start
    table = pd.DataFrame(rows)
    eligible = table[table["eligible"]] if not table.empty else table
    summary_rows, best_rows = [], []
    names = list(lenses) + ([RANDOM] if random_control else [])
    for name in names:
        best: dict[str, Any] | None = None
        for alpha in alphas:
            col = f"{name}@{alpha:g}"
            wins = int(eligible[col].sum()) if col in eligible else 0
            n = len(eligible)
            low, high = wilson_interval(wins, n)
            rec: dict[str, Any] = {"lens": name, "alpha": alpha, "eligible": n, "successes": wins,
                   "rate": wins / n if n else math.nan, "ci_low": low, "ci_high": high}
            summary_rows.append(rec)
            if best is None or (n and rec["rate"] > best["rate"]):
                best = rec
        best_rows.append(best)
    n_skipped = int(table["reason"].str.startswith("skipped").sum()) if not table.empty else 0
    report = SwapReport(summary=pd.DataFrame(summary_rows, columns=list(SUMMARY_COLUMNS)),
                        best=pd.DataFrame(best_rows, columns=list(SUMMARY_COLUMNS)), items=table,
                        n_items=len(items), n_eligible=len(eligible), n_skipped=n_skipped,
                        layers={**chosen, **({RANDOM: first} if random_control else {})}, seconds=seconds)
    log.info("swap success: %d items, %d eligible, %d skipped, %.1f s", report.n_items, report.n_eligible,
             report.n_skipped, seconds)
    return report


__all__ = ["DEFAULT_ALPHAS", "SUMMARY_COLUMNS", "SWAP_SETS", "SwapReport", "direction_spelling", "load_swap_set",
           "swap_success", "wilson_interval"]
