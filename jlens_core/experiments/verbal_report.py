"""Experiment 2, ``verbal-report``: does the model's one-word report follow a swap of the J-lens coordinates?
(docs/experiments.md)

Per category the prompt ``Think of a {category}. Answer in one word.`` is a user turn (the ``template`` setting)
through the chat template, read where the answer word comes next (after the assistant header, or after a
``prefill`` such as ``"Answer:"``; ``{category}`` is filled there too). The greedy answer is the swap-out token.
The gate (``gate=``): ``"candidate"`` (default) keeps a category when the greedy answer is one of its
candidates; ``"word"`` when it is any word but the category's own name. For each of the first ``n_swaps`` other
candidates (single-token words; the rest are reported as unscored) the answer's lens coordinates are swapped for
the candidate's at every band layer and prompt position; success: the candidate at rank 1 (and top-5) of the
answer position. Arms: the J lens, the logit lens, random directions, and with the J-space the concept-vector
split (``Tell me about {concept}`` minus the mean over the other concepts, swapped norm-matched in full, along
its J part, its non-J part, and a random vector).

The **report correlation**: per layer, the Spearman correlation between the candidates' lens ranks at the answer
position and their output ranks, averaged over the gated categories.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
import pandas as pd

from .._keywords import checked_options
from ..interventions.lens_edits import Swap, random_directions
from ..lenses.lens import LogitLens
from ..lenses.protocol import Lens
from ..models.model import LensModel
from ..reading.tokens import is_word_like
from ..seeds import derive_seed
from .core import (
    EDITS,
    ExperimentResult,
    Progress,
    clean_read,
    edited_next_logits,
    gated_band,
    ranks_of,
    readable_layers,
    render_prompt,
    summarise,
    timer,
    trial_table,
    word_ids,
)
from .jspace_arms import concept_arms

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

NAME = "verbal-report"
TEMPLATE = "Think of a {category}. Answer in one word."
CONCEPT_TEMPLATE = "Tell me about {concept}"
N_SWAPS = 10
GATES = ("candidate", "word")


def _prompt(model: LensModel, text: str, prefill: str) -> str:
    turns = [{"role": "user", "content": text}] + ([{"role": "assistant", "content": prefill}] if prefill else [])
    return render_prompt(model, turns, experiment=NAME)


class VerbalReportSettings(TypedDict, total=False):
    """:func:`run_verbal_report`'s settings by keyword: the question ``template`` (with ``{category}``, default
    :data:`TEMPLATE`), the assistant ``prefill``, ``n_swaps`` per category (:data:`N_SWAPS`), whether the
    ``concepts`` arms run, the swaps' ``alpha`` and the ``gate`` (``"candidate"`` or ``"word"``)."""

    template: str
    prefill: str
    n_swaps: int
    concepts: bool
    alpha: float
    gate: str


