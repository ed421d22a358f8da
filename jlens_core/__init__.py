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

# public name -> the module that defines it (every name the README and docs/ import)
_SOURCES = {
    "load_corpus": ".corpus",
    "diff_dumps": ".debugging.diff",
    "divergence_curve": ".debugging.diff",
    "dump_hidden_states": ".debugging.dump",
    "eval_curves_figure": ".figures.evaluation",
    "pass_at_k_figure": ".figures.evaluation",
    "fit_figures": ".figures.fitting",
    "heatmap_figure": ".figures.heatmaps",
    "write_reading_page": ".figures.html_page",
    "comparison_figure": ".figures.interventions",
    "swap_success_figure": ".figures.interventions",
    "pinned_ranks_figure": ".figures.ranks",
    "PromptJacobian": ".fitting.estimator",
    "jacobian_for_prompt": ".fitting.estimator",
    "valid_position_mask": ".fitting.estimator",
    "FitProgress": ".fitting.fit",
    "FitState": ".fitting.fit",
    "fit": ".fitting.fit",
    "train_tuned_lens": ".fitting.tuning",
    "compare_runs": ".interventions.compare",
    "Ablate": ".interventions.lens_edits",
    "Steer": ".interventions.lens_edits",
    "Swap": ".interventions.lens_edits",
    "token_direction": ".interventions.read_directions",
    "SwapReport": ".interventions.swap_success",
    "load_swap_set": ".interventions.swap_success",
    "swap_success": ".interventions.swap_success",
    "resolve_layers": ".layerspec",
    "learn_expert_weights": ".fitting.expert_weights",
    "macro_pass_at_k": ".fitting.expert_weights",
    "split_items": ".fitting.expert_weights",
    "read_labelled_items": ".evaluation.labelled_items",
    "ExpertLens": ".lenses.experts",
    "CheckResult": ".lenses.canary",
    "check_lens": ".lenses.canary",
    "JacobianLens": ".lenses.lens",
    "LensFileError": ".lenses.lens",
    "LogitLens": ".lenses.lens",
    "Lens": ".lenses.protocol",
    "default_lens": ".lenses.shipped",
    "load_lens": ".lenses.shipped",
    "TunedLens": ".lenses.tuned",
    "LAYOUTS": ".models.layouts",
    "ModelLayout": ".models.layouts",
    "DEFAULT_MODEL": ".models.loading",
    "load_model": ".models.loading",
    "HFLensModel": ".models.model",
    "LensModel": ".models.model",
    "ActivationRecorder": ".models.recorder",
    "evaluate": ".evaluation.by_layer",
    "Generation": ".reading.generation",
    "generate": ".reading.generation",
    "EVAL_SETS": ".evaluation.passk",
    "load_eval_set": ".evaluation.passk",
    "pass_at_k": ".evaluation.passk",
    "decoy_items": ".evaluation.passk",
    "gap_comparison": ".evaluation.lens_comparison",
    "heldout_items": ".evaluation.lens_comparison",
    "macro_comparison": ".evaluation.lens_comparison",
    "PromptReading": ".reading.prompt_reading",
    "read_prompt": ".reading.reader",
    "read_prompts": ".reading.reader",
    "ReadingFile": ".reading.reading_file",
    "ReadingFileError": ".reading.reading_file",
    "load_readings": ".reading.reading_file",
    "save_readings": ".reading.reading_file",
    "compare_readings": ".reading.summaries",
    "difference": ".reading.summaries",
    "most_common_tokens": ".reading.summaries",
}

__all__ = [
    "DEFAULT_MODEL",
    "EVAL_SETS",
    "LAYOUTS",
    "Ablate",
    "ActivationRecorder",
    "CheckResult",
    "ExpertLens",
    "FitProgress",
    "FitState",
    "Generation",
    "HFLensModel",
    "JacobianLens",
    "Lens",
    "LensFileError",
    "LensModel",
    "LogitLens",
    "ModelLayout",
    "PromptJacobian",
    "PromptReading",
    "ReadingFile",
    "ReadingFileError",
    "Steer",
    "Swap",
    "SwapReport",
    "TunedLens",
    "check_lens",
    "compare_readings",
    "compare_runs",
    "comparison_figure",
    "decoy_items",
    "default_lens",
    "diff_dumps",
    "difference",
    "divergence_curve",
    "dump_hidden_states",
    "eval_curves_figure",
    "evaluate",
    "fit",
    "fit_figures",
    "gap_comparison",
    "generate",
    "heatmap_figure",
    "heldout_items",
    "jacobian_for_prompt",
    "learn_expert_weights",
    "load_corpus",
    "load_eval_set",
    "load_lens",
    "load_model",
    "load_readings",
    "load_swap_set",
    "macro_comparison",
    "macro_pass_at_k",
    "most_common_tokens",
    "pass_at_k",
    "pass_at_k_figure",
    "pinned_ranks_figure",
    "read_labelled_items",
    "read_prompt",
    "read_prompts",
    "resolve_layers",
    "save_readings",
    "split_items",
    "swap_success",
    "swap_success_figure",
    "token_direction",
    "train_tuned_lens",
    "valid_position_mask",
    "write_reading_page",
]

if TYPE_CHECKING:  # what type checkers and IDEs see
    from .corpus import load_corpus
    from .debugging.diff import diff_dumps, divergence_curve
    from .debugging.dump import dump_hidden_states
    from .evaluation.by_layer import evaluate
    from .evaluation.labelled_items import read_labelled_items
    from .evaluation.lens_comparison import gap_comparison, heldout_items, macro_comparison
    from .evaluation.passk import EVAL_SETS, decoy_items, load_eval_set, pass_at_k
    from .figures.evaluation import eval_curves_figure, pass_at_k_figure
    from .figures.fitting import fit_figures
    from .figures.heatmaps import heatmap_figure
    from .figures.html_page import write_reading_page
    from .figures.interventions import comparison_figure, swap_success_figure
    from .figures.ranks import pinned_ranks_figure
    from .fitting.estimator import PromptJacobian, jacobian_for_prompt, valid_position_mask
    from .fitting.expert_weights import learn_expert_weights, macro_pass_at_k, split_items
    from .fitting.fit import FitProgress, FitState, fit
    from .fitting.tuning import train_tuned_lens
    from .interventions.compare import compare_runs
    from .interventions.lens_edits import Ablate, Steer, Swap
    from .interventions.read_directions import token_direction
    from .interventions.swap_success import SwapReport, load_swap_set, swap_success
    from .layerspec import resolve_layers
    from .lenses.canary import CheckResult, check_lens
    from .lenses.experts import ExpertLens
    from .lenses.lens import JacobianLens, LensFileError, LogitLens
    from .lenses.protocol import Lens
    from .lenses.shipped import default_lens, load_lens
    from .lenses.tuned import TunedLens
    from .models.layouts import LAYOUTS, ModelLayout
    from .models.loading import DEFAULT_MODEL, load_model
    from .models.model import HFLensModel, LensModel
    from .models.recorder import ActivationRecorder
    from .reading.generation import Generation, generate
    from .reading.prompt_reading import PromptReading
    from .reading.reader import read_prompt, read_prompts
    from .reading.reading_file import ReadingFile, ReadingFileError, load_readings, save_readings
    from .reading.summaries import compare_readings, difference, most_common_tokens


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(source, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SOURCES))
