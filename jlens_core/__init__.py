"""jlens: the Jacobian lens for decoder-only transformers.

``lens_l(h) = unembed(J_l @ h)`` where ``J_l`` is the average Jacobian of the last layer's residual
with respect to layer ``l``'s residual. See ``docs/method.md`` and the README.

The names below are imported on first use (PEP 562), not with the package: ``jlens app`` and
``jlens --help`` then start without importing torch, and ``from jlens_core import JacobianLens``
works as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__

# The one list of public names: what type checkers and IDEs see; __all__ and the lazy imports are read from it.
if TYPE_CHECKING:
    from .corpus import load_corpus
    from .debugging.diff import diff_dumps, divergence_curve
    from .debugging.dump import dump_hidden_states
    from .evaluation.by_layer import evaluate
    from .evaluation.labelled_items import read_labelled_items
    from .evaluation.lens_comparison import gap_comparison, heldout_items, macro_comparison
    from .evaluation.passk import EVAL_SETS, decoy_items, load_eval_set, pass_at_k
    from .evaluation.study import Study, load_study, study
    from .figures.evaluation import eval_curves_figure, pass_at_k_figure
    from .figures.fitting import fit_figures
    from .figures.heatmaps import heatmap_figure
    from .figures.html_page import write_reading_page
    from .figures.interventions import comparison_figure, swap_success_figure
    from .figures.ranks import pinned_ranks_figure
    from .figures.study import study_figure
    from .fitting.drift import DriftResult, refit_check
    from .fitting.estimator import PromptJacobian, jacobian_for_prompt, valid_position_mask
    from .fitting.expert_weights import learn_expert_weights, macro_pass_at_k, split_items
    from .fitting.fit import FitProgress, FitState, fit
    from .fitting.reference_checkpoints import checkpoint_from_reference
    from .fitting.tuning import train_tuned_lens
    from .interventions.compare import compare_runs
    from .interventions.lens_edits import Ablate, Steer, Swap
    from .interventions.read_directions import token_direction
    from .interventions.say import SayResult, make_it_say
    from .interventions.say_success import SaySuccessReport, load_say_set, say_success
    from .interventions.swap_success import SwapReport, load_swap_set, swap_success
    from .layerspec import resolve_layers
    from .lenses.canary import CheckResult, check_lens
    from .lenses.experts import ExpertLens
    from .lenses.export import ExportResult, export_lens
    from .lenses.fit_settings import FitPlan, FitRecord, FitSettings
    from .lenses.header import LensFileError
    from .lenses.lens import JacobianLens, LogitLens
    from .lenses.loading import default_lens, load_lens
    from .lenses.protocol import Lens
    from .lenses.tuned import TunedLens
    from .models.layouts import LAYOUTS, ModelLayout
    from .models.loading import DEFAULT_MODEL, load_model
    from .models.model import HFLensModel, LensModel
    from .models.recorder import ActivationRecorder
    from .reading.file_format import ReadingFileError
    from .reading.generation import Generation, generate
    from .reading.prompt_reading import PromptReading
    from .reading.reader import read_prompt, read_prompts
    from .reading.reading_file import ReadingFile, load_readings, save_readings
    from .reading.summaries import compare_readings, difference, most_common_tokens


def _public_names() -> dict[str, str]:
    """``{public name: defining module}``, read from the ``TYPE_CHECKING`` imports above (the one list of them)."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    guarded = next(node for node in tree.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test))
    return {alias.name: "." + str(node.module) for node in guarded.body if isinstance(node, ast.ImportFrom)
            for alias in node.names}


_SOURCES = _public_names()
__all__ = sorted(_SOURCES)  # noqa: PLE0605 - derived from the one list above


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(source, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SOURCES))
