"""The per-prompt Jacobian methods :func:`~jlens_core.fitting.estimator.jacobian_for_prompt` takes
(``method=``), in a module without torch, so the CLI can offer them without importing it."""

METHODS = ("auto", "fused", "batched", "replicated")
