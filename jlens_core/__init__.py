"""jlens: the Jacobian lens for decoder-only transformers.

``lens_l(h) = unembed(J_l @ h)`` where ``J_l`` is the average Jacobian of the last layer's residual
with respect to layer ``l``'s residual. See ``SPEC.md`` and the README.
"""

from .analysis import PromptReading, read_prompt
from .corpus import load_corpus
from .estimator import PromptJacobian, jacobian_for_prompt, resolve_layers, valid_position_mask
from .evaluation import EVAL_SETS, evaluate, load_eval_set, pass_at_k
from .fit import FitProgress, FitState, fit
from .layouts import LAYOUTS, ModelLayout
from .lens import JacobianLens, LensFileError, LogitLens
from .loading import DEFAULT_MODEL, load_model
from .model import HFLensModel, LensModel
from .recorder import ActivationRecorder
from .shipped import default_lens, load_lens

__version__ = "0.1.0"

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
