"""Stability marks: is a reading's shown token there under both half-corpus lenses? (docs/method.md §6.2).

A fitted lens is a mean over its fitting prompts; the lenses fitted on the even and on the odd prompts
(its *halves*, ``lens.halves()``) are two independent estimates of it. A cell of a reading is
**stable** when the token it shows (the full lens's top-1) ranks within the top ``stability_k`` under
both halves (``stability_k = 1``: the strict rule, the shown token is top-1 under both). Per cell the
marks are the rank of the shown token under each half (1-based, as every rank, §6) and whether the two
halves' own top-1 tokens agree.

The marks are computed from the residuals the reading recorded (one more unembedding per half and
layer); the reading's own statistics are untouched, so a reading without stability is bit-identical
to one taken before stability existed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ..lenses.kinds import is_baseline
from ..lenses.protocol import Lens

if TYPE_CHECKING:  # torch only where marks are computed: a reading file opens without it
    import torch

    from ..models.model import LensModel

log = logging.getLogger(__name__)

# The default rule: the shown token is top-1 under both halves (docs/method.md §6.2). Measured on held-out prose
# with the shipped J lens (docs/results.md, stability): k = 10 flags 0.008 % of cells and k = 3 1.1 %, with unstable
# cells barely apart from stable ones within a layer; k = 1 flags 15.7 %, and those agree with the model less.
STABILITY_K = 1
STABILITY_COLUMNS = ("half_top1_agree", "half_rank_even", "half_rank_odd", "stable")
BY_LAYER_COLUMNS = ("layer", "n_cells", "n_stable", "stable_fraction", "half_top1_agree_fraction")

HalvesArg = tuple[Lens, Lens] | Mapping[str, tuple[Lens, Lens]] | None


@dataclass(eq=False)
class Stability:
    """The stability marks of one reading, indexed ``[layer_index, position_index]`` like its arrays.

    Attributes:
        half_rank_even / half_rank_odd: ``int64[n_layers, n_positions]``, 1-based rank of the shown token
            (the reading's top-1) under the even / odd half lens.
        half_top1_agree: ``bool[n_layers, n_positions]``: the two halves' own top-1 tokens are the same.
        stability_k: the rule's ``k`` (docs/method.md §6.2).
    """

    half_rank_even: np.ndarray
    half_rank_odd: np.ndarray
    half_top1_agree: np.ndarray
    stability_k: int = STABILITY_K

    @property
    def stable(self) -> np.ndarray:
        """``bool[n_layers, n_positions]``: the shown token within the top ``stability_k`` under both halves."""
        k = int(self.stability_k)
        return (self.half_rank_even <= k) & (self.half_rank_odd <= k)

    def select(self, rows: slice | Sequence[int]) -> Stability:
        """The marks of some layers (rows), as copies."""
        return Stability(self.half_rank_even[rows].copy(), self.half_rank_odd[rows].copy(),
                         self.half_top1_agree[rows].copy(), self.stability_k)


def top_rule(stability_k: int) -> str:
    """The stability rule in words, for labels: ``"top-1"`` for k = 1, else ``"top k"``."""
    return "top-1" if int(stability_k) == 1 else f"top {int(stability_k)}"


def check_stability_k(stability_k: Any) -> int:
    """``stability_k`` as an int >= 1.

    Raises:
        ValueError: not a whole number >= 1 (one sentence).
    """
    if isinstance(stability_k, bool) or not isinstance(stability_k, (int, np.integer)) or int(stability_k) < 1:
        raise ValueError(f"stability_k={stability_k!r} must be a whole number >= 1 (the default 1: the shown token "
                         "is top-1 under both halves; k: within the top k under both).")
    return int(stability_k)


def lens_halves(lens: Lens) -> tuple[Lens, Lens] | None:
    """``lens.halves()`` when the lens has the method and keeps halves, else None (never raises for a lens
    without them: the logit lens, a tuned lens, a file fitted before halves or saved without them)."""
    method = getattr(lens, "halves", None)
    if not callable(method):
        return None
    pair = method()
    return None if pair is None else (pair[0], pair[1])


def no_halves_note(lens: Lens) -> str:
    """The one sentence a reading carries when stability was asked of a lens without halves."""
    if is_baseline(lens):
        return "No stability marks: the logit lens fits nothing, so it has no halves to compare."
    return (f"No stability marks: this {lens.kind} lens keeps no split halves (fitted before they existed, or "
            "saved without them); refit it with `jlens fit` to get them, or pass halves=(even, odd).")


def resolve_halves(lenses: Mapping[str, Lens], *, stability: bool, halves: HalvesArg
                   ) -> tuple[dict[str, tuple[Lens, Lens]], dict[str, str]]:
    """Which lenses get stability marks, and with which halves: ``({name: (even, odd)}, {name: note})``.

    ``halves`` given (a pair for a single lens, or ``{name: (even, odd)}``) asks for stability; else
    ``stability=True`` takes each lens's :func:`lens_halves`. A lens asked for stability without halves
    gets a note (one sentence, logged as a warning; the logit lens's note is logged at info level: it
    never has halves) and is read without marks.

    Raises:
        ValueError: a pair given for several lenses, a name that is no lens, or halves that are not two lenses.
    """
    chosen: dict[str, tuple[Lens, Lens]] = {}
    notes: dict[str, str] = {}
    if halves is not None:
        if isinstance(halves, Mapping):
            unknown = [n for n in halves if n not in lenses]
            if unknown:
                raise ValueError(f"halves names {unknown}, which are not among the lenses read ({list(lenses)}).")
            given = {str(n): pair for n, pair in halves.items()}
        else:
            if len(lenses) != 1:
                raise ValueError(f"halves=(even, odd) is ambiguous with {len(lenses)} lenses: give "
                                 "halves={name: (even, odd)}.")
            given = {next(iter(lenses)): halves}
        for name, pair in given.items():
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"halves[{name!r}] must be two lenses (even, odd), got {type(pair).__name__}.")
            chosen[name] = (pair[0], pair[1])
    if stability:
        for name, lens in lenses.items():
            if name in chosen:
                continue
            own = lens_halves(lens)
            if own is None:
                notes[name] = no_halves_note(lens)
                log.log(logging.INFO if is_baseline(lens) else logging.WARNING, "%s", notes[name] if
                        len(lenses) == 1 else f"{name}: {notes[name]}")  # read_prompt's lens is named "lens"
            else:
                chosen[name] = own
    return chosen, notes


def check_halves(name: str, lens: Lens, pair: tuple[Lens, Lens], layers: Sequence[int]) -> None:
    """Raise unless both halves read ``layers`` at ``lens``'s width.

    Raises:
        ValueError: a half of another width, or one that lacks a layer the reading reads (one sentence).
    """
    for which, half in zip(("even", "odd"), pair):
        if not hasattr(half, "transport"):
            raise ValueError(f"The {which} half for {name!r} is a {type(half).__name__}, not a lens.")
        if int(half.d_model) != int(lens.d_model):
            raise ValueError(f"The {which} half for {name!r} has d_model={half.d_model}, the lens {lens.d_model}: "
                             "pass the halves of this lens.")
        missing = [layer for layer in layers if layer not in half.layers]
        if missing:
            raise ValueError(f"The {which} half for {name!r} lacks layers {missing} the reading reads: pass the "
                             "halves of this lens (same layers).")


def half_marks(model: LensModel, pair: tuple[Lens, Lens], resid: Mapping[int, torch.Tensor], layers: Sequence[int],
               positions: torch.Tensor, shown: np.ndarray, *, kept: torch.Tensor | None = None,
               mask: torch.Tensor | None = None, stability_k: int = STABILITY_K, vocab_size: int = 1) -> Stability:
    """The stability marks of one reading from its recorded residuals.

    Args:
        model: the model read (its ``unembed``).
        pair: ``(even, odd)`` half lenses.
        resid: ``{layer: Tensor[seq, d_model]}`` the residuals the reading recorded.
        layers: the reading's layers (its rows).
        positions: ``LongTensor[n_pos]`` the read positions.
        shown: ``int64[n_layers, n_pos]`` the token each cell shows (the reading's top-1).
        kept: ``FloatTensor[vocab]`` 0/1: the ids ranks count (the word-token readout), or None.
        mask: ``BoolTensor[vocab]``: the ids a top-1 may be (the top-k lists' filter), or None.
        stability_k: the rule's ``k``.
        vocab_size: the unembedding's width (sizes the chunks: at most ``CHUNK_ELEMENTS`` logits at a time).

    Returns:
        A :class:`Stability` (ranks 1-based, over the same vocabulary as the reading's ranks).
    """
    import torch

    from ..lenses.readout import layer_logits
    from .logit_stats import chunk_size, rank_of
    from .openmp_workers import run_in_workers
    from .row_arrays import reused_array

    n_layers, n_pos = len(layers), int(positions.numel())
    ranks = np.zeros((2, n_layers, n_pos), dtype=np.int64)
    tops = np.zeros((2, n_layers, n_pos), dtype=np.int64)
    device = resid[layers[0]].device
    shown_t = torch.as_tensor(shown, dtype=torch.long, device=device)  # [n_layers, n_pos]
    kept_d = None if kept is None else kept.to(device)
    blocked = None if mask is None else ~mask.to(device)  # the ids a top-1 may not be
    # as a reading does: several layers' rows per matmul (at most CHUNK_ELEMENTS logits), in the reading workers
    per_chunk = chunk_size(vocab_size)
    tasks = []
    for start in range(0, n_pos, per_chunk):
        sl = slice(start, min(n_pos, start + per_chunk))
        group = max(1, per_chunk // (sl.stop - sl.start))
        tasks += [(half_index, list(range(g0, min(n_layers, g0 + group))), sl)
                  for half_index in range(2) for g0 in range(0, n_layers, group)]

    def work(task: tuple[int, list[int], slice], scratch: dict[str, torch.Tensor]) -> None:
        half_index, rows, sl = task
        index = positions[sl].to(device)
        z = layer_logits(pair[half_index], model, resid, [layers[r] for r in rows], index).float()  # [g, c, vocab]
        z = z.reshape(-1, z.shape[-1])  # [g * c, vocab]
        ids = shown_t[rows, sl].reshape(-1)
        above = reused_array(scratch, "above", tuple(z.shape), z.dtype, z.device)
        ranks[half_index, rows, sl] = rank_of(z, ids, above, kept_d).view(len(rows), -1).cpu().numpy()
        if blocked is not None:
            z.masked_fill_(blocked, float("-inf"))  # z is this task's own array
        tops[half_index, rows, sl] = z.argmax(-1).view(len(rows), -1).cpu().numpy()

    run_in_workers(tasks, work, [], device)
    return Stability(ranks[0], ranks[1], tops[0] == tops[1], check_stability_k(stability_k))


def stability_by_layer(layers: Sequence[int], marks: Stability, counted: np.ndarray) -> pd.DataFrame:
    """Per layer: cells counted, stable cells, the stable fraction and the halves' top-1 agreement.

    Args:
        layers: the reading's layers (rows of ``marks``).
        marks: its :class:`Stability`.
        counted: ``bool[n_positions]``: the columns to count.

    Returns:
        DataFrame with :data:`BY_LAYER_COLUMNS`; a fraction is NaN where no cell is counted.
    """
    stable = marks.stable[:, counted]
    agree = marks.half_top1_agree[:, counted]
    n = int(counted.sum())
    with np.errstate(invalid="ignore", divide="ignore"):
        return pd.DataFrame({"layer": np.asarray(layers, dtype=np.int64),
                             "n_cells": np.full(len(layers), n, dtype=np.int64),
                             "n_stable": stable.sum(axis=1).astype(np.int64),
                             "stable_fraction": stable.sum(axis=1) / n if n else np.full(len(layers), np.nan),
                             "half_top1_agree_fraction": agree.sum(axis=1) / n if n else np.full(len(layers), np.nan)},
                            columns=list(BY_LAYER_COLUMNS))


__all__ = ["BY_LAYER_COLUMNS", "STABILITY_COLUMNS", "STABILITY_K", "Stability", "check_halves", "check_stability_k",
           "half_marks", "lens_halves", "no_halves_note", "resolve_halves", "stability_by_layer", "top_rule"]
