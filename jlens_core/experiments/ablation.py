"""Experiment 6's ablation battery (``ablation-battery``): does removing the J-space break flexible tasks while
automatic ones survive? (docs/experiments.md)

The whole top-``k`` J-space component of every position is removed across the band
(:class:`~jlens_core.interventions.jspace_edits.AblateJSpace`, strength ``s``), against a matched random
ablation (a random dictionary's fit of the same norm, ``random=True``). Tasks:

* **two-hop** (flexible): the probe-swap items that pass the gate; success: the answer's first token at top-1;
* **copying** (automatic): a list of words written twice; success: the greedy next token equals the text's next
  token at the positions of the second copy;
* **induction** (automatic): a seeded sequence of random word tokens written twice, scored the same way;
* **prose** (automatic): held-out stdlib docstrings (the ``eval`` split of the built-in corpus), next-token
  accuracy at every position.

The "selective damage" table gives each task's accuracy by strength under the J-space ablation and the random one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
import pandas as pd
import torch

from .._keywords import checked_options
from ..corpus import load_corpus
from ..interventions.intervals import wilson_interval
from ..lenses.protocol import Lens
from ..models.model import LensModel
from ..reading.tokens import TokenDisplay
from .core import (
    EDITS,
    ExperimentResult,
    Progress,
    RowEdits,
    clean_read,
    clustered_bootstrap,
    first_ids,
    gated_band,
    ranks_of,
    readable_layers,
    render_prompt,
    timer,
    trial_table,
    word_ids,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

NAME = "ablation-battery"
STRENGTHS = (0.5, 1.0)
COPY_WORDS = ("river", "stone", "garden", "window", "silver", "market", "candle", "forest", "letter", "bridge")
ARMS = ("J-space ablation", "random ablation")


def automatic_prompts(model: LensModel, *, seed: int, n_texts: int = 2, max_tokens: int = 32,
                      prose: Sequence[str] | None = None) -> list[dict]:
    """The automatic tasks' token sequences: ``{"task", "item", "ids" [1, seq], "from"}`` (scored from ``from``);
    ``prose`` replaces the held-out docstrings."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_texts):
        words = [COPY_WORDS[j] for j in rng.permutation(len(COPY_WORDS))[:6]]
        first = model.encode("Copy the list: " + " ".join(words) + ". Again: ")
        ids = model.encode("Copy the list: " + " ".join(words) + ". Again: " + " ".join(words))
        out.append({"task": "copying", "item": f"copying_{i}", "ids": ids, "from": int(first.shape[1]) - 1})
    display = TokenDisplay.for_model(model)
    pool = [t for t in np.flatnonzero(display.word_like_mask()).tolist() if display.texts[t].startswith(" ")]
    for i in range(n_texts):
        seq = [int(pool[j]) for j in rng.integers(0, len(pool), size=10)]
        bos = model.encode("x")[0, :-1].tolist()  # the tokenizer's own prefix (a BOS), if any
        ids = torch.tensor([bos + seq + seq], device=model.device)
        out.append({"task": "induction", "item": f"induction_{i}", "ids": ids, "from": len(bos) + len(seq) - 1})
    texts = list(prose) if prose is not None else load_corpus(n=n_texts, split="eval", min_chars=200)
    for i, text in enumerate(texts[:n_texts]):
        ids = model.encode(text, max_length=max_tokens)
        out.append({"task": "prose", "item": f"prose_{i}", "ids": ids, "from": 1})
    return out


class AblationSettings(TypedDict, total=False):
    """:func:`run_ablation_battery`'s settings by keyword (its Args): ``strengths``, ``k``, ``n_texts``, ``prose``."""

    strengths: tuple[float, ...]
    k: int
    n_texts: int
    prose: Sequence[str] | None


