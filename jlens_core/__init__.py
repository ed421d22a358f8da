"""jlens: the Jacobian lens for decoder-only transformers.

``lens_l(h) = unembed(J_l @ h)`` where ``J_l`` is the average Jacobian of the last layer's residual
with respect to layer ``l``'s residual. See ``SPEC.md`` and the README.
"""

from .estimator import PromptJacobian, jacobian_for_prompt, resolve_layers, valid_position_mask
from .fit import FitProgress, FitState, fit
from .layouts import LAYOUTS, ModelLayout
from .lens import JacobianLens, LensFileError, LogitLens
from .model import HFLensModel, LensModel
from .recorder import ActivationRecorder

__version__ = "0.1.0"

__all__ = [
    "LAYOUTS", "ActivationRecorder", "FitProgress", "FitState", "HFLensModel", "JacobianLens",
    "LensFileError", "LensModel", "LogitLens", "ModelLayout", "PromptJacobian", "fit",
    "jacobian_for_prompt", "resolve_layers", "valid_position_mask",
]
