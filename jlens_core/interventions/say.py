"""Make it say X: search the edits along a lens's read directions that make the model say a chosen word,
verified by replaying the model (docs/method.md §7.1).

:func:`make_it_say` ranks every candidate (steer toward X, swap each layer's top lens token for X, ablate the
competitors; at one layer or a band; at the readout or every position from a given one; strengths from a grid)
by its first-order effect on X's margin, from one backward pass (:mod:`~jlens_core.interventions.say_ranking`),
replays the best ones with the real forward pass (:mod:`~jlens_core.interventions.say_replay`), and bisects the
smallest band and strength among the verified ones. The same search runs with norm-matched random directions
and with the logit lens's directions, always: a recipe that the lens finds and the controls do not is the claim.

Example::

    result = make_it_say(model, lens, "The capital of France is", "Berlin")
    result.minimal          # the smallest verified edit, or None
    result.table()          # every verified recipe of every arm
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

import pandas as pd
import torch

from .._keywords import checked_options, options_value
from ..lenses.kinds import BASELINE, is_baseline
from ..lenses.lens import LogitLens
from ..lenses.protocol import Lens
from ..models.model import LensModel
from .compare import compare_runs
from .read_directions import check_layers, default_layers
from .say_ranking import (
    DEFAULT_GRIDS,
    OPS,
    POSITION_MODES,
    Candidate,
    Directions,
    LensDirections,
    RandomDirections,
    Ranking,
    SayTarget,
    candidates,
    clean_pass,
    lens_top_tokens,
    rank,
    spell_target,
)
from .say_replay import Outcome, Replayer, build_edits, edited_positions
from .side_effects import DOWNSTREAM_TOKENS, check_downstream_tokens, clean_continuation

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

log = logging.getLogger(__name__)

RANDOM = "random"
LOGIT = BASELINE  # the logit lens as a control: the kinds' baseline ("logit")
CONTROLS = (RANDOM, LOGIT)
DEFAULT_MAX_REPLAYS = 12
STRENGTH_BISECTIONS = 3  # the minimal strength to 1/8 of the verified one
MAX_GRID = {"steer": 4.0, "swap": 16.0, "ablate": 64.0}  # Steer's and Swap's own limits; 64 competitors at most
SIDE_EFFECT_FIELDS = ("readout_kl_bits", "downstream_kl_bits", "downstream_kl_max_bits", "prompt_kl_bits",
                      "prompt_kl_max_bits")  # a Recipe's side-effect figures (docs/method.md §7.2), bits


def _figure(value: float) -> float | None:
    """A figure for a table or JSON: ``None`` where it is not defined (NaN)."""
    return None if value is None or math.isnan(value) else float(value)


@dataclass
class SayProgress:
    """What the progress callback gets after each step.

    Attributes:
        stage: ``"rank"``, ``"replay"``, ``"minimise"`` or ``"continuation"``; arm: the search's name (the lens's,
        ``"random"``, ``"logit"``); done, total: forward passes so far and the planned total (an estimate: a
        search that verifies early spends less); message: one line for a progress bar; result: the
        :class:`SayResult` so far (filled in as the search goes; keep it to show what a stopped search found).
    """

    stage: str
    arm: str
    done: int
    total: int
    message: str
    result: Any = None


@dataclass
class Recipe:
    """One replayed edit.

    Attributes:
        arm: the search it belongs to. op: ``"steer"``, ``"swap"`` or ``"ablate"``. layers: the band.
        position_mode: ``"readout"`` or ``"from"``; positions: the absolute prompt positions edited.
        strength: steer ``s`` (multiples of ``||h||``), swap ``α`` or the number of competitors ablated.
        predicted_margin: the first-order ``z_X - z_c`` (logits) the ranking expected; verified: the replay
        made the model write X. next_token: the edited greedy token at the readout. target_prob: the
        teacher-forced probability of X's full tokenisation under the edit. The side effects (docs/method.md §7.2,
        bits): readout_kl_bits: ``KL(edited || clean)`` at the readout over the tokens other than X's spellings,
        both renormalised without them; downstream_kl_bits, downstream_kl_max_bits: the mean and the largest
        ``KL(edited || clean)`` over the clean continuation teacher-forced with the edit (NaN for a recipe that
        did not verify, or with no continuation); prompt_kl_bits, prompt_kl_max_bits: the same over the prompt
        positions a ``"from"`` edit touches before the readout (NaN for a readout edit: it touches none).
        tokens: what the edit names besides X (swap: ``{layer: token swapped out}``; ablate: the competitors).
        edits: the edit objects (give them to ``generate``, ``read_prompt`` or ``compare_runs`` to apply the
        recipe). stage: ``"search"`` or ``"minimise"``.
    """

    arm: str
    op: str
    layers: tuple[int, ...]
    position_mode: str
    positions: tuple[int, ...]
    strength: float
    predicted_margin: float
    verified: bool
    next_token: str
    target_prob: float
    readout_kl_bits: float
    downstream_kl_bits: float
    downstream_kl_max_bits: float
    prompt_kl_bits: float
    prompt_kl_max_bits: float
    tokens: Any = None
    edits: list = field(default_factory=list, repr=False)
    stage: str = "search"

    @property
    def band(self) -> str:
        return f"{self.layers[0]}..{self.layers[-1]}" if len(self.layers) > 1 else str(self.layers[0])

    @property
    def width(self) -> int:
        return len(self.layers)

    def describe(self, target: str = "X") -> str:
        """One line: ``steer toward ' Berlin' s=0.5 at layers 20..23, readout``."""
        where = f"layer{'s' if self.width > 1 else ''} {self.band}, " + (
            "readout" if self.position_mode == "readout" else f"positions {self.positions[0]}..{self.positions[-1]}")
        if self.op == "steer":
            what = f"steer toward {target!r} s={self.strength:g}"
        elif self.op == "swap":
            what = f"swap the top lens token for {target!r} α={self.strength:g}"
        else:
            what = f"ablate the {int(self.strength)} best competitor{'s' if self.strength > 1 else ''}"
        return f"{what} at {where}"

    def side_effects(self) -> str:
        """The side effects in words: ``readout KL 0.124 bits, downstream KL 0.0312 bits (max 0.2)``, three significant digits, and the
        touched prompt positions' for an edit from a position (a figure that is not defined is left out)."""
        parts = [f"readout KL {self.readout_kl_bits:.3g} bits"]
        if not math.isnan(self.downstream_kl_bits):
            parts.append(f"downstream KL {self.downstream_kl_bits:.3g} bits (max {self.downstream_kl_max_bits:.3g})")
        if not math.isnan(self.prompt_kl_bits):
            parts.append(f"prompt KL {self.prompt_kl_bits:.3g} bits (max {self.prompt_kl_max_bits:.3g})")
        return ", ".join(parts)

    def row(self) -> dict[str, Any]:
        """The recipe as a flat dict (a table row, JSON; a side-effect figure that is not defined is ``None``)."""
        tokens = self.tokens
        if isinstance(tokens, dict):
            tokens = {str(k): v for k, v in tokens.items()}
        return {"arm": self.arm, "op": self.op, "layers": self.band, "width": self.width,
                "positions": self.position_mode, "first_position": self.positions[0], "strength": self.strength,
                "verified": self.verified, "next_token": self.next_token, "target_prob": self.target_prob,
                **{k: _figure(getattr(self, k)) for k in SIDE_EFFECT_FIELDS},
                "predicted_margin": self.predicted_margin, "stage": self.stage, "tokens": tokens,
                "edits": [repr(e) for e in self.edits]}


