"""``run_experiment``: any workspace experiment as one call, from a file, a built-in set or parsed data."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..lenses.protocol import Lens
from ..models.model import LensModel
from .core import ExperimentResult, resolve_band
from .formats import EXPERIMENTS, load_experiment_items

RUNNERS = {"probe-swap": ("probe_swap", "run_probe_swap"),
           "verbal-report": ("verbal_report", "run_verbal_report"),
           "flexible-generalization": ("flexible", "run_flexible"),
           "ablation-battery": ("ablation", "run_ablation_battery"),
           "verbal-introspection": ("introspection", "run_introspection"),
           "directed-modulation": ("modulation", "run_modulation"),
           "selectivity-language": ("selectivity", "run_selectivity")}


def available_experiments() -> list[str]:
    """The experiments this build runs (the other formats load but are not run yet)."""
    return list(RUNNERS)


def run_experiment(model: LensModel, lens: Lens, name: str, items: str | Path | Mapping[str, Any], *,
                   band: Any = None, seed: int = 0, progress: Callable[[int, int], None] | None = None,
                   stop: Callable[[], bool] | None = None, **options: Any) -> ExperimentResult:
    """Run the experiment ``name`` on ``items`` (a file in its format, a built-in set's name, or parsed data).

    Args:
        model, lens: the model and the lens whose read coordinates the swaps move (a J lens for the paper's claims).
        name: one of :data:`~jlens_core.experiments.formats.EXPERIMENTS` that :func:`available_experiments` lists.
        items: the prompt set (docs/experiments.md gives each format).
        band: the band: ``"20-26"``, a list of layers, or ``None`` to derive it (the study's band rule).
        seed: seeds the random controls and the bootstrap.
        progress: ``progress(done, total)`` as trials finish; stop: ``stop()`` -> True cancels
            (:class:`~jlens_core.experiments.core.ExperimentCancelled`).
        **options: the experiment's own settings (``depth``, ``template``, ``prefill``, ``strengths`` ...).

    Raises:
        ValueError: an unknown or not yet runnable experiment, a file in another format, a band outside the lens,
            an empty gate (each one sentence).
    """
    if name not in EXPERIMENTS:
        raise ValueError(f"{name!r} is not an experiment: choose one of {', '.join(EXPERIMENTS)}.")
    if name not in RUNNERS:
        raise ValueError(f"The {name} experiment reads its format but does not run in this version: run one of "
                         f"{', '.join(RUNNERS)}.")
    _, data = load_experiment_items(items, name)
    if band is not None:  # a band outside the lens fails before any forward
        resolve_band(model, lens, band)
    module_name, function = RUNNERS[name]
    import importlib

    runner = getattr(importlib.import_module(f"jlens_core.experiments.{module_name}"), function)
    return runner(model, lens, data, band=band, seed=seed, progress=progress, stop=stop, **options)


__all__ = ["RUNNERS", "available_experiments", "run_experiment"]
