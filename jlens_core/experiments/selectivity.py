"""Experiment 6's selectivity (``selectivity-language``): is a passage's language read where the question asks
for it, and does the report follow a swap of it while the continuation keeps its language? (docs/experiments.md)

Each passage (``category`` is its language) is a user turn followed by a question: ``explicit_q`` asks for the
language, ``automatic_q`` for something that needs no report of it. **Label hits**: a hit when one of the
category's ``intermediates`` (label words) is at lens rank 1 at some band layer and some position of the
question's tokens; the explicit-minus-automatic hit rate is the selectivity. **The language swap**: the
category's first label swapped for the next category's (the J-lens coordinate swap, every band layer and prompt
position) under both tasks: under the explicit task the report should follow (the next token is the other
label; gated: the clean model names the passage's language), under the automatic task the continuation should
keep its language (the greedy next token is unchanged). Random directions are the control of both. ``authors``
are read with the format but not scored here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..interventions.lens_edits import Swap, random_directions
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
    ranks_of,
    readable_layers,
    render_prompt,
    summarise,
    timer,
    trial_table,
    word_ids,
)
from .introspection import user_positions
from .modulation import carrier_hits

NAME = "selectivity-language"
TASKS = ("explicit", "automatic")


def run_selectivity(model: LensModel, lens: Lens, data: dict, *, band: Any = None, seed: int = 0,
                    alpha: float = 1.0, prefill: str = "", automatic_prefill: str = "", progress: Callable[[int, int], None] | None = None,
                    stop: Callable[[], bool] | None = None) -> ExperimentResult:
    """Run the selectivity experiment on ``data`` (the selectivity-language format); see the module docstring.

    Args:
        prefill: the explicit task's reply start, teacher-forced after its question (e.g. ``"The language is"``);
            automatic_prefill: the automatic task's (default: none, the reply starts fresh).

    Raises:
        ValueError: fewer than two categories with a single-token label, a band outside the lens, no passage the
            model can report the language of.
    """
    elapsed = timer()
    task = data["task"]
    questions = {"explicit": str(task["explicit_q"]), "automatic": str(task["automatic_q"])}
    labels = {str(c): [str(w) for w in words if word_ids(model, str(w))] for c, words in data["intermediates"].items()}
    order = [c for c, words in labels.items() if words]
    if len(order) < 2:
        raise ValueError("Fewer than two categories have a label word that is one token here: the language swap "
                         "needs two.")
    readable = readable_layers(lens)
    passages = list(data["passages"])
    steps = Progress(2 * len(passages), progress, stop)
    prompts, gate_rows, hits = {}, [], []
    for p in passages:
        category = str(p["category"])
        row = {"item": str(p["key"]), "category": category, "passed": False, "reason": ""}
        if not labels.get(category):
            row["reason"] = f"unscored: no label of {category!r} is one token here"
            gate_rows.append(row)
            steps.step(2)
            continue
        label_ids = set().union(*(set(word_ids(model, w).values()) for w in labels[category]))
        for name, question in questions.items():
            start = prefill if name == "explicit" else automatic_prefill
            turns = [{"role": "user", "content": f"{p['text']}\n\n{question}"}] + (
                [{"role": "assistant", "content": start}] if start else [])
            text = render_prompt(model, turns, experiment=NAME)
            prompts[(str(p["key"]), name)] = (text, model.encode(text), question, label_ids)
        text, ids, _, _ = prompts[(str(p["key"]), "explicit")]
        read = clean_read(model, lens, ids, readable)
        row["model_says"], row["prompt"] = model.decode([read.greedy]), text
        answers = set().union(*(first_ids(model, w) for w in labels[category]))
        if read.greedy not in answers:
            row["reason"] = f"gated out: asked for the language, the model says {row['model_says']!r}"
        else:
            row["passed"] = True
            hits.append({layer: ranks_of(lg, label_ids) <= 5 for layer, lg in read.lens_logits.items()})
        gate_rows.append(row)
        steps.step()
    gate, chosen = gated_band(model, lens, band, NAME, gate_rows, hits, "language label")
    layers = list(chosen.layers)
    rows = []
    for n, p in enumerate(passages):
        key, category = str(p["key"]), str(p["category"])
        if (key, "explicit") not in prompts:
            continue
        other = order[(order.index(category) + 1) % len(order)] if category in order else order[0]
        source, target = labels[category][0], labels[other][0]
        passed = bool(gate.set_index("item").loc[key, "passed"])
        for name in TASKS:
            text, ids, question, label_ids = prompts[(key, name)]
            span = user_positions(model, text, question)
            hit, rank = carrier_hits(model, lens, ids, span, layers, label_ids, 1)
            rows.append({"arm": f"label hits · {name}", "item": key, "category": category, "task": name,
                         "target": source, "rank": rank, "top1": hit, "top5": rank <= 5})
            if name == "explicit" and not passed:
                continue
            clean = clean_read(model, lens, ids, []).greedy
            s_from, s_to = next(iter(word_ids(model, source))), next(iter(word_ids(model, target)))
            plan = [("J-lens swap", [Swap(model, lens, s_from, s_to, alpha, layers=layers)]),
                    ("random directions", [Swap(model, lens, s_from, s_to, alpha, layers=layers,
                                                directions=random_directions(layers, model.d_model,
                                                                             derive_seed(seed, n)))])]
            target_ids = set(word_ids(model, target).values())
            for (arm, edits), lg in zip(plan, edited_next_logits(model, ids, [e for _, e in plan])):
                said = int(lg.argmax())
                if name == "explicit":
                    rank, ok = ranks_of(lg, target_ids), said in target_ids
                    label = f"{arm} · explicit: report follows"
                else:
                    rank, ok = ranks_of(lg, [clean]), said == clean
                    label = f"{arm} · automatic: continuation keeps"
                rows.append({"arm": label, "item": key, "category": category, "task": name, "target": target,
                             "rank": rank, "top1": ok, "top5": rank <= 5, "says": model.decode([said]),
                             "source": source, "prompt": text, EDITS: edits})  # the task's own prompt: a link replays it
        steps.step()
    trials, trial_edits = trial_table(rows)
    summary = summarise(trials, list(dict.fromkeys(trials["arm"])), seed=seed)
    rates = summary.set_index("arm")["rate"]
    extras = {"selectivity": {"explicit_hit_rate": float(rates.get("label hits · explicit", float("nan"))),
                              "automatic_hit_rate": float(rates.get("label hits · automatic", float("nan"))),
                              "explicit_minus_automatic": float(rates.get("label hits · explicit", float("nan"))
                                                                - rates.get("label hits · automatic", float("nan")))}}
    settings = {"band": band, "seed": seed, "alpha": alpha, "prefill": prefill, "automatic_prefill": automatic_prefill, "task": str(task.get("name", ""))}
    return ExperimentResult(NAME, model.name, str(lens.kind), chosen, gate, trials, summary, extras, settings,
                            elapsed(), ("authors are read with the format but not scored in this version.",), trial_edits)


__all__ = ["TASKS", "run_selectivity"]
