"""Say success: over a set of items, how often does a lens's search find a verified edit that makes the model say
a counterfactual answer? (docs/method.md §7.1)

An item names a prompt, the answer the model should give and a counterfactual ``target``::

    {"name": "capital_japan", "relation": "capital", "prompt": "The capital city of Japan is",
     "answer": "Tokyo", "target": "Paris"}

An item is **scored** when the clean model does not already say the target. Per item one clean pass feeds
every arm: each lens's search (:func:`~jlens_core.interventions.say.make_it_say`'s ranking, replays and
bisection; the logit lens is added when missing) and the random-direction control (the first lens's layers
and swap tokens, seeded random unit directions). An arm **succeeds** on an item when it finds a verified
recipe. Per arm: the success rate over the scored items with its 95 % Clopper-Pearson interval
(:mod:`~jlens_core.interventions.intervals`), the same over the items the model answered correctly (its
clean greedy token spells ``answer``), and over the successes the median minimal band width, the median
minimal strength of each kind of edit, and the minimal recipes' side effects (docs/method.md §7.2: the readout
and downstream divergences, in bits; mean, 95 % bootstrap interval and median).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from .._keywords import options_value
from ..lenses.protocol import Lens
from ..models.model import LensModel
from ..reading.tokens import spellings
from ..seeds import derive_seed
from .intervals import clopper_pearson_interval
from .item_sets import load_item_set
from .lens_edits import with_logit_control
from .read_directions import check_layers, default_layers
from .say import (
    CONTROLS,
    OPS,
    RANDOM,
    SayKeywords,
    SayOptions,
    SayProgress,
    SayResult,
    _execute,
    check_say_input,
    lens_arm,
    random_arm,
)
from .say_ranking import spell_target
from .side_effects import SET_FIGURES, check_downstream_tokens, set_columns, set_figures

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

log = logging.getLogger(__name__)

ITEM_FIELDS = ("prompt", "answer", "target")
SAY_SETS = {"say": "written for jlens: capitals, languages, opposites, weekdays, animal sounds, sums, plurals (48)"}
DEFAULT_MAX_REPLAYS = 8
SUMMARY_COLUMNS = ("arm", "items", "successes", "rate", "ci_low", "ci_high", "answered", "answered_successes",
                   "answered_rate", "answered_ci_low", "answered_ci_high", "median_width", "median_steer",
                   "median_swap", "median_ablate", "median_replays", *set_columns())
ITEM_FIGURES = {"readout_kl": "readout_kl_bits", "downstream_kl": "downstream_kl_bits",
                "downstream_kl_max": "downstream_kl_max_bits"}  # item column suffix: the minimal Recipe's field


def load_say_set(spec: str | Path = "say") -> list[dict]:
    """Items of a say set: a shipped name (``"say"``) or a ``.jsonl`` / ``.json`` file.

    Raises:
        FileNotFoundError: no such set or file.
        ValueError: a file with no items, or an item without ``prompt``, ``answer`` or ``target`` (names it).
    """
    return load_item_set(spec, shipped=SAY_SETS, fields=ITEM_FIELDS, what="say set")


@dataclass
class SaySuccessReport:
    """What :func:`say_success` returns.

    Attributes:
        summary: one row per arm (the lenses, then ``"random"``), columns :data:`SUMMARY_COLUMNS`: successes over
            the scored items (``rate``, 95 % Clopper-Pearson ``ci_low, ci_high``), the same over the items the model
            answered (``answered_*``), and over the successes the median minimal band width and the median minimal
            strength per kind of edit (steer ``s``, swap ``α``, ablate: competitors; NaN where none), the median
            replays spent, and the minimal recipes' side effects in bits (``readout_kl_bits``, its 95 % bootstrap
            ``readout_kl_low, readout_kl_high``, ``readout_kl_median``; the same for ``downstream_kl``).
        items: one row per item: ``name, relation, scored, answered, clean_next`` and per arm ``<arm>`` (success),
            ``<arm> recipe`` (the minimal one, described), ``<arm> width``, ``<arm> op``, ``<arm> strength``,
            ``<arm> replays``, ``<arm> readout_kl``, ``<arm> downstream_kl``, ``<arm> downstream_kl_max`` (bits).
        n_items, n_scored: counts. seconds: wall time; layers: the layers searched; settings: the search's settings.
    """

    summary: pd.DataFrame
    items: pd.DataFrame
    n_items: int
    n_scored: int
    seconds: float = 0.0
    layers: list[int] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds_per_item(self) -> float:
        return self.seconds / max(1, self.n_items)


def _item_row(model: LensModel, item: dict, i: int, result: SayResult | None, reason: str) -> dict[str, Any]:
    row: dict[str, Any] = {"name": item.get("name", f"#{i}"), "relation": item.get("relation", ""),
                           "scored": False, "answered": False, "clean_next": None, "reason": reason}
    if result is None:
        return row
    answer_ids = set(spellings(model.tokenizer, str(item["answer"]), vocab_size=model.vocab_size).values())
    row["clean_next"] = result.clean_next
    row["answered"] = result.clean_next_id in answer_ids
    row["scored"] = not result.already and not result.stopped
    if result.already:
        row["reason"] = f"not scored: the model already says {result.target_text!r}"
    for name, arm in result.arms.items():
        minimal = arm.minimal
        row[name] = minimal is not None
        row[f"{name} recipe"] = minimal.describe(result.target_text) if minimal else None
        row[f"{name} width"] = minimal.width if minimal else None
        row[f"{name} op"] = minimal.op if minimal else None
        row[f"{name} strength"] = minimal.strength if minimal else None
        row[f"{name} replays"] = arm.n_replayed
        for suffix, figure in ITEM_FIGURES.items():
            row[f"{name} {suffix}"] = getattr(minimal, figure) if minimal else None
    return row


def _median(values: Iterable[Any]) -> float:
    kept = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return float(pd.Series(kept).median()) if kept else math.nan


def _summary_row(items: pd.DataFrame, arm: str) -> dict[str, Any]:
    scored = items[items["scored"]] if len(items) else items
    wins = scored[arm].fillna(False).astype(bool) if arm in scored else pd.Series(dtype=bool)
    k, n = int(wins.sum()), len(wins)
    low, high = clopper_pearson_interval(k, n)
    answered = scored[scored["answered"]] if len(scored) else scored
    a_wins = answered[arm].fillna(False).astype(bool) if arm in answered else pd.Series(dtype=bool)
    ak, an = int(a_wins.sum()), len(a_wins)
    a_low, a_high = clopper_pearson_interval(ak, an)
    found = scored[wins] if n else scored
    medians = {op: _median(found.loc[found[f"{arm} op"] == op, f"{arm} strength"]) if n else math.nan for op in OPS}
    return {"arm": arm, "items": n, "successes": k, "rate": k / n if n else math.nan, "ci_low": low, "ci_high": high,
            "answered": an, "answered_successes": ak, "answered_rate": ak / an if an else math.nan,
            "answered_ci_low": a_low, "answered_ci_high": a_high,
            "median_width": _median(found[f"{arm} width"]) if n else math.nan,
            "median_steer": medians["steer"], "median_swap": medians["swap"], "median_ablate": medians["ablate"],
            "median_replays": _median(scored[f"{arm} replays"]) if n and f"{arm} replays" in scored else math.nan,
            **{k: v for name in SET_FIGURES
               for k, v in set_figures(found[f"{arm} {name}"] if n and f"{arm} {name}" in found else [], name).items()}}


def say_success(model: LensModel, lenses: Mapping[str, Lens], items: Iterable[dict], search: SayOptions | None = None,
                *, layers: Sequence[int] | None = None, random_control: bool = True,
                progress: Callable[[int, int], bool | None] | None = None,
                **options: Unpack[SayKeywords]) -> SaySuccessReport:
    """Say success of each lens on ``items`` (see the module docstring).

    Args:
        model: an :class:`~jlens_core.HFLensModel`.
        lenses: ``{name: lens}``; the logit lens is added as ``"logit"`` when missing.
        items: dicts with ``prompt, answer, target`` (``name``, ``relation`` optional); :func:`load_say_set`.
        layers: the layers every arm searches (default: the first lens's middle band, ``n_layers // 3`` to its last
            source layer).
        search: the search's :class:`~jlens_core.interventions.say.SayOptions` (:func:`make_it_say`; its
            ``max_replays`` is the replay budget per arm and item, the bisection adds up to about 8); ``ops=``,
            ``positions=``, ``from_position=``, ``grids=``, ``max_replays=``, ``seed=`` and ``downstream_tokens=``
            give its fields one by one.
        random_control: add the random-direction control (``"random"``; seeded per item with ``derive_seed(seed, i)`` (:mod:`jlens_core.seeds`)).
        progress: called as ``progress(done, total)`` after each item; returning ``True`` stops after that item.
        downstream_tokens: the clean continuation each verified recipe is teacher-forced on for its downstream side
            effect (:func:`make_it_say`; 0: none).

    Raises:
        ValueError: no lenses, a layer outside a lens, or a bad search setting (one sentence, before any work).
        TypeError: a keyword that is not one of :class:`~jlens_core.interventions.say.SayKeywords`.
    """
    s = options_value("say_success", search, SayOptions, options, SayKeywords)
    ops, positions, from_position, grids = s.ops, s.positions, s.from_position, s.grids
    max_replays, seed, downstream_tokens = s.max_replays, s.seed, s.downstream_tokens
    items = list(items)
    if not lenses:
        raise ValueError("No lenses given: pass {name: lens}, e.g. {'jacobian': lens}.")
    all_lenses = with_logit_control(model, lenses)
    first = next(iter(all_lenses.values()))
    searched = check_layers(model, first, layers) if layers is not None else default_layers(model, first)
    for lens in all_lenses.values():
        check_layers(model, lens, searched)
    check_say_input(model, "check", ops=ops, positions=("readout",), grids=grids, max_replays=max_replays,
                    from_position=0)
    check_downstream_tokens(downstream_tokens)
    start = time.perf_counter()
    rows = []
    for i, item in enumerate(items):
        prompt = str(item["prompt"])
        try:
            ids, chosen_ops, modes, grid = check_say_input(model, prompt, ops=ops, positions=positions, grids=grids,
                                                           max_replays=max_replays, from_position=from_position)
            spelled = spell_target(model, str(item["target"]), prompt)
        except ValueError as exc:
            rows.append(_item_row(model, item, i, None, f"skipped: {exc}"))
            continue
        arms = [lens_arm(model, name, lens) for name, lens in all_lenses.items()]
        if random_control:
            arms.append(random_arm(model, first, derive_seed(seed, i)))
        result = _execute(model, prompt, ids, spelled, searched, arms, ops=chosen_ops, modes=modes,
                          from_position=from_position, grids=grid, max_replays=max_replays, minimise=True,
                          continuation_tokens=0, progress=None, downstream_tokens=downstream_tokens)
        rows.append(_item_row(model, item, i, result, ""))
        if progress is not None and progress(i + 1, len(items)):
            break
    table = pd.DataFrame(rows)
    arm_names = list(all_lenses) + ([RANDOM] if random_control else [])
    summary = pd.DataFrame([_summary_row(table, arm) for arm in arm_names], columns=list(SUMMARY_COLUMNS))
    seconds = time.perf_counter() - start
    n_scored = int(table["scored"].sum()) if len(table) else 0
    log.info("say success: %d items, %d scored, %.1f s", len(rows), n_scored, seconds)
    settings = {"ops": list(ops), "positions": list(positions), "from_position": int(from_position),
                "grids": {k: list(v) for k, v in (grids or {}).items()}, "max_replays": int(max_replays),
                "random_control": bool(random_control), "seed": int(seed), "controls": list(CONTROLS),
                "downstream_tokens": int(downstream_tokens)}
    return SaySuccessReport(summary=summary, items=table, n_items=len(rows), n_scored=n_scored, seconds=seconds,
                            layers=list(searched), settings=settings)


__all__ = ["DEFAULT_MAX_REPLAYS", "ITEM_FIELDS", "SAY_SETS", "SUMMARY_COLUMNS", "SayProgress", "SaySuccessReport",
           "load_say_set", "say_success"]
