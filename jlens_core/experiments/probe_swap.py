"""Experiment 1, ``probe-swap``: internal reasoning, with the privilege split and the depth test (docs/experiments.md).

An item is a two-hop prompt that ends just before its answer, with the unstated ``intermediate``, the
``answer``, a ``swap_to`` intermediate and the ``swap_answer`` it implies. Gate: the model's greedy next token
is the answer's first token. Every arm is scored on ``swap_answer`` at the last position (top-1, top-5):

* ``J-lens swap``: the lens's clean-clamped coordinate swap intermediate -> swap_to
  (:class:`~jlens_core.interventions.lens_edits.Swap`) at every band layer and every prompt position but the first;
* ``logit-lens swap``: the same swap along the logit lens's read directions (is the claim about the J lens?);
* ``random directions``: the swap along two random unit directions per layer (seeded per item);
* ``unrelated swap``: intermediate -> a seeded random word token (the null);
* ``answer swap``: the model's clean answer token -> swap_answer (the ceiling);
* with the J-space (:mod:`jlens_core.jspace`): the probe of each intermediate (mean last-position activation over
  the set's prompts that share it, minus the mean over all intermediates' means) swapped along the full probe,
  its J part, its non-J part, the non-J part with the intermediate's J coordinates clamped to clean values, and
  a norm-matched random vector (the control).

The depth test applies the intermediate swap and the answer swap from a start layer ``L`` to the lens's last
source layer, for ``L`` over the lens's layers; the **onset** of each is the last start layer whose success rate
is still at least half its maximum. The paper finds the intermediate's onset about 17 % of depth earlier.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
import pandas as pd

from .._keywords import checked_options
from ..interventions.lens_edits import Swap, random_directions
from ..lenses.lens import LogitLens
from ..lenses.protocol import Lens
from ..models.model import LensModel
from ..reading.tokens import TokenDisplay
from ..seeds import derive_seed
from .core import (
    EDITS,
    ExperimentResult,
    Progress,
    clean_read,
    edited_next_logits,
    first_ids,
    gated_band,
    not_single,
    ranks_of,
    readable_layers,
    render_prompt,
    summarise,
    timer,
    trial_table,
    word_ids,
)
from .jspace_arms import probe_arms

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

NAME = "probe-swap"
WORDS = ("intermediate", "answer", "swap_to", "swap_answer")
ARMS = ("J-lens swap", "logit-lens swap", "random directions", "unrelated swap", "answer swap")


def unrelated_token(model: LensModel, exclude: set[int], seed: int) -> int:
    """A seeded random word token (letters only, leading space), not in ``exclude``: the null swap's target."""
    display = TokenDisplay.for_model(model)
    mask = display.word_like_mask()
    texts = display.texts
    pool = [i for i in np.flatnonzero(mask).tolist() if texts[i].startswith(" ") and len(texts[i].strip()) > 2
            and i not in exclude]
    if not pool:
        pool = [i for i in range(int(model.vocab_size)) if i not in exclude]
    return int(pool[int(np.random.default_rng(seed).integers(len(pool)))])


def depth_onset(starts: Sequence[int], rates: Sequence[float]) -> float:
    """The last start layer whose rate is at least half the maximum (NaN when the rate is zero throughout)."""
    values = np.asarray(rates, dtype=np.float64)
    if values.size == 0 or not np.nanmax(values) > 0:
        return math.nan
    ok = np.flatnonzero(values >= np.nanmax(values) / 2)
    return float(starts[int(ok[-1])])


class ProbeSwapSettings(TypedDict, total=False):
    """:func:`run_probe_swap`'s settings by keyword (its Args): ``depth``, ``depth_step``, ``probes``, ``alpha``."""

    depth: bool
    depth_step: int | None
    probes: bool
    alpha: float