@dataclass
class SaySearch:
    """One arm of the search: the lens's directions, or a control's.

    Attributes:
        name: ``"<lens kind>"``, ``"random"`` or ``"logit"``. directions: what the edits were along.
        tried: every replayed recipe, in order; minimal: the smallest verified (bisected) one, or ``None``.
        n_ranked: candidates ranked by their first-order effect; n_replayed: forward passes with an edit
        (search and bisection); seconds: wall time of the arm (its ranking and replays).
    """

    name: str
    directions: str
    tried: list[Recipe] = field(default_factory=list)
    minimal: Recipe | None = None
    n_ranked: int = 0
    n_replayed: int = 0
    seconds: float = 0.0

    @property
    def recipes(self) -> list[Recipe]:
        """The verified recipes, in the order they were found (bisection steps included)."""
        return [r for r in self.tried if r.verified]

    @property
    def found(self) -> bool:
        return self.minimal is not None


@dataclass
class SayResult:
    """What :func:`make_it_say` returns.

    Attributes:
        prompt, target: as given; target_text, target_ids: the spelling searched for and its tokens.
        lens: the lens's kind. layers: the layers searched. from_position: the first position of ``"from"`` edits.
        n_prompt: prompt length in tokens; readout: its last position.
        clean_next, clean_next_id: the clean greedy token at the readout; clean_margin: ``z_X - z_c`` there (logits);
        clean_prob: the clean teacher-forced probability of X. already: the clean model already writes X.
        search: the lens's arm; controls: ``{"random": ..., "logit": ...}`` (the logit arm is absent when the
        lens is the logit lens). clean_continuation, edited_continuation: greedy continuations without and with
        the minimal recipe (``None`` when nothing was found or continuations were not asked for).
        timings: seconds per stage (``clean``, ``rank``, ``replay``, ``minimise``, ``continuation``, ``total``).
        n_downstream: the clean continuation's length in tokens that the downstream side effects are over.
        stopped: the progress callback asked to stop (the result holds what was done). message: one sentence:
        what was found, or what was tried when nothing was.
    """

    prompt: str
    target: str
    target_text: str
    target_ids: list[int]
    lens: str
    layers: list[int]
    from_position: int
    n_prompt: int
    clean_next: str
    clean_next_id: int
    clean_margin: float
    clean_prob: float
    already: bool
    search: SaySearch
    controls: dict[str, SaySearch] = field(default_factory=dict)
    clean_continuation: str | None = None
    edited_continuation: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    stopped: bool = False
    message: str = ""
    n_downstream: int = 0

    @property
    def readout(self) -> int:
        return self.n_prompt - 1

    @property
    def recipes(self) -> list[Recipe]:
        """The lens's verified recipes."""
        return self.search.recipes

    @property
    def minimal(self) -> Recipe | None:
        return self.search.minimal

    @property
    def arms(self) -> dict[str, SaySearch]:
        return {self.search.name: self.search, **self.controls}

    @property
    def n_ranked(self) -> int:
        return sum(a.n_ranked for a in self.arms.values())

    @property
    def n_replayed(self) -> int:
        return sum(a.n_replayed for a in self.arms.values())

    def table(self, verified_only: bool = True) -> pd.DataFrame:
        """One row per replayed recipe of every arm (only the verified ones by default), minimal ones marked."""
        rows = []
        for arm in self.arms.values():
            for recipe in arm.tried:
                if recipe.verified or not verified_only:
                    rows.append(recipe.row() | {"minimal": recipe is arm.minimal})
        columns = ["arm", "op", "layers", "width", "positions", "first_position", "strength", "verified", "minimal",
                   "next_token", "target_prob", *SIDE_EFFECT_FIELDS, "predicted_margin", "stage", "tokens", "edits"]
        return pd.DataFrame(rows, columns=columns)

    def to_dict(self) -> dict[str, Any]:
        """Everything but the edit objects, JSON-ready."""

        def arm(a: SaySearch) -> dict[str, Any]:
            return {"name": a.name, "directions": a.directions, "found": a.found,
                    "minimal": a.minimal.row() if a.minimal else None,
                    "verified": [r.row() for r in a.recipes], "n_ranked": a.n_ranked, "n_replayed": a.n_replayed,
                    "seconds": a.seconds}

        return {"prompt": self.prompt, "target": self.target, "target_text": self.target_text,
                "target_ids": list(self.target_ids), "lens": self.lens, "layers": list(self.layers),
                "from_position": self.from_position, "n_prompt": self.n_prompt, "clean_next": self.clean_next,
                "clean_next_id": self.clean_next_id,
                "clean_margin": self.clean_margin, "clean_prob": self.clean_prob, "already": self.already,
                "search": arm(self.search), "controls": {k: arm(v) for k, v in self.controls.items()},
                "clean_continuation": self.clean_continuation, "edited_continuation": self.edited_continuation,
                "n_ranked": self.n_ranked, "n_replayed": self.n_replayed, "timings": dict(self.timings),
                "stopped": self.stopped, "message": self.message, "n_downstream": self.n_downstream}


