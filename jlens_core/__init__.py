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

# public name -> the module that defines it
_SOURCES = {
    "load_corpus": ".corpus",
    "PromptJacobian": ".fitting.estimator",
    "jacobian_for_prompt": ".fitting.estimator",
    "resolve_layers": ".fitting.estimator",
    "valid_position_mask": ".fitting.estimator",
    "FitProgress": ".fitting.fit",
    "FitState": ".fitting.fit",
    "fit": ".fitting.fit",
    "JacobianLens": ".lenses.lens",
    "LensFileError": ".lenses.lens",
    "LogitLens": ".lenses.lens",
    "default_lens": ".lenses.shipped",
    "load_lens": ".lenses.shipped",
    "LAYOUTS": ".models.layouts",
    "ModelLayout": ".models.layouts",
    "DEFAULT_MODEL": ".models.loading",
    "load_model": ".models.loading",
    "HFLensModel": ".models.model",
    "LensModel": ".models.model",
    "ActivationRecorder": ".models.recorder",
    "EVAL_SETS": ".reading.passk",
    "evaluate": ".reading.evaluation",
    "load_eval_set": ".reading.passk",
    "pass_at_k": ".reading.passk",
    "PromptReading": ".reading.readings",
    "read_prompt": ".reading.readings",
    "read_prompts": ".reading.readings",
}

__all__ = [
    "DEFAULT_MODEL",
    "EVAL_SETS",
    "LAYOUTS",
    "ActivationRecorder",
    "FitProgress",
    "FitState",
    "HFLensModel",
    "JacobianLens",
    "LensFileError",
    "LensModel",
    "LogitLens",
    "ModelLayout",
    "PromptJacobian",
    "PromptReading",
    "default_lens",
    "evaluate",
    "fit",
    "jacobian_for_prompt",
    "load_corpus",
    "load_eval_set",
    "load_lens",
    "load_model",
    "pass_at_k",
    "read_prompt",
    "read_prompts",
    "resolve_layers",
    "valid_position_mask",
]

if TYPE_CHECKING:  # what type checkers and IDEs see
    from .corpus import load_corpus
    from .fitting.estimator import PromptJacobian, jacobian_for_prompt, resolve_layers, valid_position_mask
    from .fitting.fit import FitProgress, FitState, fit
    from .lenses.lens import JacobianLens, LensFileError, LogitLens
    from .lenses.shipped import default_lens, load_lens
    from .models.layouts import LAYOUTS, ModelLayout
    from .models.loading import DEFAULT_MODEL, load_model
    from .models.model import HFLensModel, LensModel
    from .models.recorder import ActivationRecorder
    from .reading.evaluation import evaluate
    from .reading.passk import EVAL_SETS, load_eval_set, pass_at_k
    from .reading.readings import PromptReading, read_prompt, read_prompts


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(source, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SOURCES))
