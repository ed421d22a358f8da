"""Experiment 5, ``directed-modulation``: does an instruction to think about (or not think about) a word change how
often the lens reads it while the model writes something else? (docs/experiments.md)

A trial is one phrasing, one carrier sentence and one target. The phrasing's ``text`` with ``{x}`` filled is a
user turn; the carrier is teacher-forced as the reply. Score: a **hit** when the target's token is at lens rank
1 (or within ``top_k``) at some band layer and some position of the carrier's span; the hit rate is contrasted
across the phrasings' group kinds (``focus``, ``suppress``, ``control``) and the baseline without an instruction.
Targets: the members of ``topic_categories`` (``{x}`` is the word) and the ``math_problems`` (``{x}`` is the
expression, the target its answer; gated: the model answers ``{expr} =`` with it). Targets that are not one
token here are reported as unscored. Only a reading: no edit, one forward per trial.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pandas as pd
import torch

from ..interventions.read_directions import last_source_layer
from ..lenses.protocol import Lens
from ..models.model import LensModel
from ..reading.inputs import record_residuals
from .core import (
    ExperimentResult,
    Progress,
    clean_read,
    first_ids,
    gate_error,
    render_prompt,
    resolve_band,
    summarise,
    timer,
    word_ids,
)
from .introspection import user_positions

NAME = "directed-modulation"
KINDS = ("focus", "suppress", "control")
BASELINE = "baseline"


def carrier_hits(model: LensModel, lens: Lens, ids: torch.Tensor, span: list[int], layers: list[int],
                 target: set[int], top_k: int) -> tuple[bool, int]:
    """``(hit, best rank)``: the target's best lens rank over ``span`` x ``layers`` (one forward)."""
    recorded = record_residuals(model, ids, layers)
    best = None
    with torch.no_grad():
        for layer in layers:
            logits = model.unembed(lens.transport(recorded[layer][span], int(layer))).float()  # [span, vocab]
            values = logits[:, sorted(target)].max(dim=1).values  # [span]
            ranks = 1 + (logits > values[:, None]).sum(dim=1)
            low = int(ranks.min())
            best = low if best is None else min(best, low)
    return (best is not None and best <= top_k), int(best or 0)


def run_modulation(model: LensModel, lens: Lens, data: dict, *, band: Any = None, seed: int = 0, top_k: int = 1,
                   max_targets: int | None = None, progress: Callable[[int, int], None] | None = None,
                   stop: Callable[[], bool] | None = None) -> ExperimentResult:
    """Run experiment 5 on ``data`` (the directed-modulation format); see the module docstring.

    Args:
        band: the layers read; ``None`` uses the default edit band (``n_layers // 3`` .. the lens's last source).
        top_k: a hit is the target within this lens rank (1: top-1).
        max_targets: at most this many targets per topic category and math tier (``None``: all).

    Raises:
        ValueError: a group without a kind, a band outside the lens, no target passes the gate.
    """
    elapsed = timer()
    kinds = {str(g): str(k) for g, k in data["group_kind"].items()}
    phrasings = list(data["phrasings"])
    lacking = sorted({str(p["group"]) for p in phrasings} - set(kinds))
    if lacking:
        raise ValueError(f"group_kind gives no kind for the groups {', '.join(lacking)}: map each to focus, suppress "
                         "or control.")
    chosen = resolve_band(model, lens, band, {}, concept="target")
    layers = [x for x in chosen.layers if x <= last_source_layer(lens)]
    targets: list[dict] = []
    for cat in data["topic_categories"]:
        members = list(cat["members"])[:max_targets] if max_targets else list(cat["members"])
        targets += [{"x": str(m), "target": str(m), "category": str(cat["name"]), "kind": "topic"} for m in members]
    tiers: dict[str, int] = {}
    for prob in data["math_problems"]:
        tier = str(prob["tier"])
        tiers[tier] = tiers.get(tier, 0) + 1
        if max_targets is None or tiers[tier] <= max_targets:
            targets.append({"x": str(prob["expr"]), "target": str(prob["answer"]), "category": f"math tier {tier}",
                            "kind": "math"})
    carriers = [str(c) for c in data["carrier_sentences"]]
    steps = Progress(len(targets) * len(carriers) * (len(phrasings) + 1), progress, stop)
    gate_rows, rows = [], []
    for t in targets:
        row = {"item": t["x"], "category": t["category"], "passed": False, "reason": "", "target": t["target"]}
        found = word_ids(model, t["target"])
        if not found:
            row["reason"] = f"unscored: not one token here: target {t['target']!r}"
        elif t["kind"] == "math":
            text = render_prompt(model, f"{t['x']} =", experiment=NAME)
            said = clean_read(model, lens, model.encode(text), []).greedy
            row["model_says"] = model.decode([said])
            if said not in first_ids(model, t["target"]):
                row["reason"] = f"gated out: the model says {row['model_says']!r} for {t['x']} ="
            else:
                row["passed"] = True
        else:
            row["passed"] = True
        gate_rows.append(row)
        if not row["passed"]:
            steps.step(len(carriers) * (len(phrasings) + 1))
            continue
        ids_target = set(found.values())
        for c, carrier in enumerate(carriers):
            arms = [(BASELINE, BASELINE, "")] + [(kinds[str(p["group"])], str(p["name"]),
                                                    str(p["text"]).replace("{x}", t["x"])) for p in phrasings]
            for kind, pname, instruction in arms:
                turns = ([{"role": "user", "content": instruction}] if instruction else
                         [{"role": "user", "content": "Write a sentence."}])
                text = render_prompt(model, [*turns, {"role": "assistant", "content": carrier}], experiment=NAME)
                ids = model.encode(text)
                span = user_positions(model, text, carrier)
                hit, rank = carrier_hits(model, lens, ids, span, layers, ids_target, top_k)
                rows.append({"arm": kind, "phrasing": pname, "item": t["x"], "category": t["category"],
                             "target": t["target"], "carrier": c, "rank": rank, "top1": hit, "top5": rank <= 5})
                steps.step()
    gate = pd.DataFrame(gate_rows)
    if not rows:
        raise gate_error(NAME, gate)
    trials = pd.DataFrame(rows)
    summary = summarise(trials, [BASELINE, *[k for k in KINDS if k in set(trials["arm"])]], seed=seed)
    by_phrasing = trials.groupby(["arm", "phrasing"], as_index=False)["top1"].mean().rename(columns={"top1": "hit_rate"})
    extras = {"by_phrasing": by_phrasing}
    settings = {"band": band, "seed": seed, "top_k": top_k, "max_targets": max_targets}
    return ExperimentResult(NAME, model.name, str(lens.kind), chosen, gate, trials, summary, extras, settings,
                            elapsed(), () if band is not None else (
                                "The band is the default edit band (no curve to derive it from before reading).",))


__all__ = ["BASELINE", "KINDS", "carrier_hits", "run_modulation"]