class _Stop(Exception):
    """The progress callback asked to stop."""


class _Run:
    """What every arm of one search shares: the model, the prompt's clean pass, the replayer, the clock."""

    def __init__(self, model: LensModel, ids: torch.Tensor, target: SayTarget, layers: list[int], ops: list[str],
                 modes: list[str], from_position: int, grids: dict[str, tuple[float, ...]], max_replays: int,
                 minimise: bool, progress: Callable[[SayProgress], bool | None] | None, total: int) -> None:
        self.model, self.ids, self.target, self.layers = model, ids, target, layers
        self.ops, self.modes, self.from_position, self.grids = ops, modes, from_position, grids
        self.max_replays, self.minimise, self.progress = max_replays, minimise, progress
        self.n = int(ids.shape[1])
        self.done, self.total = 0, total
        self.timings: dict[str, float] = {}
        self.replayer: Replayer | None = None
        self.state: Any = None
        self.result: SayResult | None = None

    def clock(self, stage: str, start: float) -> None:
        self.timings[stage] = self.timings.get(stage, 0.0) + time.perf_counter() - start

    def tick(self, stage: str, arm: str, message: str, forwards: int = 1) -> None:
        self.done += forwards
        self.total = max(self.total, self.done)
        if self.progress is not None and self.progress(SayProgress(stage, arm, self.done, self.total, message,
                                                                   self.result)):
            raise _Stop


