"""Experiment 4, ``verbal-introspection``: after a concept is injected, does the model name it? (docs/experiments.md)

``intro_prompt`` (turns) asks the model about its thoughts; each ``prefills`` text is teacher-forced as the reply
and ends in an open quote. The concept's unit J-lens vector ``v̂`` (the lens's read direction of ``surface``'s
token) times the layer's mean residual norm (over the clean prompt's positions) times a strength ``s`` is added
at every band layer on the user turn's tokens. Score: the rank of ``surface`` at the open quote (the last
position); the result gives the median reciprocal rank and the top-1 rate against strength, with strength 0 and
a random unit direction of the same size as controls. Gate: ``surface`` is one token, and the clean run does not
already put it at rank 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd
import torch

from ..interventions.read_directions import last_source_layer, token_direction
from ..lenses.protocol import Lens
from ..models.model import LensModel
from ..reading.edit_hooks import PositionRule
from ..reading.inputs import record_residuals
from ..seeds import generator, unit_directions
from .core import (
    EDITS,
    ExperimentResult,
    Progress,
    edited_next_logits,
    gate_error,
    ranks_of,
    render_prompt,
    resolve_band,
    summarise,
    timer,
    trial_table,
    word_ids,
)

NAME = "verbal-introspection"
STRENGTHS = (0.0, 1.0, 2.0, 4.0)
ARMS = ("J-lens vector", "random direction")


class Inject:
    """``h <- h + scale_l * u_l`` at the band layers and the given positions (the residual-edit protocol)."""

    needs_clean = False

    def __init__(self, vectors: dict[int, torch.Tensor], scales: dict[int, float], positions: Sequence[int]) -> None:
        self.layers = sorted(vectors)
        self.vectors, self.scales = vectors, scales
        self.rule = PositionRule(tuple(sorted(int(p) for p in positions)))

    def selects(self, positions: torch.Tensor, n_prompt: int) -> torch.Tensor:
        return self.rule.selects(positions, n_prompt)

    def apply(self, layer: int, h: torch.Tensor, clean: torch.Tensor | None) -> torch.Tensor:
        if self.scales[layer] == 0.0:
            return h
        return h.float() + self.scales[layer] * self.vectors[layer].to(h.device)

    def __repr__(self) -> str:
        scales = [self.scales[layer] for layer in self.layers]
        return (f"inject at layers {self.layers[0]}-{self.layers[-1]}, {len(self.rule.positions or ())} positions, "
                f"scale {min(scales):.3g}-{max(scales):.3g}")


def user_positions(model: LensModel, text: str, content: str) -> list[int]:
    """The token positions of ``text`` that overlap the last occurrence of ``content`` (the user turn's text).

    Raises:
        ValueError: ``content`` is not in ``text``, or the tokenizer gives no character offsets.
    """
    start = text.rfind(content)
    if start < 0 or not content:
        raise ValueError("The user turn's text is not in the rendered prompt: the chat template changed it.")
    end = start + len(content)
    encoded = model.tokenizer(text, return_offsets_mapping=True)
    offsets = encoded.get("offset_mapping")
    if offsets is None:
        raise ValueError(f"The tokenizer of {model.name!r} gives no character offsets: use a fast tokenizer.")
    return [i for i, (a, b) in enumerate(offsets) if b > start and a < end and b > a]


def run_introspection(model: LensModel, lens: Lens, data: dict, *, band: Any = None, seed: int = 0,
                      strengths: Sequence[float] = STRENGTHS, progress: Callable[[int, int], None] | None = None,
                      stop: Callable[[], bool] | None = None) -> ExperimentResult:
    """Run experiment 4 on ``data`` (``intro_prompt``, ``prefills``, ``concepts``); see the module docstring.

    Args:
        band: the layers to inject at; ``None`` uses the default edit band (``n_layers // 3`` .. the lens's last
            source layer): there is no concept curve to derive it from before the injection.
        strengths: multiples of the layer's mean residual norm (0 is the clean run).

    Raises:
        NoChatTemplateError: the model has no chat template.
        ValueError: turns without a user turn, a band outside the lens, no concept passes the gate.
    """
    elapsed = timer()
    turns = list(data["intro_prompt"])
    users = [t for t in turns if isinstance(t, dict) and t.get("role") == "user"]
    if not users:
        raise ValueError("intro_prompt has no user turn to inject on: give at least one {'role': 'user', ...}.")
    content = str(users[-1]["content"])
    prefills = {str(k): str(v) for k, v in data["prefills"].items()}
    concepts = list(data["concepts"])
    chosen = resolve_band(model, lens, band, {}, concept="concept")
    layers = [x for x in chosen.layers if x <= last_source_layer(lens)]
    steps = Progress(len(prefills) * len(concepts), progress, stop)
    prompts = {}
    for name, prefill in prefills.items():
        text = render_prompt(model, [*turns, {"role": "assistant", "content": prefill}], experiment=NAME)
        ids = model.encode(text)
        recorded = record_residuals(model, ids, layers)
        norms = {layer: float(recorded[layer][1:].float().norm(dim=-1).mean()) for layer in layers}
        prompts[name] = (text, ids, user_positions(model, text, content), norms)
    gen = generator(seed)
    gate_rows, rows = [], []
    for concept in concepts:
        surface = str(concept["surface"])
        found = word_ids(model, surface)
        for pname, (text, ids, positions, norms) in prompts.items():
            row = {"item": f"{concept['name']} · {pname}", "category": str(concept["name"]), "passed": False,
                   "reason": "", "prompt": text}
            if not found:
                row["reason"] = f"unscored: not one token here: surface {surface!r}"
                gate_rows.append(row)
                steps.step()
                continue
            tid = next(iter(found.values()))
            directions = {layer: token_direction(model, lens, layer, tid) for layer in layers}
            random = {}
            for layer in layers:
                random[layer] = unit_directions(1, model.d_model, gen)[0]
            plan = [(arm, float(s), [Inject(vecs, {layer: float(s) * norms[layer] for layer in layers}, positions)])
                    for s in strengths for arm, vecs in zip(ARMS, (directions, random))]
            logits = edited_next_logits(model, ids, [p[2] for p in plan])
            clean_rank = ranks_of(edited_next_logits(model, ids, [[]])[0], found.values())
            row["clean_rank"] = clean_rank
            if clean_rank == 1:
                row["reason"] = "gated out: the clean reply already names it"
            else:
                row["passed"] = True
                for (arm, s, edits), lg in zip(plan, logits):
                    rank = ranks_of(lg, found.values())
                    rows.append({"arm": f"{arm} · s={s:g}", "vector": arm, "strength": s,
                                 "item": row["item"], "category": row["category"], "prefill": pname,
                                 "target": surface, "rank": rank, "reciprocal_rank": 1.0 / rank, "top1": rank == 1,
                                 "top5": rank <= 5, "says": model.decode([int(lg.argmax())]), EDITS: edits})
            gate_rows.append(row)
            steps.step()
    gate = pd.DataFrame(gate_rows)
    if not rows:
        raise gate_error(NAME, gate)
    trials, trial_edits = trial_table(rows)
    summary = summarise(trials, list(dict.fromkeys(trials["arm"])), seed=seed)
    curve = (trials.groupby(["vector", "strength"], as_index=False)["reciprocal_rank"].median()
             .rename(columns={"reciprocal_rank": "median_reciprocal_rank"}))
    curve["top1_rate"] = trials.groupby(["vector", "strength"])["top1"].mean().to_numpy()
    extras = {"by_strength": curve,
              "user_positions": {name: len(p[2]) for name, p in prompts.items()},
              "mean_residual_norm": {str(k): round(v, 3) for k, v in next(iter(prompts.values()))[3].items()}}
    settings = {"band": band, "seed": seed, "strengths": list(strengths)}
    return ExperimentResult(NAME, model.name, str(lens.kind), chosen, gate, trials, summary, extras, settings,
                            elapsed(), () if band is not None else (
                                "The band is the default edit band: there is no concept curve to derive it from.",),
                            trial_edits)


__all__ = ["ARMS", "STRENGTHS", "Inject", "run_introspection", "user_positions"]
