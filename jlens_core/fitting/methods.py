"""The per-prompt Jacobian methods :func:`~jlens_core.fitting.estimator.jacobian_for_prompt` takes
(``method=``) and the check of the backward rules it applies (``rules=``, one of
:data:`jlens_core.lenses.kinds.RULES`). Defined with the fit settings (:mod:`jlens_core.lenses.fit_settings`,
without torch, so the CLI can offer them without importing it)."""

from ..lenses.fit_settings import METHODS, check_rules

__all__ = ["METHODS", "check_rules"]
