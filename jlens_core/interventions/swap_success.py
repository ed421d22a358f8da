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
succeed, with a 95 % Clopper-Pearson (exact) interval in ``ci_low, ci_high`` and the Wilson interval
beside it (:mod:`~jlens_core.interventions.intervals`). With ``centred=True`` every lens swaps along
centred read directions (docs/method.md §9.1). Items whose words have no single-token spelling are
skipped and counted.

Controls, all scored on the target's answer (``swap_answer``), the last two with the first lens and its
layers (``controls="each"``: a norm-matched control per lens, with that lens's directions and layers, named
``"norm-matched (<lens>)"``):

* the logit lens (always included);
* ``"random"``: random unit directions in place of ``v_A, v_B`` (the floor);
* ``"norm-matched"``: ``source`` swapped with a random vocabulary token in place of ``replacement``,
  drawn uniformly among the tokens whose read direction's norm (raw or centred, as the swap uses;
  averaged over the edited layers) is within 10 % of the replacement's, leaving out the source, the
  replacement and every spelling of both answers. An item with no such token has no control (counted in
  ``n_unmatched``); the other arms still score it.

Both random draws of item ``i`` use a generator seeded with ``derive_seed(seed, i)`` (:mod:`jlens_core.seeds`); the report records
``seed``, and each item its seed and drawn token.

Beside each arm's rate, its side effects (docs/method.md §7.2, :mod:`~jlens_core.interventions.side_effects`):
per eligible item, the readout divergence over the tokens other than ``swap_answer``'s spellings and the
downstream divergence over the clean greedy continuation (``downstream_tokens``) teacher-forced with the swap;
per arm and alpha their mean over the items, its 95 % bootstrap interval and the median (bits).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import pandas as pd
import torch