def run_probe_swap(model: LensModel, lens: Lens, data: dict, *, band: Any = None, seed: int = 0,
                   progress: Callable[[int, int], None] | None = None, stop: Callable[[], bool] | None = None,
                   **options: Unpack[ProbeSwapSettings]) -> ExperimentResult:
    """Run experiment 1 on ``data`` (the probe-swap format); see the module docstring.

    Args:
        band: layers to swap at (``"20-26"``, a list) or ``None`` to derive it from the intermediates.
        depth: run the depth test; depth_step: start layers every this many (default ``max(1, n_layers // 10)``).
        probes: run the probe split (needs the J-space; noted and skipped when it is not installed).
        alpha: the coordinate swaps' scale (1 exchanges the two coordinates; 0..16, as
            :class:`~jlens_core.interventions.lens_edits.Swap`).

    Raises:
        ValueError: a band outside the lens; no item passes the gate.
        TypeError: a keyword that is no setting (:class:`ProbeSwapSettings`).
    """
    given = checked_options("run_probe_swap", options, ProbeSwapSettings)
    depth: bool = given.get("depth", True)
    depth_step: int | None = given.get("depth_step")
    probes: bool = given.get("probes", True)
    alpha: float = given.get("alpha", 1.0)
    elapsed = timer()
    items = list(data["items"])
    readable = readable_layers(lens)
    depth_step = depth_step or max(1, model.n_layers // 10)
    starts = readable[::depth_step] if depth else []
    per_item_steps = 1 + 1 + (1 if depth else 0)
    steps = Progress(len(items) * per_item_steps, progress, stop)
    gate_rows, kept = [], []
    for i, item in enumerate(items):
        row = {"item": str(item["name"]), "category": str(item["category"]), "passed": False, "reason": ""}
        words = {k: str(item[k]) for k in WORDS}
        missing = not_single(model, words)
        text = render_prompt(model, item["prompt"], experiment=NAME)
        row["prompt"] = text
        ids = model.encode(text)
        read = clean_read(model, lens, ids, readable)
        row["model_says"] = model.decode([read.greedy])
        row["model_says_id"] = read.greedy
        if missing:
            row["reason"] = "unscored: not one token here: " + ", ".join(missing)
        elif read.greedy not in first_ids(model, words["answer"]):
            row["reason"] = f"gated out: the model says {row['model_says']!r}"
        else:
            row["passed"] = True
            inter_ids = set(word_ids(model, words["intermediate"]).values())
            curve = {layer: ranks_of(lg, inter_ids) <= 5 for layer, lg in read.lens_logits.items()}
            kept.append((i, item, words, ids, curve, read.greedy))
        gate_rows.append(row)
        steps.step()
    gate, chosen = gated_band(model, lens, band, NAME, gate_rows, [k[4] for k in kept], "intermediate")
    layers = list(chosen.layers)
    logit = LogitLens.for_model(model)
    notes: list[str] = []
    probe_plan = None
    if probes:
        probe_plan = probe_arms(model, lens, kept_prompts=[(k[2]["intermediate"], model.encode(
            render_prompt(model, k[1]["prompt"], experiment=NAME))) for k in kept], layers=layers, seed=seed)
    trial_rows, depth_rows = [], []
    for i, item, words, ids, _, greedy in kept:
        spelt = {k: next(iter(word_ids(model, v))) for k, v in words.items()}
        target = set(word_ids(model, words["swap_answer"]).values())
        exclude = set().union(*(set(word_ids(model, v).values()) for v in words.values()))
        null = unrelated_token(model, exclude, derive_seed(seed, i))
        arms: dict[str, list] = {
            "J-lens swap": [Swap(model, lens, spelt["intermediate"], spelt["swap_to"], alpha, layers=layers)],
            "logit-lens swap": [Swap(model, logit, spelt["intermediate"], spelt["swap_to"], alpha, layers=layers)],
            "random directions": [Swap(model, lens, spelt["intermediate"], spelt["swap_to"], alpha, layers=layers,
                                       directions=random_directions(layers, model.d_model, derive_seed(seed, i)))],
            "unrelated swap": [Swap(model, lens, spelt["intermediate"], null, alpha, layers=layers)],
            "answer swap": [Swap(model, lens, greedy, spelt["swap_answer"], alpha, layers=layers)],
        }
        if probe_plan is not None:
            arms.update(probe_plan.arms_for(words["intermediate"], words["swap_to"], spelt["intermediate"]))
        names = list(arms)
        logits = edited_next_logits(model, ids, [arms[n] for n in names])
        for name, lg in zip(names, logits):
            rank = ranks_of(lg, target)
            trial_rows.append({"arm": name, "item": str(item["name"]), "category": str(item["category"]),
                               "source": words["intermediate"], "target": words["swap_answer"],
                               "swap_to": words["swap_to"], "rank": rank, "top1": rank == 1, "top5": rank <= 5,
                               "says": model.decode([int(lg.argmax())]),
                               "null_token": model.decode([null]) if name == "unrelated swap" else "",
                               "null_id": null if name == "unrelated swap" else -1, EDITS: arms[name]})
        steps.step()
        if depth:
            rows = []
            for start in starts:
                span = [x for x in readable if x >= start]
                rows.append(("intermediate", start, [Swap(model, lens, spelt["intermediate"], spelt["swap_to"],
                                                          alpha, layers=span)]))
                rows.append(("answer", start, [Swap(model, lens, greedy, spelt["swap_answer"],
                                                    alpha, layers=span)]))
            logits = edited_next_logits(model, ids, [r[2] for r in rows])
            for (which, start, _), lg in zip(rows, logits):
                depth_rows.append({"item": str(item["name"]), "swap": which, "start": start,
                                   "top1": ranks_of(lg, target) == 1})
            steps.step()
    trials, trial_edits = trial_table(trial_rows)
    arm_names = list(dict.fromkeys(trials["arm"])) if len(trials) else list(ARMS)
    summary = summarise(trials, arm_names, seed=seed)
    extras: dict[str, Any] = {}
    if depth and depth_rows:
        table = pd.DataFrame(depth_rows).groupby(["swap", "start"], as_index=False)["top1"].mean()
        table = table.rename(columns={"top1": "rate"})
        onsets = {which: depth_onset(table[table.swap == which]["start"].tolist(),
                                     table[table.swap == which]["rate"].tolist()) for which in ("intermediate", "answer")}
        extras["depth"] = table
        extras["depth_onset"] = {**onsets, "n_layers": int(model.n_layers),
                                 "earlier_fraction_of_depth": (onsets["answer"] - onsets["intermediate"]) / model.n_layers
                                 if not any(math.isnan(v) for v in onsets.values()) else math.nan}
    settings = {"band": band, "seed": seed, "alpha": alpha, "depth": depth, "depth_step": depth_step, "probes": probes}
    return ExperimentResult(NAME, model.name, str(lens.kind), chosen, gate, trials, summary, extras, settings,
                            elapsed(), tuple(notes), trial_edits)


__all__ = ["ARMS", "ProbeSwapSettings", "depth_onset", "run_probe_swap", "unrelated_token"]
