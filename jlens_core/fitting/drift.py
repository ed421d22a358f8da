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
summation orders, so a refit of all ``n`` prompts of the lens's own corpus is held to that alone).

Sharper, when the file keeps its fit's convergence record (jlens files do: one record per prompt x layer with
``jacobian_norm = ||J_p,l||_F / sqrt(d)``) and the refit prompts are its own: the same prompts through the same
model give the same per-prompt Jacobians, so each refit row is compared with the recorded one, no sampling involved:
``rel_diff_l`` is the largest ``|norm_now - norm_then| / norm_then`` over the refit prompts, held to
``record_tolerance``: 1e-3 when the model runs in float32 now and ran so then (as far as the lens's canary says;
a float32 refit repeats a float32 fit to about 1e-6), else 1e-2 (a fit in bfloat16). A rope scaling applied to the
wrong layers, 4-6 % off on every row, is caught by a refit of a few prompts this way.

The first layer out of bounds is named; an unchanged model passes.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..lenses.fit_settings import FitPlan
from ..lenses.kinds import PLAIN_FITTED, lens_kind
from ..models.model import LensModel

log = logging.getLogger(__name__)

SIGMAS = 4.0
FLOOR = 2e-3
RECORD_TOLERANCE = 1e-3  # float32 then and now
RECORD_TOLERANCE_LOW_PRECISION = 1e-2  # a fit or a refit in bfloat16 / float16


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
        se_from: ``"file halves"`` or ``"refit halves"``: where the per-prompt error came from; ``"none"`` when
            compared with the convergence record.
        compared: ``"convergence record"`` (row by row) or ``"matrices"``.
        seconds: how long the refit took.
    """

    layers: tuple[LayerDrift, ...]
    n_refit: int
    n_file: int
    nested: bool
    se_from: str
    seconds: float
    compared: str = "matrices"

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
        how = (f"refit of {self.n_refit} {source}, compared with its convergence record" if self.compared != "matrices"
               else f"refit of {self.n_refit} {source}, error from the {self.se_from}")
        if bad is None:
            worst = max(self.layers, key=lambda r: r.rel_diff / r.bound)
            within = "Within bounds" if self.compared != "matrices" else "Within sampling error"
            return (f"{within} at every layer: {how}; largest difference {worst.rel_diff:.3g} at layer "
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


def _recorded_rows(lens: Any) -> dict[tuple[int, int], dict]:
    return {(int(r["prompt_index"]), int(r["layer"])): r for r in getattr(lens, "diagnostics", None) or []
            if r.get("jacobian_norm") is not None and "prompt_index" in r and "layer" in r}


def _hashes(records: Any) -> dict[int, str]:
    return {int(r["prompt_index"]): str(r["prompt_hash"]) for r in records or [] if r.get("prompt_hash")}


def same_prompts(lens: Any, refit: Any) -> bool | None:
    """Whether ``refit``'s prompts are the ones ``lens``'s convergence record holds at the same indices (by the
    ``prompt_hash`` a fit records once per prompt; rows from before it by ``seq_len`` and ``n_valid``); ``None``
    when the lens records none of them."""
    then = _recorded_rows(lens)
    now = list(refit.diagnostics)
    if not now or any((int(r["prompt_index"]), int(r["layer"])) not in then for r in now):
        return None
    hashes_then, hashes_now = _hashes(getattr(lens, "diagnostics", None)), _hashes(now)
    for row in now:
        index = int(row["prompt_index"])
        if index in hashes_then and index in hashes_now:
            if hashes_then[index] != hashes_now[index]:
                return False
            continue
        old = then[(index, int(row["layer"]))]
        if any(old.get(key) != row.get(key) for key in ("seq_len", "n_valid")):
            return False
    return True


def record_drift(lens: Any, refit: Any, tolerance: float = RECORD_TOLERANCE) -> list[LayerDrift] | None:
    """Per source layer, the largest relative difference of ``jacobian_norm`` between ``refit``'s diagnostics and
    ``lens``'s recorded ones for the same prompts (module docstring); ``None`` unless :func:`same_prompts`."""
    if not same_prompts(lens, refit):
        return None
    then = _recorded_rows(lens)
    worst: dict[int, float] = {}
    for row in refit.diagnostics:
        layer = int(row["layer"])
        recorded = float(then[(int(row["prompt_index"]), layer)]["jacobian_norm"])
        change = abs(float(row["jacobian_norm"]) - recorded) / max(abs(recorded), 1e-30)
        worst[layer] = max(worst.get(layer, 0.0), change)
    return [LayerDrift(layer, worst[layer], 0.0, tolerance) for layer in sorted(worst)]