@dataclass
class _Arm:
    name: str
    lens: Lens
    directions: Directions
    label: str


def _check_grids(grids: Mapping[str, Sequence[float]] | None) -> dict[str, tuple[float, ...]]:
    """The default grids with ``grids``' replacements, checked (one sentence per bad grid)."""
    out = {op: tuple(float(s) for s in DEFAULT_GRIDS[op]) for op in OPS}
    for op, grid in (grids or {}).items():
        if op not in OPS:
            raise ValueError(f"grids names {op!r}, which is not an edit: use {', '.join(OPS)}.")
        values = tuple(float(s) for s in grid)
        if not values or any(not math.isfinite(s) or s <= 0 or s > MAX_GRID[op] for s in values):
            raise ValueError(f"The {op} grid {list(grid)} must hold numbers in (0, {MAX_GRID[op]:g}].")
        if op == "ablate" and any(s != int(s) for s in values):
            raise ValueError(f"The ablate grid {list(grid)} counts competitors: give whole numbers.")
        out[op] = values
    return out


def _check_choice(values: Sequence[str], allowed: Sequence[str], what: str) -> list[str]:
    chosen = list(dict.fromkeys(values))
    bad = [v for v in chosen if v not in allowed]
    if bad or not chosen:
        raise ValueError(f"{what} {bad or chosen!r} {'is' if len(bad) == 1 else 'are'} not allowed: choose from "
                         f"{', '.join(allowed)}.")
    return chosen


def _recipe(run: _Run, arm: _Arm, ranking: Ranking, cand: Candidate, stage: str) -> Recipe:
    """Replay one candidate and keep what it gave."""
    assert run.replayer is not None
    positions = edited_positions(cand, run.n, run.from_position)
    edits = build_edits(run.model, arm.lens, cand, run.target, arm.directions, ranking.sources, ranking.competitors,
                        positions)
    outcome: Outcome = run.replayer.run(edits, positions[0])
    # the downstream figure costs a forward over the continuation: only for a recipe that is reported (verified)
    downstream = run.replayer.downstream(edits, positions[0]) if outcome.verified else (math.nan, math.nan)
    tokens: Any = None
    if cand.op == "swap":
        tokens = {layer: run.model.decode([ranking.sources[layer]]) for layer in cand.layers}
    elif cand.op == "ablate":
        tokens = [run.model.decode([t]) for t in ranking.competitors[:round(cand.strength)]]
    return Recipe(arm=arm.name, op=cand.op, layers=cand.layers, position_mode=cand.positions,
                  positions=tuple(positions), strength=float(cand.strength), predicted_margin=float(cand.predicted),
                  verified=outcome.verified, next_token=run.model.decode([outcome.next_id]),
                  target_prob=outcome.target_prob, readout_kl_bits=outcome.readout_kl_bits,
                  downstream_kl_bits=downstream[0], downstream_kl_max_bits=downstream[1],
                  prompt_kl_bits=outcome.prompt_kl_bits, prompt_kl_max_bits=outcome.prompt_kl_max_bits,
                  tokens=tokens, edits=edits, stage=stage)


def _rank_arm(run: _Run, arm: _Arm) -> Ranking:
    competitors = run.state.competitors(run.target, int(max(run.grids["ablate"]))) if "ablate" in run.ops else []
    sources = lens_top_tokens(run.model, arm.lens, run.state, run.layers, run.target.accepted) \
        if "swap" in run.ops else {}
    return rank(run.state, arm.directions, run.target, run.layers, run.ops, run.modes, run.from_position, sources,
                competitors)