def run_ablation_battery(model: LensModel, lens: Lens, data: dict, *, band: Any = None, seed: int = 0,
                         progress: Callable[[int, int], None] | None = None, stop: Callable[[], bool] | None = None,
                         **options: Unpack[AblationSettings]) -> ExperimentResult:
    """Run the ablation battery on the two-hop items of ``data`` (the probe-swap format); see the module docstring.

    Args:
        strengths: the ablation strengths (0 is the clean run); k: atoms per position; n_texts: texts per
            automatic task; prose: the prose texts (default: held-out stdlib docstrings).

    Raises:
        ValueError: a band outside the lens, no two-hop item passes the gate.
        TypeError: a keyword that is no setting (:class:`AblationSettings`).
    """
    given = checked_options("run_ablation_battery", options, AblationSettings)
    strengths: tuple[float, ...] = given.get("strengths", STRENGTHS)
    k: int = given.get("k", 25)
    n_texts: int = given.get("n_texts", 2)
    prose: Sequence[str] | None = given.get("prose")
    from ..interventions.jspace_edits import AblateJSpace

    elapsed = timer()
    items = list(data["items"])
    readable = readable_layers(lens)
    automatic = automatic_prompts(model, seed=seed, n_texts=n_texts, prose=prose)
    steps = Progress(2 * len(items) + len(automatic), progress, stop)
    gate_rows, kept = [], []
    for item in items:
        text = render_prompt(model, item["prompt"], experiment=NAME)
        ids = model.encode(text)
        read = clean_read(model, lens, ids, readable)
        row = {"item": str(item["name"]), "category": "two-hop", "passed": False, "reason": "",
               "model_says": model.decode([read.greedy]), "prompt": text}
        if not word_ids(model, str(item["intermediate"])):
            row["reason"] = f"unscored: not one token here: intermediate {item['intermediate']!r}"
        elif read.greedy not in first_ids(model, str(item["answer"])):
            row["reason"] = f"gated out: the model says {row['model_says']!r}"
        else:
            row["passed"] = True
            inter = set(word_ids(model, str(item["intermediate"])).values())
            kept.append((item, ids, {layer: ranks_of(lg, inter) <= 5 for layer, lg in read.lens_logits.items()}))
        gate_rows.append(row)
        steps.step()
    gate, chosen = gated_band(model, lens, band, NAME, gate_rows, [c[2] for c in kept], "intermediate")
    layers = list(chosen.layers)

    def edits() -> list[tuple[str, float, list]]:
        rows: list[tuple[str, float, list]] = [("clean", 0.0, [])]
        for s in strengths:
            rows.append(("J-space ablation", float(s), [AblateJSpace(model, lens, k=k, strength=s, layers=layers)]))
            rows.append(("random ablation", float(s), [AblateJSpace(model, lens, k=k, strength=s, layers=layers,
                                                                    random=True, seed=seed)]))
        return rows

    plan = edits()
    trial_rows = []
    for item, ids, _ in kept:
        greedy = RowEdits(model, [p[2] for p in plan], int(ids.shape[-1]))
        greedy.record_clean(ids)
        answers = first_ids(model, str(item["answer"]))
        for (arm, s, row_edits), out in zip(plan, greedy.greedy_all(ids)):
            trial_rows.append({"task": "two-hop", "item": str(item["name"]), "arm": arm, "strength": s,
                               "positions": 1, "correct": int(int(out[-1]) in answers), EDITS: row_edits})
        steps.step()
    for task in automatic:
        ids = task["ids"]
        runner = RowEdits(model, [p[2] for p in plan], int(ids.shape[-1]))
        runner.record_clean(ids)
        truth = ids[0, task["from"] + 1:]
        for (arm, s, row_edits), out in zip(plan, runner.greedy_all(ids)):
            guess = out[task["from"]:-1]
            trial_rows.append({"task": task["task"], "item": task["item"], "arm": arm, "strength": s,
                               "positions": int(truth.numel()), "correct": int((guess == truth).sum()),
                               EDITS: row_edits})
        steps.step()
    trials, trial_edits = trial_table(trial_rows)
    trials["accuracy"] = trials["correct"] / trials["positions"]
    trials["category"] = trials["task"]
    summary_rows = []
    for (task, arm, s), part in trials.groupby(["task", "arm", "strength"], sort=False):
        n, wins = int(part["positions"].sum()), int(part["correct"].sum())
        low, high = wilson_interval(wins, n)
        per_position = np.repeat(part["correct"].to_numpy() / part["positions"].to_numpy(),
                                 part["positions"].to_numpy())
        b_low, b_high = clustered_bootstrap(per_position, np.repeat(part["item"].to_numpy(),
                                                                    part["positions"].to_numpy()), seed=seed)
        summary_rows.append({"arm": f"{task} · {arm}" + ("" if arm == "clean" else f" · s={s:g}"), "task": task,
                             "ablation": arm, "strength": s, "trials": n, "successes": wins,
                             "rate": wins / n if n else math.nan, "wilson_low": low, "wilson_high": high,
                             "boot_low": b_low, "boot_high": b_high, "top5_rate": math.nan})
    summary = pd.DataFrame(summary_rows)
    damage = summary[["task", "ablation", "strength", "rate"]].rename(columns={"ablation": "arm", "rate": "accuracy"})
    clean = damage[damage["arm"] == "clean"].set_index("task")["accuracy"]
    ablated = damage[damage["arm"] != "clean"]
    # each ablation's curve starts from the clean run (strength 0)
    starts = pd.DataFrame([{"task": t, "arm": arm, "strength": 0.0, "accuracy": acc} for t, acc in clean.items()
                           for arm in ARMS])
    selective = ablated.pivot_table(index=["task", "strength"], columns="arm", values="accuracy").reset_index()
    selective.columns.name = None
    selective.insert(2, "clean", selective["task"].map(clean))
    extras = {"damage": pd.concat([starts, ablated], ignore_index=True), "selective_damage": selective}
    settings = {"band": band, "seed": seed, "strengths": list(strengths), "k": k, "n_texts": n_texts}
    return ExperimentResult(NAME, model.name, str(lens.kind), chosen, gate, trials, summary, extras, settings,
                            elapsed(), trial_edits=trial_edits)


__all__ = ["STRENGTHS", "AblationSettings", "automatic_prompts", "run_ablation_battery"]