def record_tolerance_for(model: LensModel, lens: Any) -> float:
    """:data:`RECORD_TOLERANCE` when ``model`` runs in float32 and the lens's canary (if any) says its fit did,
    else :data:`RECORD_TOLERANCE_LOW_PRECISION`."""
    import torch

    then = str(getattr(getattr(lens, "canary", None), "dtype", "float32"))
    same = model.dtype == torch.float32 and then.endswith("float32")
    return RECORD_TOLERANCE if same else RECORD_TOLERANCE_LOW_PRECISION


def refit_check(model: LensModel, lens: Any, prompts: Sequence, *, nested: bool, sigmas: float = SIGMAS,
                floor: float = FLOOR, record_tolerance: float | None = None,
                progress: Callable[[Any], None] | None = None) -> DriftResult:
    """Refit ``prompts`` (the first ``N`` of a corpus) on ``model`` with ``lens``'s settings and compare per layer
    (module docstring).

    Args:
        model: the model as loaded now.
        lens: a Jacobian lens or R-lens (a file of any known layout), or an expert lens (its pooled lens is checked).
        prompts: the prompts to refit; ``nested``: they are among the lens's own (its corpus from its first prompt).
        sigmas, floor: the bound of the matrices' comparison, ``sigmas * se + floor``.
        record_tolerance: the bound of the convergence record's comparison (used when the lens records the refit
            prompts' rows and ``nested``); default :func:`record_tolerance_for`.
        progress: :func:`~jlens_core.fitting.fit.fit`'s per-prompt callback.

    Raises:
        ValueError: fewer than 2 prompts counted when the matrices are compared (no halves to predict the error
            from), a combined J++ / R++ lens
            (its maps are weighted sums of experts, which a plain refit does not give), or a lens of another model.
    """
    from ..lenses.experts import ExpertLens
    from .fit import fit

    if isinstance(lens, ExpertLens):
        lens = lens.pooled_lens()
    kind = lens_kind(lens)
    if kind not in PLAIN_FITTED:
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
    if nested and same_prompts(lens, refit) is False:  # its record says these texts are not the ones it was fitted on
        log.info("The refit prompts are not the ones the lens records (another corpus version?): comparing the "
                 "matrices as for another corpus.")
        nested = False
    tolerance = record_tolerance if record_tolerance is not None else record_tolerance_for(model, lens)
    rows_by_record = record_drift(lens, refit, tolerance) if nested else None
    if rows_by_record is not None:
        result = DriftResult(tuple(rows_by_record), n_refit, n_file, nested, "none", seconds, "convergence record")
        log.info("%s", result.message)
        return result
    if n_refit < 2 or refit.halves() is None:
        raise ValueError(f"The refit counted {n_refit} prompt(s) and the lens records no convergence rows for them: "
                         "comparing the matrices needs 2 or more (their halves predict the sampling error): give "
                         "--refit 2 or more.")
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


__all__ = ["FLOOR", "RECORD_TOLERANCE", "RECORD_TOLERANCE_LOW_PRECISION", "SIGMAS", "DriftResult", "LayerDrift",
           "predicted_prompt_error", "record_drift", "record_tolerance_for", "refit_check", "same_prompts"]