def _replay_arm(run: _Run, arm: _Arm, search: SaySearch, ranking: Ranking) -> None:
    """Replay the ranked queue until the budget is spent; a failed candidate escalates to its next stronger
    strength, and escalations take turns with the queue."""
    queue, n_ranked = candidates(ranking, run.grids)
    search.n_ranked = n_ranked
    pending = deque(queue)
    escalations: deque[tuple[Candidate, tuple[Candidate, ...]]] = deque()
    last_was_escalation = True
    started = time.perf_counter()
    try:
        while search.n_replayed < run.max_replays and (pending or escalations):
            if escalations and (not last_was_escalation or not pending):
                cand, stronger = escalations.popleft()
                last_was_escalation = True
            else:
                cand, stronger = pending.popleft()
                last_was_escalation = False
            recipe = _recipe(run, arm, ranking, cand, "search")
            search.tried.append(recipe)
            search.n_replayed += 1
            if not recipe.verified and stronger:
                escalations.append((stronger[0], stronger[1:]))
            run.tick("replay", arm.name, f"{arm.label}: replayed {search.n_replayed}/{run.max_replays} "
                     f"({len(search.recipes)} verified)")
    finally:
        run.clock("replay", started)


def minimal_key(recipe: Recipe, grids: Mapping[str, Sequence[float]]) -> tuple[int, bool, float]:
    """The order that names the minimal recipe (docs/method.md §7.1): the smallest band, then a readout edit before
    one from a position, then the smallest strength relative to the largest of its edit's grid."""
    return recipe.width, recipe.position_mode != "readout", recipe.strength / max(grids[recipe.op])


def minimal_recipe(recipes: Sequence[Recipe], grids: Mapping[str, Sequence[float]]) -> Recipe | None:
    """The minimal one of ``recipes`` by :func:`minimal_key` (the first found on a tie; ``None`` when empty): what
    a finished search bisects from and keeps after bisecting, and what a stopped search keeps."""
    return min(recipes, key=lambda r: minimal_key(r, grids), default=None)


def _minimise(run: _Run, arm: _Arm, search: SaySearch, ranking: Ranking) -> None:
    """From the minimal verified recipe (:func:`minimal_recipe`), bisect the band, then the strength (the arm's
    minimal recipe is then picked by the same rule among every verified recipe, the bisected ones included)."""
    best = minimal_recipe(search.recipes, run.grids)
    if best is None or not run.minimise:
        return
    started = time.perf_counter()

    def attempt(layers: tuple[int, ...], strength: float) -> Recipe:
        cand = Candidate(best.op, layers, best.position_mode, strength,
                         ranking.predict(best.op, layers, best.position_mode, strength))
        recipe = _recipe(run, arm, ranking, cand, "minimise")
        search.tried.append(recipe)
        search.n_replayed += 1
        run.tick("minimise", arm.name, f"{arm.label}: bisecting {recipe.describe()}")
        return recipe

    try:
        current = best
        while current.width > 1:  # the band: keep the half that still works (the better predicted first)
            mid = current.width // 2
            halves = sorted([current.layers[mid:], current.layers[:mid]],
                            key=lambda b: -ranking.predict(best.op, b, best.position_mode, current.strength))
            for half in halves:
                tried = attempt(half, current.strength)
                if tried.verified:
                    current = tried
                    break
            else:
                break
        if best.op == "ablate":  # the fewest competitors that still works
            lo, hi = 0, round(current.strength)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                tried = attempt(current.layers, float(mid))
                lo, hi, current = (lo, mid, tried) if tried.verified else (mid, hi, current)
        else:
            low, high = 0.0, current.strength
            for _ in range(STRENGTH_BISECTIONS):
                middle = (low + high) / 2
                tried = attempt(current.layers, middle)
                low, high, current = (low, middle, tried) if tried.verified else (middle, high, current)
    finally:
        run.clock("minimise", started)


def _search_arm(run: _Run, arm: _Arm, search: SaySearch) -> None:
    """Rank, replay and bisect one arm into ``search`` (kept as far as it got when the run is stopped)."""
    started = time.perf_counter()
    try:
        t0 = time.perf_counter()
        ranking = _rank_arm(run, arm)
        run.clock("rank", t0)
        _replay_arm(run, arm, search, ranking)
        _minimise(run, arm, search, ranking)
    finally:
        search.seconds = time.perf_counter() - started
        # one rule, finished or stopped: the bisected recipe when the bisection ran (smaller on every count)
        search.minimal = minimal_recipe(search.recipes, run.grids)


