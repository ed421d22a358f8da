"""What else an edit moves: the side-effect figures reported beside an edit's effect (docs/method.md §7.2).

An edit along a lens's read directions is meant to move one thing (make the model say X, swap A for B). Two
figures say what else moved, both ``KL(edited || clean)`` in bits:

* **readout**: at the readout (the last prompt position), over the tokens other than the edit's target
  (its spellings), both distributions renormalised without them. An edit that only raises X's logit leaves
  it at 0; one that makes X likely by scrambling everything else does not.
* **downstream**: the clean run's greedy continuation (``N`` tokens), teacher-forced with the edit in place:
  at each continuation position the edited next-token distribution against the clean one, the mean and the
  largest over the ``N`` positions. A readout edit reaches them through attention.

The plain-tensor functions (:func:`kl_bits`, :func:`readout_divergence`, :func:`divergence_stats`) take
log-probabilities or logits; :func:`teacher_forced_side_effects` runs the model.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float

from ..models.model import LensModel
from ..reading.edit_hooks import EditRunner
from ..reading.generation import generate
from .intervals import bootstrap_interval

LN2 = math.log(2.0)
SET_FIGURES = ("readout_kl", "downstream_kl")  # the figures a set's summary gives, each as set_figures' columns
DOWNSTREAM_TOKENS = 12  # the clean continuation teacher-forced with the edit (make_it_say writes 12 too)
MAX_DOWNSTREAM_TOKENS = 256


def check_downstream_tokens(n_tokens: int) -> int:
    """``n_tokens`` checked: a whole number in ``0..256`` (0: no downstream figure).

    Raises:
        ValueError: anything else (one sentence).
    """
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or not 0 <= n_tokens <= MAX_DOWNSTREAM_TOKENS:
        raise ValueError(f"downstream_tokens={n_tokens!r} must be a whole number from 0 (no downstream figure) to "
                         f"{MAX_DOWNSTREAM_TOKENS}.")
    return n_tokens


def kl_bits(edited_logp: Float[torch.Tensor, "*rows vocab"],
            clean_logp: Float[torch.Tensor, "*rows vocab"]) -> Float[torch.Tensor, "*rows"]:
    """``KL(edited || clean)`` per row, in bits, from log-probabilities ``[..., vocab]`` (a token with edited
    probability 0, log-probability ``-inf``, adds nothing; float rounding below 0 is clamped)."""
    p = edited_logp.exp()
    terms = torch.where(p > 0, p * (edited_logp - clean_logp), torch.zeros_like(p))
    return terms.sum(-1).clamp_min(0) / LN2


def without(logits: Float[torch.Tensor, "*rows vocab"], exclude: Collection[int]) -> Float[torch.Tensor, "*rows vocab"]:
    """Log-probabilities ``[..., vocab]`` over the tokens other than ``exclude`` (renormalised without them;
    ``-inf`` at the excluded ones).

    Raises:
        ValueError: ``exclude`` names every token (nothing is left to compare).
    """
    kept = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
    dropped = [int(t) for t in exclude if 0 <= int(t) < logits.shape[-1]]
    if dropped:
        kept[dropped] = False
    if not bool(kept.any()):
        raise ValueError(f"exclude leaves out all {logits.shape[-1]} tokens: leave out fewer, the divergence is over "
                         "the rest.")
    return logits.float().masked_fill(~kept, -math.inf).log_softmax(-1)


def readout_divergence(edited_logits: Float[torch.Tensor, " vocab"], clean_logits: Float[torch.Tensor, " vocab"],
                       exclude: Collection[int] = ()) -> float:
    """The readout side effect: ``KL(edited || clean)`` in bits of the next-token distributions over the tokens
    other than ``exclude`` (the target's spellings), both renormalised without them (:func:`without`)."""
    return float(kl_bits(without(edited_logits, exclude), without(clean_logits, exclude)))


def divergence_stats(edited_logits: Float[torch.Tensor, "rows vocab"],
                     clean_logits: Float[torch.Tensor, "rows vocab"]) -> tuple[float, float]:
    """``(mean, max)`` over the rows of ``KL(edited || clean)`` in bits (``(nan, nan)`` with no rows)."""
    if edited_logits.shape[0] == 0:
        return math.nan, math.nan
    kl = kl_bits(edited_logits.float().log_softmax(-1), clean_logits.float().log_softmax(-1))  # [rows]
    return float(kl.mean()), float(kl.max())


@dataclass(frozen=True)
class SideEffects:
    """What else an edit moved (bits; see the module docstring).

    Attributes:
        readout_bits: ``KL(edited || clean)`` at the readout over the tokens other than the excluded ones.
        downstream_bits, downstream_max_bits: the mean and the largest ``KL(edited || clean)`` over the clean
            continuation's positions, teacher-forced with the edit (NaN with no continuation).
        n_downstream: the continuation's length in tokens.
    """

    readout_bits: float
    downstream_bits: float
    downstream_max_bits: float
    n_downstream: int

    def row(self) -> dict[str, float]:
        """The figures as ``readout_kl_bits, downstream_kl_bits, downstream_kl_max_bits`` (a table's columns)."""
        return {"readout_kl_bits": self.readout_bits, "downstream_kl_bits": self.downstream_bits,
                "downstream_kl_max_bits": self.downstream_max_bits}


def side_effects_of(edited_logits: Float[torch.Tensor, "seq vocab"], clean_logits: Float[torch.Tensor, "seq vocab"],
                    n_prompt: int, exclude: Collection[int] = ()) -> SideEffects:
    """The figures from the logits of one sequence, prompt then clean continuation ``[n_prompt + N, vocab]``, run
    with and without the edit: the readout is row ``n_prompt - 1``, the continuation rows ``n_prompt..``."""
    r = int(n_prompt) - 1
    mean, largest = divergence_stats(edited_logits[r + 1:], clean_logits[r + 1:])
    return SideEffects(readout_divergence(edited_logits[r], clean_logits[r], exclude), mean, largest,
                       int(edited_logits.shape[0]) - r - 1)


def clean_continuation(model: LensModel, ids: torch.Tensor, n_tokens: int = DOWNSTREAM_TOKENS) -> list[int]:
    """The clean model's greedy continuation of ``ids`` (``[1, n]`` or ``[n]``): at most ``n_tokens`` token ids
    (fewer when it writes an end-of-sequence token; none for ``n_tokens=0``)."""
    if int(n_tokens) <= 0:
        return []
    return [int(t) for t in generate(model, ids.reshape(-1), max_new_tokens=int(n_tokens), top_k=1).generated_ids]


def teacher_forced_logits(model: LensModel, ids: torch.Tensor, n_prompt: int, edits: Sequence[Any] = (),
                          clean: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """``[seq, vocab]`` fp32 logits of one forward over ``ids`` (``[1, seq]``: prompt, then continuation), with
    ``edits`` hooked (none: the clean run); ``clean``: the edited layers' clean residuals, when already recorded."""
    runner = EditRunner(model, edits, int(n_prompt))

    def forward() -> torch.Tensor:
        return model.hf_model(input_ids=ids).logits[0]

    with torch.no_grad():
        return runner.run(forward, torch.arange(int(ids.shape[1])), clean_forward=forward, clean=clean).float()


def teacher_forced_side_effects(model: LensModel, prompt_ids: torch.Tensor, continuation: Sequence[int],
                                edits: Sequence[Any], exclude: Collection[int] = (),
                                clean_logits: torch.Tensor | None = None) -> SideEffects:
    """The side effects of ``edits`` on ``prompt_ids`` (``[1, n]``) and its clean ``continuation`` (token ids):
    two forwards over prompt and continuation, with and without the edits (the clean one skipped when
    ``clean_logits [n + N, vocab]`` is given)."""
    n = int(prompt_ids.shape[-1])
    tail = torch.tensor([list(continuation)], dtype=torch.long, device=prompt_ids.device)
    ids = torch.cat([prompt_ids.reshape(1, -1), tail], dim=1)
    clean = clean_logits if clean_logits is not None else teacher_forced_logits(model, ids, n)
    return side_effects_of(teacher_forced_logits(model, ids, n, edits), clean, n, exclude)


def set_figures(values: Sequence[float], name: str, seed: int = 0) -> dict[str, float]:
    """One side-effect figure over a set of edits: ``{name}_bits`` (the mean), ``{name}_low``, ``{name}_high`` (its
    95 % percentile bootstrap interval, :func:`~jlens_core.interventions.intervals.bootstrap_interval`, seeded)
    and ``{name}_median``; NaN values (a figure that is not defined) are left out, NaN everywhere when none is left."""
    kept = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    low, high = bootstrap_interval(kept, seed=seed)
    ordered = sorted(kept)
    mid = len(ordered) // 2
    median = math.nan if not kept else ordered[mid] if len(kept) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return {f"{name}_bits": sum(kept) / len(kept) if kept else math.nan, f"{name}_low": low, f"{name}_high": high,
            f"{name}_median": median}


def set_columns(names: Sequence[str] = SET_FIGURES) -> list[str]:
    """The summary columns :func:`set_figures` gives for ``names``, in order."""
    return [f"{name}_{part}" for name in names for part in ("bits", "low", "high", "median")]


__all__ = ["DOWNSTREAM_TOKENS", "MAX_DOWNSTREAM_TOKENS", "SET_FIGURES", "SideEffects", "check_downstream_tokens",
           "clean_continuation", "divergence_stats", "kl_bits", "readout_divergence", "set_columns", "set_figures",
           "side_effects_of", "teacher_forced_logits", "teacher_forced_side_effects", "without"]
