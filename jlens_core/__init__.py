"""jlens: the Jacobian lens for decoder-only transformers.

``lens_l(h) = unembed(J_l @ h)`` where ``J_l`` is the average Jacobian of the last layer's residual
with respect to layer ``l``'s residual. See ``SPEC.md`` and the README.
"""

from ._version import __version__ as __version__
from .corpus import load_corpus
from .fitting.estimator import PromptJacobian, jacobian_for_prompt, resolve_layers, valid_position_mask
from .fitting.fit import FitProgress, FitState, fit
from .lenses.lens import JacobianLens, LensFileError, LogitLens
from .lenses.shipped import default_lens, load_lens
from .models.layouts import LAYOUTS, ModelLayout
from .models.loading import DEFAULT_MODEL, load_model
from .models.model import HFLensModel, LensModel
from .models.recorder import ActivationRecorder
from .reading.evaluation import EVAL_SETS, evaluate, load_eval_set, pass_at_k
from .reading.readings import PromptReading, read_prompt

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
    "resolve_layers",
    "valid_position_mask",
]