def _message(result: SayResult, grids: dict[str, tuple[float, ...]], ops: list[str], modes: list[str],
             max_replays: int) -> str:
    target = repr(result.target_text)
    if result.already:
        return f"The model already says {target} here: no edit is needed."
    arm = result.search
    controls = ", ".join(f"{name}: {'found' if a.found else 'none'}" for name, a in result.controls.items())
    stopped = " (stopped early)" if result.stopped else ""
    if arm.found and arm.minimal is not None:
        return (f"{len(arm.recipes)} verified recipe{'s' if len(arm.recipes) != 1 else ''} along the {arm.directions}"
                f"{stopped}; its minimal one ({arm.name}): {arm.minimal.describe(result.target_text)}; side effects: "
                f"{arm.minimal.side_effects()}" + (f" (controls: {controls})." if controls else "."))
    span = f"{result.layers[0]}..{result.layers[-1]}" if len(result.layers) > 1 else str(result.layers[0])
    tried = "; ".join(f"{op} up to {max(grids[op]):g}" + (" competitors" if op == "ablate" else "") for op in ops)
    where = " and ".join("the readout" if m == "readout" else f"every position from {result.from_position}"
                         for m in modes)
    best = max(arm.tried, key=lambda r: r.target_prob, default=None)
    closest = (f"; the closest, {best.describe(result.target_text)}, gave {target} probability "
               f"{best.target_prob:.3g} and the model said {best.next_token!r}") if best else ""
    return (f"No edit made the model say {target}{stopped}: ranked {arm.n_ranked} candidates ({tried}; layers {span}; "
            f"at {where}) and replayed {arm.n_replayed} of them, at most {max_replays}{closest}.")


def check_say_input(model: LensModel, prompt: str, *, ops: Sequence[str], positions: Sequence[str],
                    grids: Mapping[str, Sequence[float]] | None, max_replays: int, from_position: int
                    ) -> tuple[torch.Tensor, list[str], list[str], dict[str, tuple[float, ...]]]:
    """``(ids [1, n], ops, position modes, grids)`` checked, before any work.

    Raises:
        ValueError: one sentence per bad value (see :func:`make_it_say`).
    """
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("The prompt is empty: give the text the model should continue.")
    chosen_ops = _check_choice(ops, OPS, "Edit")
    modes = _check_choice(positions, POSITION_MODES, "Position mode")
    grid = _check_grids(grids)
    if isinstance(max_replays, bool) or not isinstance(max_replays, int) or max_replays < 1:
        raise ValueError(f"max_replays={max_replays!r} must be a whole number of at least 1.")
    ids = model.encode(prompt)  # [1, n]
    n = int(ids.shape[1])
    if "from" in modes and not 0 <= int(from_position) <= n - 1:
        raise ValueError(f"from_position={from_position} is outside the prompt: it has positions 0..{n - 1}.")
    return ids, chosen_ops, modes, grid


def _execute(model: LensModel, prompt: str, ids: torch.Tensor, spelled: SayTarget, searched: list[int],
             arms: list[_Arm], *, ops: list[str], modes: list[str], from_position: int,
             grids: dict[str, tuple[float, ...]], max_replays: int, minimise: bool, continuation_tokens: int,
             progress: Callable[[SayProgress], bool | None] | None,
             downstream_tokens: int = DOWNSTREAM_TOKENS) -> SayResult:
    """Run every arm of one search on one clean pass; the first arm is the result's ``search``."""
    started = time.perf_counter()
    n = int(ids.shape[1])
    budget = 2 + len(arms) * (max_replays + (8 if minimise else 0)) + (2 if continuation_tokens else 0)
    run = _Run(model, ids, spelled, searched, ops, modes, int(from_position), grids, max_replays, minimise,
               progress, budget)
    t0 = time.perf_counter()
    continuation = clean_continuation(model, ids, downstream_tokens)  # the downstream side effect's tokens
    run.replayer = Replayer(model, ids, spelled, searched, continuation)
    clean = run.replayer.clean()
    run.clock("clean", t0)
    result = SayResult(prompt=prompt, target=spelled.word, target_text=spelled.text, target_ids=list(spelled.ids),
                       lens=str(arms[0].lens.kind), layers=list(searched), from_position=int(from_position),
                       n_prompt=n, clean_next=model.decode([clean.next_id]), clean_next_id=int(clean.next_id),
                       clean_margin=math.nan,
                       clean_prob=clean.target_prob, already=clean.verified,
                       search=SaySearch(arms[0].name, arms[0].label), n_downstream=len(continuation))
    run.result = result
    try:
        run.tick("rank", arms[0].name, "clean run")
        if not clean.verified:
            t0 = time.perf_counter()
            run.state = clean_pass(model, ids, spelled, searched)
            result.clean_margin = run.state.margin
            run.clock("rank", t0)
            run.tick("rank", arms[0].name, "gradients of the margin", 2)
            _search_arm(run, arms[0], result.search)
            for arm in arms[1:]:
                result.controls[arm.name] = SaySearch(arm.name, arm.label)
                _search_arm(run, arm, result.controls[arm.name])
            if continuation_tokens and result.minimal is not None:
                t0 = time.perf_counter()
                compared = compare_runs(model, prompt, result.minimal.edits, max_new_tokens=int(continuation_tokens))
                result.clean_continuation = compared.clean.continuation
                result.edited_continuation = compared.edited.continuation
                run.clock("continuation", t0)
                run.tick("continuation", arms[0].name, "continuations", 2)
    except _Stop:
        result.stopped = True
    result.timings = {**run.timings, "total": time.perf_counter() - started}
    result.message = _message(result, grids, ops, modes, max_replays)
    log.info("make_it_say %r -> %r: %s (%.1f s)", prompt[-40:], spelled.text, result.message, result.timings["total"])
    return result