from .._keywords import options_value
from ..lenses.protocol import Lens
from ..models.model import LensModel
from ..reading.edit_hooks import EditRunner
from ..reading.tokens import spellings, token_id
from ..seeds import derive_seed, generator
from .intervals import clopper_pearson_interval, wilson_interval
from .item_sets import load_item_set
from .lens_edits import MAX_ALPHA, Swap, random_directions, with_logit_control
from .read_directions import check_layers, default_layers, read_vector_norms
from .side_effects import (
    DOWNSTREAM_TOKENS,
    SET_FIGURES,
    check_downstream_tokens,
    clean_continuation,
    set_columns,
    set_figures,
    side_effects_of,
    teacher_forced_logits,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

log = logging.getLogger(__name__)

ITEM_FIELDS = ("prompt", "source", "replacement", "answer", "swap_answer")
SWAP_SETS = {"swaps": "written for jlens: geography, people, objects, numbers (>= 60 items)"}
DEFAULT_ALPHAS = (0.5, 1.0, 2.0, 4.0)
RANDOM = "random"
NORM_MATCHED = "norm-matched"
CONTROLS = ("first", "each")  # which lenses get a norm-matched control
NORM_TOLERANCE = 0.10  # the norm-matched control's token: read-direction norm within 10 % of the replacement's
INTERVAL = "clopper-pearson"  # what ci_low, ci_high hold (wilson_low, wilson_high beside them)
SUMMARY_COLUMNS = ("lens", "alpha", "eligible", "successes", "rate", "ci_low", "ci_high", "wilson_low",
                   "wilson_high", *set_columns())


def load_swap_set(spec: str | Path) -> list[dict]:
    """Items of a swap set: a shipped name (``"swaps"``) or a ``.jsonl`` / ``.json`` file.

    Raises:
        FileNotFoundError: no such set or file.
        ValueError: a file with no items, or an item without one of ``prompt, source, replacement,
            answer, swap_answer`` (names the item).
    """
    return load_item_set(spec, shipped=SWAP_SETS, fields=ITEM_FIELDS, what="swap set")


def direction_spelling(tokenizer: Any, word: str, vocab_size: int | None = None) -> str | None:
    """The spelling whose read direction stands for ``word``: the first single-token one
    (leading-space forms first), or ``None``."""
    return next(iter(spellings(tokenizer, word, vocab_size=vocab_size)), None)


@dataclass
class SwapReport:
    """What :func:`swap_success` returns.

    Attributes:
        summary: one row per (lens, alpha), columns :data:`SUMMARY_COLUMNS` (``lens`` includes the
            controls ``"random"`` and ``"norm-matched"``); rates over the eligible items the arm scored
            (``eligible``), ``ci_low, ci_high`` the 95 % Clopper-Pearson interval, ``wilson_low,
            wilson_high`` the 95 % Wilson interval; ``readout_kl_bits`` (mean), ``readout_kl_low, readout_kl_high``
            (95 % bootstrap), ``readout_kl_median`` and the same for ``downstream_kl``: the side effects, in bits.
        best: one row per lens: the alpha with the highest rate, its rate and intervals.
        items: one row per item: ``name, eligible, reason`` (why not eligible / skipped), the clean
            next token, ``seed``, ``control_id`` and ``control_token`` (the norm-matched draw, ``None`` when no
            token is within 10 %), and per lens x alpha the edited next token and success (``<lens>@<alpha>``,
            ``... next``) and the side effects (``... readout_kl``, ``... downstream_kl``, bits).
        n_items, n_eligible, n_skipped: counts (skipped: a word with no single-token spelling).
        n_unmatched: eligible items with no norm-matched control token.
        layers: the edited layers per lens; seconds: wall time; seconds_per_item.
        seed: the seed of the random controls; centred: whether the swaps used centred directions;
        control_lens: the lens whose directions the two random controls use; interval: :data:`INTERVAL`.
    """

    summary: pd.DataFrame
    best: pd.DataFrame
    items: pd.DataFrame
    n_items: int
    n_eligible: int
    n_skipped: int
    layers: dict[str, list[int]] = field(default_factory=dict)
    seconds: float = 0.0
    n_unmatched: int = 0
    seed: int = 0
    centred: bool = False
    control_lens: str = ""
    interval: str = INTERVAL

    @property
    def seconds_per_item(self) -> float:
        return self.seconds / max(1, self.n_items)


def _greedy_next(model: LensModel, ids: torch.Tensor, edits: list | None = None, clean=None) -> int:
    runner = EditRunner(model, edits, int(ids.shape[1]))
    positions = torch.arange(int(ids.shape[1]))
    with torch.no_grad():
        logits = runner.run(lambda: model.hf_model(input_ids=ids).logits[0, -1], positions, clean=clean)
    return int(logits.float().argmax())


def _mean_norms(model: LensModel, lens: Lens, layers: Sequence[int], centred: bool) -> torch.Tensor:
    """``[vocab_size]``: each token's read-direction norm averaged over ``layers``."""
    return torch.stack([read_vector_norms(model, lens, layer, centred=centred) for layer in layers]).mean(dim=0)


def norm_matched_token(norms: torch.Tensor, target: int, exclude: Iterable[int], generator: torch.Generator,
                       tolerance: float = NORM_TOLERANCE) -> int | None:
    """A token drawn uniformly among those whose ``norms`` lie within ``tolerance`` (relative) of
    ``norms[target]``, leaving out ``target`` and ``exclude``; ``None`` when there is none."""
    goal = float(norms[int(target)])
    close = (norms - goal).abs() <= tolerance * goal
    close[int(target)] = False
    for t in exclude:
        if 0 <= int(t) < len(close):
            close[int(t)] = False
    candidates = torch.nonzero(close & (norms > 0)).flatten()
    if goal <= 0 or len(candidates) == 0:
        return None
    return int(candidates[int(torch.randint(len(candidates), (1,), generator=generator))])


def _arm_rates(values: pd.Series) -> tuple[int, int]:
    """``(successes, scored)`` of one arm's column over the eligible items (an item it did not score is NaN)."""
    scored = values.dropna()
    return int(scored.astype(bool).sum()), len(scored)


@dataclass
class _SwapPlan:
    """The settings every item is scored under: lenses and their layers, and the controls' lens."""

    lenses: dict[str, Lens]
    layers: dict[str, list[int]]
    alphas: list[float]
    control_name: str
    random_control: bool
    norm_matched_control: bool
    centred: bool
    seed: int
    controls: str = "first"
    downstream_tokens: int = DOWNSTREAM_TOKENS

    @property
    def matched_lenses(self) -> dict[str, str]:
        """``{arm name: lens name}`` of the norm-matched controls (none when that control is off)."""
        if not self.norm_matched_control:
            return {}
        if self.controls == "each":
            return {f"{NORM_MATCHED} ({name})": name for name in self.lenses}
        return {NORM_MATCHED: self.control_name}

    @property
    def control_lens(self) -> Lens:
        return self.lenses[self.control_name]

    @property
    def control_layers(self) -> list[int]:
        return self.layers[self.control_name]

    @property
    def arm_names(self) -> list[str]:
        """The lenses, then the controls that are on: the rows of the summary, in order."""
        return list(self.lenses) + ([RANDOM] if self.random_control else []) + list(self.matched_lenses)


@dataclass
class _Arm:
    """One swap an eligible item is scored under: a lens (or control) with its layers and target."""

    lens: Lens
    layers: list[int]
    directions: Any  # random unit directions in place of the read ones (the random control), else None
    target: str | int  # the replacement's spelling, or the norm-matched token id


def _plan_swaps(model: LensModel, lenses: Mapping[str, Lens], layers: Sequence[int] | None, alphas: Sequence[float],
                *, random_control: bool, norm_matched_control: bool, centred: bool, seed: int,
                controls: str = "first") -> _SwapPlan:
    """Check the settings (before any work) and choose each lens's layers; the logit lens is added when missing.

    Raises:
        ValueError: no alphas, an alpha out of range, a layer outside a lens, ``controls`` not first/each.
    """
    if controls not in CONTROLS:
        raise ValueError(f"controls={controls!r} is not one of {', '.join(CONTROLS)}: 'first' draws the norm-matched "
                         "control with the first lens, 'each' with every lens.")
    alpha_list = [float(a) for a in alphas]
    if not alpha_list:
        raise ValueError("alphas is empty: give at least one swap scale.")
    all_lenses = with_logit_control(model, lenses)
    for alpha in alpha_list:
        if not 0 <= alpha <= MAX_ALPHA:
            raise ValueError(f"Swap scale alpha={alpha:g} is out of range: give numbers in [0, {MAX_ALPHA:g}].")
    chosen = {name: check_layers(model, lens, layers) if layers is not None else default_layers(model, lens)
              for name, lens in all_lenses.items()}
    return _SwapPlan(lenses=all_lenses, layers=chosen, alphas=alpha_list, control_name=next(iter(chosen)),
                     random_control=random_control, norm_matched_control=norm_matched_control, centred=centred,
                     seed=seed, controls=controls)


def _spelling_ids(model: LensModel, word: str) -> set[int]:
    """The token ids of every complete single-token spelling of ``word``."""
    return set(spellings(model.tokenizer, word, vocab_size=model.vocab_size).values())


def _draw_norm_matched(model: LensModel, norms: torch.Tensor, source: str, replacement: str,
                       answer_ids: set[int], item_seed: int) -> int | None:
    """The norm-matched control's token for one item (``None`` when no token is within tolerance)."""
    vocab = model.vocab_size
    source_id, replacement_id = (token_id(model.tokenizer, w, rule="exact", vocab_size=vocab)
                                 for w in (source, replacement))
    return norm_matched_token(norms, replacement_id, {source_id} | answer_ids,
                              generator(item_seed))


def _score_arm(model: LensModel, name: str, arm: _Arm, source: str, run: _CleanRun, swap_ids: set[int],
               plan: _SwapPlan) -> dict[str, Any]:
    """Per alpha, whether the edited greedy next token spells the swap answer, that token and the side effects:
    the columns ``{name}@{alpha}``, ``{name}@{alpha} next``, ``... readout_kl`` and ``... downstream_kl``."""
    swap = Swap(model, arm.lens, source, arm.target, 1.0, layers=arm.layers, directions=arm.directions,
                centred=plan.centred)
    runner = EditRunner(model, [swap], run.n_prompt)
    clean = runner.clean_residuals(lambda: model.hf_model(input_ids=run.ids))
    cells: dict[str, Any] = {}
    for alpha in plan.alphas:
        swap.alpha = alpha
        logits = teacher_forced_logits(model, run.ids, run.n_prompt, [swap], clean=clean)  # [n + N, vocab]
        edited = int(logits[run.n_prompt - 1].argmax())
        effects = side_effects_of(logits, run.logits, run.n_prompt, swap_ids)
        cells[f"{name}@{alpha:g}"] = edited in swap_ids
        cells[f"{name}@{alpha:g} next"] = model.decode([edited])
        cells[f"{name}@{alpha:g} readout_kl"] = effects.readout_bits
        cells[f"{name}@{alpha:g} downstream_kl"] = effects.downstream_bits
    return cells


@dataclass
class _CleanRun:
    """An eligible item's clean run: the prompt and its clean greedy continuation ``ids [1, n + N]``, their logits
    ``[n + N, vocab]`` (the side effects' reference) and the prompt's length ``n``."""

    ids: torch.Tensor
    logits: torch.Tensor
    n_prompt: int

    @classmethod
    def of(cls, model: LensModel, prompt_ids: torch.Tensor, n_tokens: int) -> _CleanRun:
        continuation = torch.tensor([clean_continuation(model, prompt_ids, n_tokens)], dtype=torch.long,
                                    device=prompt_ids.device)
        ids = torch.cat([prompt_ids, continuation], dim=1)
        n = int(prompt_ids.shape[1])
        return cls(ids, teacher_forced_logits(model, ids, n), n)


def _control_columns(plan: _SwapPlan, arm: str) -> tuple[str, str]:
    """The item columns of a norm-matched arm's draw: ``control_id, control_token`` for the first lens's,
    ``"control_id (<lens>)"`` and ``"control_token (<lens>)"`` for the others' (``controls="each"``)."""
    lens = plan.matched_lenses[arm]
    suffix = "" if lens == plan.control_name else f" ({lens})"
    return f"control_id{suffix}", f"control_token{suffix}"


def _score_eligible(model: LensModel, plan: _SwapPlan, norms: Mapping[str, torch.Tensor], words: Mapping[str, str],
                    run: _CleanRun, answer_ids: set[int], swap_ids: set[int], item_seed: int) -> dict[str, Any]:
    """An eligible item's row cells: the norm-matched draw, then every arm's success and edited token."""
    source, replacement = words["source"], words["replacement"]
    arms = {name: _Arm(plan.lenses[name], plan.layers[name], None, replacement) for name in plan.lenses}
    if plan.random_control:
        arms[RANDOM] = _Arm(plan.control_lens, plan.control_layers,
                            random_directions(plan.control_layers, model.d_model, item_seed), replacement)
    cells: dict[str, Any] = {}
    for arm_name, lens_name in plan.matched_lenses.items():
        drawn = _draw_norm_matched(model, norms[lens_name], source, replacement, answer_ids | swap_ids, item_seed)
        id_column, token_column = _control_columns(plan, arm_name)
        cells[id_column] = drawn
        cells[token_column] = None if drawn is None else model.decode([drawn])
        if drawn is not None:
            arms[arm_name] = _Arm(plan.lenses[lens_name], plan.layers[lens_name], None, drawn)
    for name, arm in arms.items():
        cells.update(_score_arm(model, name, arm, source, run, swap_ids, plan))
    return cells


def _score_item(model: LensModel, plan: _SwapPlan, norms: Mapping[str, torch.Tensor], item: dict,
                i: int) -> dict[str, Any]:
    """One item's row: ``name, eligible, reason``, the clean next token and, when eligible, every arm's result."""
    row: dict[str, Any] = {"name": item.get("name", f"#{i}"), "eligible": False, "reason": ""}
    words = {k: direction_spelling(model.tokenizer, str(item[k]), model.vocab_size) for k in ITEM_FIELDS[1:]}
    missing = [f"{k} {item[k]!r}" for k, v in words.items() if v is None]
    ids = model.encode(str(item["prompt"]))
    if missing:
        row["reason"] = "skipped: no single-token spelling of " + ", ".join(missing)
        return row
    answer_ids = _spelling_ids(model, str(item["answer"]))
    swap_ids = _spelling_ids(model, str(item["swap_answer"]))
    clean_next = _greedy_next(model, ids)
    row["clean_next"] = model.decode([clean_next])
    if clean_next not in answer_ids:
        row["reason"] = f"not eligible: the model says {row['clean_next']!r}"
        return row
    row["eligible"] = True
    seed_i = derive_seed(plan.seed, i)
    row["seed"] = seed_i
    spelt = {k: str(v) for k, v in words.items()}
    run = _CleanRun.of(model, ids, plan.downstream_tokens)
    row.update(_score_eligible(model, plan, norms, spelt, run, answer_ids, swap_ids, seed_i))
    return row


def _arm_summary(eligible: pd.DataFrame, name: str, alpha: float) -> dict[str, Any]:
    """One summary row: an arm's successes over the eligible items it scored at ``alpha``, with both intervals."""
    col = f"{name}@{alpha:g}"
    wins, n = _arm_rates(eligible[col]) if col in eligible else (0, 0)
    low, high = clopper_pearson_interval(wins, n)
    w_low, w_high = wilson_interval(wins, n)
    figures = {k: v for figure in SET_FIGURES
               for k, v in set_figures(eligible[f"{col} {figure}"].dropna() if f"{col} {figure}" in eligible else [],
                                       figure).items()}
    return {"lens": name, "alpha": alpha, "eligible": n, "successes": wins, "rate": wins / n if n else math.nan,
            "ci_low": low, "ci_high": high, "wilson_low": w_low, "wilson_high": w_high, **figures}


def _summarise(eligible: pd.DataFrame, plan: _SwapPlan) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(summary, best)``: a row per arm and alpha, and per arm the alpha with the highest rate."""
    summary_rows, best_rows = [], []
    for name in plan.arm_names:
        best = None
        for alpha in plan.alphas:
            rec = _arm_summary(eligible, name, alpha)
            summary_rows.append(rec)
            if best is None or (rec["eligible"] and rec["rate"] > best["rate"]):
                best = rec
        best_rows.append(best)
    columns = list(SUMMARY_COLUMNS)
    return pd.DataFrame(summary_rows, columns=columns), pd.DataFrame(best_rows, columns=columns)


def _report(plan: _SwapPlan, rows: list[dict[str, Any]], seconds: float) -> SwapReport:
    """The :class:`SwapReport` of the scored item rows."""
    table = pd.DataFrame(rows)
    eligible = table[table["eligible"]] if not table.empty else table
    summary, best = _summarise(eligible, plan)
    n_skipped = int(table["reason"].str.startswith("skipped").sum()) if not table.empty else 0
    n_unmatched = int(eligible["control_token"].isna().sum()) if plan.norm_matched_control and len(eligible) else 0
    controls = {**({RANDOM: plan.control_layers} if plan.random_control else {}),
                **{arm: plan.layers[lens] for arm, lens in plan.matched_lenses.items()}}
    return SwapReport(summary=summary, best=best, items=table, n_items=len(rows), n_eligible=len(eligible),
                      n_skipped=n_skipped, layers={**plan.layers, **controls}, seconds=seconds,
                      n_unmatched=n_unmatched, seed=int(plan.seed), centred=bool(plan.centred),
                      control_lens=plan.control_name)


@dataclass(frozen=True)
class SwapOptions:
    """How :func:`swap_success` swaps and which controls it runs: one value, or its fields given one by one as
    keywords (:class:`SwapKeywords`; a keyword wins). The fields are :func:`swap_success`'s Args of the same names."""

    alphas: Sequence[float] = DEFAULT_ALPHAS
    random_control: bool = True
    norm_matched_control: bool = True
    centred: bool = False
    seed: int = 0
    controls: str = "first"
    downstream_tokens: int = DOWNSTREAM_TOKENS


class SwapKeywords(TypedDict, total=False):
    """:class:`SwapOptions`'s fields given one by one (the older spelling, kept)."""

    alphas: Sequence[float]
    random_control: bool
    norm_matched_control: bool
    centred: bool
    seed: int
    controls: str
    downstream_tokens: int


def swap_success(model: LensModel, lenses: Mapping[str, Lens], items: Iterable[dict],
                 options: SwapOptions | None = None, *, layers: Sequence[int] | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 **keywords: Unpack[SwapKeywords]) -> SwapReport:
    """Swap success of each lens on ``items`` (see the module docstring).

    Args:
        model: an :class:`~jlens_core.HFLensModel`.
        lenses: ``{name: lens}``; the logit lens is added as ``"logit"`` when missing.
        items: dicts with ``prompt, source, replacement, answer, swap_answer`` (``name`` optional).
        options: the :class:`SwapOptions` (default ``SwapOptions()``); its fields below may be given one by one.
        layers: layers to edit (default per lens: ``n_layers // 3`` to its last source layer).
        alphas: swap scales to try; the best per lens is reported beside each.
        random_control: add the random-direction control (``"random"``, with the first lens's layers).
        norm_matched_control: add the norm-matched token control (``"norm-matched"``, the first lens).
        centred: swap along centred read directions (docs/method.md §9.1), the lenses and the
            norm-matched control alike (its norms are then the centred ones).
        seed: seeds both random controls (item ``i`` draws with ``derive_seed(seed, i)`` (:mod:`jlens_core.seeds`)).
        controls: ``"first"`` (default): one norm-matched control, with the first lens's directions;
            ``"each"``: one per lens (``"norm-matched (<lens>)"``), each drawn from that lens's norms
            with the item's seed, so a lens is compared with a control in its own geometry.
        progress: called as ``progress(done, total)`` after each item.
        downstream_tokens: the clean greedy continuation teacher-forced with each swap for its downstream side
            effect (0: none, NaN).

    Raises:
        ValueError: no alphas, an alpha out of range, a layer outside a lens, an unknown ``controls``, a
            ``downstream_tokens`` outside 0..256.
        TypeError: a keyword that is not one of :class:`SwapKeywords`.
    """
    o = options_value("swap_success", options, SwapOptions, keywords, SwapKeywords)
    alphas, random_control, norm_matched_control, centred = o.alphas, o.random_control, o.norm_matched_control, o.centred
    seed, controls, downstream_tokens = o.seed, o.controls, o.downstream_tokens
    items = list(items)
    plan = _plan_swaps(model, lenses, layers, alphas, random_control=random_control,
                       norm_matched_control=norm_matched_control, centred=centred, seed=seed, controls=controls)
    plan.downstream_tokens = check_downstream_tokens(downstream_tokens)
    start = time.perf_counter()
    norms = {lens: _mean_norms(model, plan.lenses[lens], plan.layers[lens], centred)
             for lens in dict.fromkeys(plan.matched_lenses.values())}
    rows = []
    for i, item in enumerate(items):
        rows.append(_score_item(model, plan, norms, item, i))
        if progress is not None:
            progress(i + 1, len(items))
    report = _report(plan, rows, time.perf_counter() - start)
    log.info("swap success: %d items, %d eligible, %d skipped, %d without a norm-matched control, %.1f s",
             report.n_items, report.n_eligible, report.n_skipped, report.n_unmatched, report.seconds)
    return report


__all__ = ["CONTROLS", "DEFAULT_ALPHAS", "INTERVAL", "NORM_MATCHED", "NORM_TOLERANCE", "RANDOM", "SUMMARY_COLUMNS", "SWAP_SETS",
           "SwapKeywords", "SwapOptions", "SwapReport", "clopper_pearson_interval", "direction_spelling", "load_swap_set", "norm_matched_token",
           "swap_success", "wilson_interval"]
