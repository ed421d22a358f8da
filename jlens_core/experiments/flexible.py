"""Experiment 3, ``flexible-generalization``: one swap of an argument redirects every function of it?
(docs/experiments.md)

A category has four arguments and functions, each a ``template`` with ``{arg}`` and the ``answers`` per argument.
Every (function, argument) cell is gated (the greedy next token is the answer's first token). For a gated cell
``(f, a)`` and each other argument ``b`` of the category whose cell ``(f, b)`` is gated too and answers
differently, ``a``'s lens coordinates are swapped for ``b``'s at every band layer and prompt position; success:
``answers[b]`` at top-1. Arms: the J lens, the logit lens, random directions. Outputs: the 4 x 4 grid per
function (rows: the argument in the prompt, columns: the argument swapped in) and the **broadcast rate**: of the
fixed swaps ``a -> b`` scored on two or more functions, the share that redirects two or more.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from ..interventions.intervals import wilson_interval
from ..interventions.lens_edits import Swap, random_directions
from ..lenses.lens import LogitLens
from ..lenses.protocol import Lens
from ..models.model import LensModel
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

NAME = "flexible-generalization"


def run_flexible(model: LensModel, lens: Lens, data: dict, *, band: Any = None, seed: int = 0, alpha: float = 1.0,
                 progress: Callable[[int, int], None] | None = None,
                 stop: Callable[[], bool] | None = None) -> ExperimentResult:
    """Run experiment 3 on ``data`` (``{"categories": [...]}``); see the module docstring.

    Raises:
        ValueError: a band outside the lens; no cell passes the gate.
    """
    elapsed = timer()
    categories = list(data["categories"])
    readable = readable_layers(lens)
    cells = [(c, f, str(a)) for c in categories for f in c["funcs"] for a in c["args"]]
    steps = Progress(2 * len(cells), progress, stop)
    gate_rows, gated = [], {}
    for category, func, arg in cells:
        answer = func["answers"].get(arg)
        row = {"item": f"{func['name']}({arg})", "category": str(category["name"]), "function": str(func["name"]),
               "arg": arg, "answer": answer, "passed": False, "reason": ""}
        if answer is None:
            row["reason"] = f"unscored: no answer for {arg!r}"
            gate_rows.append(row)
            steps.step()
            continue
        missing = not_single(model, {"arg": arg, "answer": str(answer)})
        row["prompt"] = render_prompt(model, str(func["template"]).replace("{arg}", arg), experiment=NAME)
        ids = model.encode(row["prompt"])
        read = clean_read(model, lens, ids, readable)
        row["model_says"] = model.decode([read.greedy])
        if missing:
            row["reason"] = "unscored: not one token here: " + ", ".join(missing)
        elif read.greedy not in first_ids(model, str(answer)):
            row["reason"] = f"gated out: the model says {row['model_says']!r}"
        else:
            row["passed"] = True
            arg_ids = set(word_ids(model, arg).values())
            gated[(str(category["name"]), str(func["name"]), arg)] = (
                ids, {layer: ranks_of(lg, arg_ids) <= 5 for layer, lg in read.lens_logits.items()})
        gate_rows.append(row)
        steps.step()
    gate, chosen = gated_band(model, lens, band, NAME, gate_rows, [g[1] for g in gated.values()], "argument")
    layers = list(chosen.layers)
    logit = LogitLens.for_model(model)
    rows = []
    for n, (category, func, a) in enumerate(cells):
        key = (str(category["name"]), str(func["name"]), a)
        if key not in gated:
            steps.step()
            continue
        ids = gated[key][0]
        plan: list[tuple[str, str, list]] = []
        for j, b in enumerate(str(x) for x in category["args"]):
            if b == a or (key[0], key[1], b) not in gated or func["answers"][b] == func["answers"][a]:
                continue
            sa, sb = next(iter(word_ids(model, a))), next(iter(word_ids(model, b)))
            plan += [("J-lens swap", b, [Swap(model, lens, sa, sb, alpha, layers=layers)]),
                     ("logit-lens swap", b, [Swap(model, logit, sa, sb, alpha, layers=layers)]),
                     ("random directions", b, [Swap(model, lens, sa, sb, alpha, layers=layers, directions=random_directions(
                         layers, model.d_model, derive_seed(seed, n, j)))])]
        logits = edited_next_logits(model, ids, [p[2] for p in plan])
        for (arm, b, edits), lg in zip(plan, logits):
            target = str(func["answers"][b])
            rank = ranks_of(lg, word_ids(model, target).values())
            rows.append({"arm": arm, "item": f"{func['name']}({a})", "category": key[0], "function": key[1],
                         "source": a, "swapped_in": b, "target": target, "rank": rank, "top1": rank == 1,
                         "top5": rank <= 5, "says": model.decode([int(lg.argmax())]), EDITS: edits})
        steps.step()
    trials, trial_edits = trial_table(rows, columns=["arm", "item", "category", "function", "source", "swapped_in", "target",
                                         "rank", "top1", "top5", "says"])
    summary = summarise(trials, ["J-lens swap", "logit-lens swap", "random directions"], seed=seed)
    grids = {}
    j_trials = trials[trials["arm"] == "J-lens swap"]
    for category in categories:
        args = [str(x) for x in category["args"]]
        for func in category["funcs"]:
            part = j_trials[(j_trials["category"] == str(category["name"])) & (j_trials["function"] == str(func["name"]))]
            grid = pd.DataFrame(np.nan, index=args, columns=args)
            for r in part.itertuples():
                grid.loc[r.source, r.swapped_in] = float(r.top1)
            grids[f"{category['name']}/{func['name']}"] = grid.reset_index(names="in prompt")
    broadcast_rows = []
    for (cat, a, b), part in j_trials.groupby(["category", "source", "swapped_in"]):
        broadcast_rows.append({"category": cat, "source": a, "swapped_in": b, "functions": len(part),
                               "redirected": int(part["top1"].sum())})
    broadcast = pd.DataFrame(broadcast_rows, columns=["category", "source", "swapped_in", "functions", "redirected"])
    eligible = broadcast[broadcast["functions"] >= 2]
    hits = int((eligible["redirected"] >= 2).sum())
    low, high = wilson_interval(hits, len(eligible))
    extras = {"grids": grids, "broadcast": broadcast,
              "broadcast_rate": {"swaps": len(eligible), "broadcasting": hits,
                                 "rate": hits / len(eligible) if len(eligible) else float("nan"),
                                 "wilson_low": low, "wilson_high": high}}
    return ExperimentResult(NAME, model.name, str(lens.kind), chosen, gate, trials, summary, extras,
                            {"band": band, "seed": seed, "alpha": alpha}, elapsed(), trial_edits=trial_edits)


__all__ = ["run_flexible"]