def lens_arm(model: LensModel, name: str, lens: Lens) -> _Arm:
    """The arm that searches along ``lens``'s read directions."""
    label = "logit lens" if is_baseline(lens) else f"{name} lens" if name != lens.kind else f"{lens.kind} lens"
    return _Arm(name, lens, LensDirections(model, lens), label)


@dataclass(frozen=True)
class SayOptions:
    """How :func:`make_it_say` and :func:`~jlens_core.interventions.say_success.say_success` search (docs/method.md
    §7.1): one value, or its fields given one by one as keywords (:class:`SayKeywords`; a keyword wins).

    Attributes:
        ops: among ``"steer"``, ``"swap"``, ``"ablate"``.
        positions: among ``"readout"`` (the last prompt position) and ``"from"`` (every position from
            ``from_position``).
        from_position: the first position the ``"from"`` mode edits.
        grids: ``{op: strengths}`` to replace the defaults (:data:`DEFAULT_GRIDS`: steer ``s`` in multiples of
            ``||h||``, swap ``α``, ablate: how many competitors); ``None``: the defaults.
        max_replays: replays of ranked candidates per arm (the bisection adds up to about 8 more).
        seed: the random control's seed (:mod:`jlens_core.seeds`).
        downstream_tokens: the clean greedy continuation (this many tokens) that every verified recipe is
            teacher-forced on for its downstream side effect (docs/method.md §7.2; 0: none, the figure is NaN).
    """

    ops: Sequence[str] = OPS
    positions: Sequence[str] = POSITION_MODES
    from_position: int = 1
    grids: Mapping[str, Sequence[float]] | None = None
    max_replays: int = DEFAULT_MAX_REPLAYS
    seed: int = 0
    downstream_tokens: int = DOWNSTREAM_TOKENS


class SayKeywords(TypedDict, total=False):
    """:class:`SayOptions`'s fields given one by one (the older spelling, kept): each replaces the value's field."""

    ops: Sequence[str]
    positions: Sequence[str]
    from_position: int
    grids: Mapping[str, Sequence[float]] | None
    max_replays: int
    seed: int
    downstream_tokens: int


class MakeItSayKeywords(SayKeywords, total=False):
    """:func:`make_it_say`'s further keywords: :class:`SayKeywords` and what only a single search has (its Args)."""

    minimise: bool
    controls: Sequence[str]
    continuation_tokens: int


def random_arm(model: LensModel, lens: Lens, seed: int) -> _Arm:
    """The random control: ``lens``'s layers and swap tokens, seeded random unit directions."""
    return _Arm(RANDOM, lens, RandomDirections(model.d_model, seed), "random directions")