def run_verbal_report(model: LensModel, lens: Lens, data: dict, *, band: Any = None, seed: int = 0,
                      progress: Callable[[int, int], None] | None = None, stop: Callable[[], bool] | None = None,
                      **options: Unpack[VerbalReportSettings]) -> ExperimentResult:
    """Run experiment 2 on ``data`` (``{"candidates": {category: [words]}}``); see the module docstring. Its settings
    (:class:`VerbalReportSettings`) are keywords.

    Raises:
        NoChatTemplateError: the model has no chat template.
        ValueError: a template without ``{category}``, a band outside the lens, an empty gate.
        TypeError: a keyword that is no setting.
    """
    given = checked_options("run_verbal_report", options, VerbalReportSettings)
    template: str = given.get("template", TEMPLATE)
    prefill: str = given.get("prefill", "")
    n_swaps: int = given.get("n_swaps", N_SWAPS)
    concepts: bool = given.get("concepts", True)
    alpha: float = given.get("alpha", 1.0)
    gate: str = given.get("gate", "candidate")
    if "{category}" not in template:
        raise ValueError(f"The template {template!r} has no '{{category}}' to fill.")
    if gate not in GATES:
        raise ValueError(f"gate={gate!r} is not a gate: use 'candidate' (the answer is one of the category's "
                         "candidates) or 'word' (any word but the category's name).")
    elapsed = timer()
    candidates = {str(c): [str(w) for w in words] for c, words in data["candidates"].items()}
    readable = readable_layers(lens)
    steps = Progress(2 * len(candidates), progress, stop)
    gate_rows, kept, unscored = [], [], []
    for category, words in candidates.items():
        text = _prompt(model, template.replace("{category}", category), prefill.replace("{category}", category))
        ids = model.encode(text)
        read = clean_read(model, lens, ids, readable)
        answer = model.decode([read.greedy])
        row = {"item": category, "category": category, "passed": False, "reason": "", "model_says": answer,
               "prompt": text}
        single = {}
        for w in words:
            found = word_ids(model, w)
            if found:
                single[w] = found
            else:
                unscored.append({"category": category, "word": w, "reason": "not one token here"})
        own = set(word_ids(model, category).values())
        if not is_word_like(answer.strip()) or not answer.strip() or read.greedy in own:
            row["reason"] = f"gated out: the model answers {answer!r}, not a word other than the category's name"
        elif gate == "candidate" and not any(read.greedy in found.values() for found in single.values()):
            row["reason"] = f"gated out: the model answers {answer!r}, not one of the candidates"
        else:
            others = [w for w, found in single.items() if read.greedy not in found.values()][:int(n_swaps)]
            if not others:
                row["reason"] = "gated out: no single-token candidate other than the answer"
            else:
                row["passed"] = True
                row["swaps"] = len(others)
                lens_rank = {layer: [ranks_of(lg, single[w].values()) for w in single]
                             for layer, lg in read.lens_logits.items()}
                out_rank = [ranks_of(read.logits, single[w].values()) for w in single]
                kept.append((category, ids, read, answer, others, single, lens_rank, out_rank))
        gate_rows.append(row)
        steps.step()
    hits = [{layer: ranks_of(lg, [k[2].greedy]) <= 5 for layer, lg in k[2].lens_logits.items()} for k in kept]
    gate, chosen = gated_band(model, lens, band, NAME, gate_rows, hits, "reported answer")
    layers = list(chosen.layers)
    logit = LogitLens.for_model(model)
    notes: list[str] = []
    split = None
    if concepts:
        names = sorted({w for k in kept for w in k[5]} | {k[3].strip() for k in kept})
        split = concept_arms(model, lens, prompts={n: model.encode(render_prompt(
            model, [{"role": "user", "content": CONCEPT_TEMPLATE.replace("{concept}", n)}], experiment=NAME))
            for n in names}, layers=layers, seed=seed)
    rows = []
    for n, (category, ids, read, answer, others, single, _, _) in enumerate(kept):
        arms_per: list[tuple[str, str, list]] = []
        for j, word in enumerate(others):
            spelt = next(iter(single[word]))
            arms_per += [("J-lens swap", word, [Swap(model, lens, read.greedy, spelt, alpha, layers=layers)]),
                         ("logit-lens swap", word, [Swap(model, logit, read.greedy, spelt, alpha, layers=layers)]),
                         ("random directions", word, [Swap(model, lens, read.greedy, spelt, alpha, layers=layers,
                                                           directions=random_directions(
                                                               layers, model.d_model, derive_seed(seed, n, j)))])]
            if split is not None:
                arms_per += [(arm, word, edits) for arm, edits in split.arms_for(answer.strip(), word).items()]
        logits = edited_next_logits(model, ids, [a[2] for a in arms_per])
        for (arm, word, edits), lg in zip(arms_per, logits):
            rank = ranks_of(lg, single[word].values())
            rows.append({"arm": arm, "item": category, "category": category, "source": answer, "target": word,
                         "rank": rank, "top1": rank == 1, "top5": rank <= 5, "says": model.decode([int(lg.argmax())]),
                         EDITS: edits})
        steps.step()
    trials, trial_edits = trial_table(rows)
    summary = summarise(trials, list(dict.fromkeys(trials["arm"])), seed=seed)
    corr_rows = []
    for layer in readable:
        values = []
        for k in kept:
            a, b = pd.Series(k[6][layer], dtype=float), pd.Series(k[7], dtype=float)
            if len(a) > 2 and a.nunique() > 1 and b.nunique() > 1:
                values.append(a.rank().corr(b.rank()))  # Spearman: Pearson of the ranks (average ranks for ties)
        corr_rows.append({"layer": layer, "spearman": float(np.mean(values)) if values else float("nan"),
                          "categories": len(values)})
    extras = {"report_correlation": pd.DataFrame(corr_rows),
              "unscored_words": pd.DataFrame(unscored, columns=["category", "word", "reason"])}
    settings = {"band": band, "seed": seed, "alpha": alpha, "template": template, "prefill": prefill, "n_swaps": n_swaps,
                "concepts": concepts, "gate": gate}
    return ExperimentResult(NAME, model.name, str(lens.kind), chosen, gate, trials, summary, extras, settings,
                            elapsed(), tuple(notes), trial_edits)


__all__ = ["CONCEPT_TEMPLATE", "N_SWAPS", "TEMPLATE", "VerbalReportSettings", "run_verbal_report"]
