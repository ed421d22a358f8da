"""The per-prompt Jacobian methods :func:`~jlens_core.fitting.estimator.jacobian_for_prompt` takes
(``method=``) and the backward rules it applies (``rules=``), in a module without torch, so the CLI
can offer them without importing it."""

from ..lenses.kinds import RULES as LENS_RULES

METHODS = ("auto", "fused", "batched", "replicated")
# "jacobian": ordinary gradients (docs/method.md §2); "relevance": the R-lens's rules (docs/method.md §9.1)
RULES = LENS_RULES  # from the lens kinds (jlens_core.lenses.kinds)


def check_rules(rules: object) -> str:
    """``rules`` if it is one of :data:`RULES`.

    Raises:
        ValueError: any other value, in one sentence.
    """
    if rules not in RULES:
        raise ValueError(f"rules={rules!r} is not one of {RULES}: use 'jacobian' (ordinary gradients) or "
                         "'relevance' (the R-lens's backward rules, docs/method.md §9.1).")
    return str(rules)