def make_it_say(model: LensModel, lens: Lens, prompt: str, target: str, search: SayOptions | None = None, *,
                layers: Sequence[int] | None = None, progress: Callable[[SayProgress], bool | None] | None = None,
                **options: Unpack[MakeItSayKeywords]) -> SayResult:
    """Search the edits along ``lens``'s read directions that make ``model`` say ``target`` after ``prompt``.

    Args:
        model: an :class:`~jlens_core.HFLensModel`. lens: a lens with read directions (logit, J, R, expert).
        prompt: the text the model continues (its tokenizer's special tokens added).
        target: the word X (``"Berlin"``: a leading space is added after a prompt that does not end in
            whitespace). Any single-token spelling counts; a word without one is searched by its first token and
            verified on its full tokenisation under greedy decoding.
        search: the search's :class:`SayOptions` (default ``SayOptions()``); ``ops=``, ``positions=``,
            ``from_position=``, ``grids=``, ``max_replays=``, ``seed=`` and ``downstream_tokens=`` give its fields one
            by one (below).
        layers: the layers to search (default: ``n_layers // 3`` to the lens's last source layer); bands are
            contiguous runs of them (docs/method.md §7.1).
        ops: among ``"steer"``, ``"swap"``, ``"ablate"``. positions: among ``"readout"`` (the last prompt
            position) and ``"from"`` (every position from ``from_position``).
        grids: ``{op: strengths}`` to replace the defaults (:data:`DEFAULT_GRIDS`: steer ``s`` in multiples of
            ``||h||``, swap ``α``, ablate: how many competitors).
        max_replays: replays of ranked candidates per arm (the bisection adds up to about 8 more).
        minimise: bisect the smallest band and strength among the verified recipes.
        controls: among ``"random"`` (norm-matched random unit directions, ``seed``) and ``"logit"`` (the logit
            lens's directions); each runs the same search.
        continuation_tokens: greedy tokens written with and without the minimal recipe (0: none).
        progress: called with a :class:`SayProgress` after every forward pass; returning ``True`` stops the search
            (``stopped=True``; what was done is kept).
        downstream_tokens: the clean greedy continuation (this many tokens, 12 by default: the one written with
            ``continuation_tokens=12``) that every verified recipe is teacher-forced on for its downstream side
            effect (docs/method.md §7.2; 0: none, the figure is NaN).

    Returns:
        A :class:`SayResult`.

    Raises:
        ValueError: an empty prompt, a target the tokenizer cannot spell, a layer outside the model or the lens, a
            ``from_position`` outside the prompt, an unknown op, position mode or control, a bad grid, a
            ``downstream_tokens`` outside 0..256.
        TypeError: a keyword that is none of the above.
    """
    rest = checked_options("make_it_say", options, MakeItSayKeywords)
    minimise: bool = rest.pop("minimise", True)
    controls: Sequence[str] = rest.pop("controls", CONTROLS)
    continuation_tokens: int = rest.pop("continuation_tokens", 12)
    s = options_value("make_it_say", search, SayOptions, rest, SayKeywords)
    ops, positions, from_position, grids = s.ops, s.positions, s.from_position, s.grids
    max_replays, seed, downstream_tokens = s.max_replays, s.seed, s.downstream_tokens
    ids, chosen_ops, modes, grid = check_say_input(model, prompt, ops=ops, positions=positions, grids=grids,
                                                   max_replays=max_replays, from_position=from_position)
    check_downstream_tokens(downstream_tokens)
    chosen_controls = _check_choice(controls, CONTROLS, "Control") if controls else []
    spelled = spell_target(model, target, prompt)
    searched = check_layers(model, lens, layers) if layers is not None else default_layers(model, lens)
    arms = [lens_arm(model, str(lens.kind), lens)]
    if RANDOM in chosen_controls:
        arms.append(random_arm(model, lens, seed))
    if LOGIT in chosen_controls and not is_baseline(lens):
        logit = LogitLens.for_model(model)
        check_layers(model, logit, searched)
        arms.append(lens_arm(model, LOGIT, logit))
    return _execute(model, prompt, ids, spelled, searched, arms, ops=chosen_ops, modes=modes,
                    from_position=int(from_position), grids=grid, max_replays=max_replays, minimise=minimise,
                    continuation_tokens=continuation_tokens, progress=progress, downstream_tokens=downstream_tokens)


__all__ = ["CONTROLS", "DEFAULT_GRIDS", "DEFAULT_MAX_REPLAYS", "LOGIT", "OPS", "POSITION_MODES", "RANDOM",
           "SIDE_EFFECT_FIELDS", "MakeItSayKeywords", "Recipe", "SayKeywords", "SayOptions", "SayProgress", "SayResult", "SaySearch", "check_say_input", "lens_arm",
           "make_it_say", "minimal_key", "minimal_recipe", "random_arm"]
