"""jlens: the Jacobian lens for decoder-only transformers.

``lens_l(h) = unembed(J_l @ h)`` where ``J_l`` is the average Jacobian of the last layer's residual
with respect to layer ``l``'s residual. See ``docs/method.md`` and the README.

The names below are imported on first use (PEP 562), not with the package: ``jlens app`` and
``jlens --help`` then start without importing torch, and ``from jlens_core import JacobianLens``
works as before.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__

# The one list of public names: what type checkers and IDEs see; __all__ and the lazy imports are read from it.
if TYPE_CHECKING:
    from .corpus import load_corpus
    from .debugging.diff import diff_dumps
    from .debugging.dump import dump_hidden_states
    from .evaluation.by_layer import evaluate
    from .evaluation.passk import load_eval_set, pass_at_k
    from .evaluation.study import load_study, study
    from .experiments.run import run_experiment
    from .fitting.fit import fit
    from .fitting.tuning import train_tuned_lens
    from .interventions.compare import compare_runs
    from .interventions.jspace_edits import AblateJSpace, ClampJ, VectorSwap
    from .interventions.lens_edits import Ablate, Steer, Swap
    from .interventions.say import make_it_say
    from .interventions.say_success import load_say_set, say_success
    from .interventions.swap_success import load_swap_set, swap_success
    from .jspace.concepts import concept_vectors
    from .jspace.decompose import decompose, split
    from .lenses.canary import check_lens
    from .lenses.experts import ExpertLens
    from .lenses.fit_settings import FitPlan, FitSettings
    from .lenses.header import LensFileError
    from .lenses.lens import JacobianLens, LogitLens
    from .lenses.loading import default_lens, load_lens
    from .lenses.protocol import Lens
    from .lenses.tuned import TunedLens
    from .models.loading import load_model
    from .models.model import HFLensModel, LensModel
    from .reading.generation import generate
    from .reading.prompt_reading import PromptReading
    from .reading.reader import read_prompt, read_prompts
    from .reading.reading_file import load_readings, save_readings
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

# Names the top level held in 0.1 and no longer lists (a notebook's front door keeps what a user types; the rest
# lives in its subpackage): each still resolves, with one DeprecationWarning naming its module, until this version.
MOVED_REMOVED_IN = "0.3.0"
_MOVED = {
    "write_reading_page": ".figures.html_page",
    "divergence_curve": ".debugging.diff",
    "read_labelled_items": ".evaluation.labelled_items",
    "gap_comparison": ".evaluation.lens_comparison",
    "heldout_items": ".evaluation.lens_comparison",
    "macro_comparison": ".evaluation.lens_comparison",
    "EVAL_SETS": ".evaluation.passk",
    "decoy_items": ".evaluation.passk",
    "Study": ".evaluation.study",
    "eval_curves_figure": ".figures.evaluation",
    "pass_at_k_figure": ".figures.evaluation",
    "fit_figures": ".figures.fitting",
    "heatmap_figure": ".figures.heatmaps",
    "comparison_figure": ".figures.interventions",
    "swap_success_figure": ".figures.interventions",
    "pinned_ranks_figure": ".figures.ranks",
    "study_figure": ".figures.study",
    "PromptJacobian": ".fitting.estimator",
    "jacobian_for_prompt": ".fitting.estimator",
    "valid_position_mask": ".fitting.estimator",
    "learn_expert_weights": ".fitting.expert_weights",
    "macro_pass_at_k": ".fitting.expert_weights",
    "split_items": ".fitting.expert_weights",
    "FitProgress": ".fitting.fit",
    "FitState": ".fitting.fit",
    "token_direction": ".interventions.read_directions",
    "SayResult": ".interventions.say",
    "SaySuccessReport": ".interventions.say_success",
    "SwapReport": ".interventions.swap_success",
    "resolve_layers": ".layerspec",
    "CheckResult": ".lenses.canary",
    "FitRecord": ".lenses.fit_settings",
    "LAYOUTS": ".models.layouts",
    "ModelLayout": ".models.layouts",
    "DEFAULT_MODEL": ".models.loading",
    "ActivationRecorder": ".models.recorder",
    "ReadingFileError": ".reading.file_format",
    "Generation": ".reading.generation",
    "ReadingFile": ".reading.reading_file",
}
_warned: set[str] = set()


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        moved = _MOVED.get(name)
        if moved is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        if name not in _warned:
            _warned.add(name)
            warnings.warn(f"jlens_core.{name} moved out of the top level: import it from jlens_core{moved}; the "
                          f"top-level name goes in jlens {MOVED_REMOVED_IN}.", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(moved, __name__), name)
    value = getattr(importlib.import_module(source, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SOURCES))
