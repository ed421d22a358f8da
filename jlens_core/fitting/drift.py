"""The drift check for lenses fitted elsewhere: refit a few prompts now and compare (docs/sharing.md).

The forward canary (docs/method.md §4.2) protects lenses jlens fitted; a lens from another library has none. A lens
fitted under software that ran the model differently (a transformers release that applied a rope scaling to the
wrong layers read 4-6 % off on every layer of a published lens) differs from what the model computes today by more
than sampling explains. :func:`refit_check` refits the first ``N`` prompts with the model as loaded now (the lens's
layers, target, ``skip_first``, ``max_seq_len`` and rules), and compares per source layer

    ``rel_diff_l = ||J_now,l - J_file,l||_F / ||J_file,l||_F``

with the sampling error the split-half formula predicts (docs/method.md §3.3). With ``s`` the relative standard
error of one prompt's ``J_l`` (from the file's halves when it keeps them, ``s = predicted_rel_se sqrt(n)``, else from
the refit's), a refit of ``N`` prompts and a file of ``n``:

* the refit prompts are among the file's (the lens's own corpus, from its first prompt): ``se = s sqrt(1/N - 1/n)``;
* otherwise (another corpus): ``se = s sqrt(1/N + 1/n)``.

A layer is within bounds when ``rel_diff <= sigmas * se + floor`` (``floor`` = 2e-3: float16 storage and float32
summation orders, so a refit of all ``n`` prompts of the lens's own corpus is held to that alone). The first layer
out of bounds is named; an unchanged model passes.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..lenses.fit_settings import FitPlan
from ..lenses.kinds import lens_kind
from ..models.model import LensModel

log = logging.getLogger(__name__)

SIGMAS = 4.0
FLOOR = 2e-3


@dataclass(frozen=True)
class LayerDrift:
    """One source layer of a drift check.

    Attributes:
        layer: the source layer.
        rel_diff: ``||J_now - J_file||_F / ||J_file||_F``.
        predicted_se: the relative standard error sampling predicts for that difference.
        bound: ``sigmas * predicted_se + floor``.
    """

    layer: int
    rel_diff: float
    predicted_se: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.rel_diff <= self.bound


@dataclass(frozen=True)
class DriftResult:
    """A drift check's result.

    Attributes:
        layers: per source layer, in order.
        n_refit: prompts the refit counted; n_file: prompts the lens holds.
        nested: the refit prompts are among the file's (the lens's own corpus from its first prompt).
        se_from: ``"file halves"`` or ``"refit halves"``: where the per-prompt error came from.
        seconds: how long the refit took.
    """

    layers: tuple[LayerDrift, ...]
    n_refit: int
    n_file: int
    nested: bool
    se_from: str
    seconds: float

    @property
    def first_out_of_bounds(self) -> LayerDrift | None:
        return next((row for row in self.layers if not row.ok), None)

    @property
    def exit_code(self) -> int:
        """0: every layer within bounds; 1: one is not."""
        return 0 if self.first_out_of_bounds is None else 1

    @property
    def message(self) -> str:
        """One sentence: passed, or the first layer out of bounds and by how much."""
        bad = self.first_out_of_bounds
        source = "prompts the lens was fitted on" if self.nested else "prompts of another corpus"
        how = f"refit of {self.n_refit} {source}, error from the {self.se_from}"
        if bad is None:
            worst = max(self.layers, key=lambda r: r.rel_diff / r.bound)
            return (f"Within sampling error at every layer: {how}; largest difference {worst.rel_diff:.3g} at layer "
                    f"{worst.layer} (bound {worst.bound:.3g}).")
        return (f"Out of bounds from layer {bad.layer}: the lens differs from what the model computes now by "
                f"{bad.rel_diff:.3g} (relative, Frobenius), beyond the {bad.bound:.3g} sampling allows ({how}); the "
                "model, or the software running it, is not the one the lens was fitted on.")


def predicted_prompt_error(lens: Any) -> dict[int, float] | None:
    """Per source layer, ``s``: the relative standard error of one prompt's ``J_l`` from ``lens``'s halves
    (``predicted_rel_se * sqrt(n)``, docs/method.md §3.3), or ``None`` without halves."""
    if getattr(lens, "halves", None) is None or lens.halves() is None:
        return None
    table = lens.half_diagnostics()
    n = int(table["n_even"].iloc[0] + table["n_odd"].iloc[0])
    return {int(row.layer): float(row.predicted_rel_se) * math.sqrt(n) for row in table.itertuples()}


def refit_check(model: LensModel, lens: Any, prompts: Sequence, *, nested: bool, sigmas: float = SIGMAS,
                floor: float = FLOOR, progress: Callable[[Any], None] | None = None) -> DriftResult:
    """Refit ``prompts`` (the first ``N`` of a corpus) on ``model`` with ``lens``'s settings and compare per layer
    (module docstring).

    Args:
        model: the model as loaded now.
        lens: a Jacobian lens or R-lens (a file of any known layout), or an expert lens (its pooled lens is checked).
        prompts: the prompts to refit; ``nested``: they are among the lens's own (its corpus from its first prompt).
        sigmas, floor: the bound, ``sigmas * se + floor``.
        progress: :func:`~jlens_core.fitting.fit.fit`'s per-prompt callback.

    Raises:
        ValueError: fewer than 2 prompts counted (no halves to predict the error from), a combined J++ / R++ lens
            (its maps are weighted sums of experts, which a plain refit does not give), or a lens of another model.
    """
    from ..lenses.experts import ExpertLens
    from .fit import fit

    if isinstance(lens, ExpertLens):
        lens = lens.pooled_lens()
    kind = lens_kind(lens)
    if kind not in ("jacobian", "relevance"):
        raise ValueError(f"A {kind} lens's maps are weighted sums of expert matrices, which a plain refit does not "
                         "give: check the expert lens it came from (its pooled lens is checked), or a J lens.")
    lens.check_model(model)
    settings = lens.fit_settings.replace(experts=0, cluster_prompts=0)
    started = time.perf_counter()
    # the model's own forward and backward (not the fused path's analytic one): what the software computes now
    refit = fit(model, list(prompts), settings, FitPlan(halves=True, method="batched"), progress=progress)
    seconds = time.perf_counter() - started
    n_refit, n_file = int(refit.n_prompts), max(int(lens.n_prompts), 1)
    nested = nested and n_refit <= n_file  # more prompts than the lens holds: some are not among its own
    if n_refit < 2 or refit.halves() is None:
        raise ValueError(f"The refit counted {n_refit} prompt(s): the check needs 2 or more (its halves predict the "
                         "sampling error): give --refit 2 or more, with prompts of at least skip_first + 2 tokens.")
    per_prompt = predicted_prompt_error(lens)
    se_from = "file halves"
    if per_prompt is None:
        per_prompt, se_from = predicted_prompt_error(refit), "refit halves"
    assert per_prompt is not None
    scale = math.sqrt(max(1.0 / n_refit - 1.0 / n_file, 0.0)) if nested else math.sqrt(1.0 / n_refit + 1.0 / n_file)
    rows = []
    for layer in lens.source_layers:
        now, then = refit.matrix(layer).double(), lens.matrix(layer).double()
        rel = float((now - then).norm() / then.norm().clamp_min(1e-30))
        se = per_prompt[layer] * scale
        rows.append(LayerDrift(layer, rel, se, sigmas * se + floor))
    result = DriftResult(tuple(rows), n_refit, n_file, nested, se_from, seconds)
    log.info("%s", result.message)
    return result


__all__ = ["FLOOR", "SIGMAS", "DriftResult", "LayerDrift", "predicted_prompt_error", "refit_check"]
