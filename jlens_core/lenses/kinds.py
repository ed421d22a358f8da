"""The kinds of lens, in one table: what each is called, how figures draw it, its rules and shipped file.

A lens's kind is ``lens.kind``, or (:func:`lens_kind`) the expert kind a combined one-matrix file records.
Everything that names or draws a kind reads :data:`KINDS`: the shipped variants
(:data:`jlens_core.lenses.shipped.VARIANTS`), the names to a reader (``KIND_NAMES``), the figures' names,
colours and line styles (:mod:`jlens_core.figures.labels`), the rules a fit takes, the expert lens's
kind, the app's slot tags. Adding a kind is one :class:`LensKind` line here (tests/test_kinds.py checks
that it has every field, and a colour and tag of its own). No torch here: the CLI's parser reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class LensKind:
    """One kind of lens.

    Attributes:
        kind: the key (``lens.kind``; ``"jacobian++"``).
        name: how a sentence names it (``"J++ lens"``).
        label: a figure's legend or panel title (``"J++ lens"``; capitalised).
        short: the short name in a difference's title ``"B − A"`` (``"J++"``).
        abbr: the shortest, on a difference's colour bar (``"J++"``).
        tag: the name the app gives a loaded lens of this kind, and the tag of a file added
            (``"my-lens (J++)"``); figures draw a lens named by its tag in the kind's colour.
        colour: its line / bar colour in every figure (``"#rrggbb"``).
        dash: its Plotly line dash (pinned-rank lines).
        rules: the fit's backward rules (``"jacobian"``, ``"relevance"``; None for a lens not fitted so).
        experts: an expert lens (one Jacobian per cluster of residuals, docs/method.md §9.1).
        weighted: its experts' weights were learned (the ++ lenses).
        variant: the suffix of its shipped file, ``assets/lenses/<model>.<variant>.safetensors`` (None: no such
            variant; the plain Jacobian lens is ``<model>.safetensors``).
    """

    kind: str
    name: str
    label: str
    short: str
    abbr: str
    tag: str
    colour: str
    dash: str
    rules: str | None = None
    experts: bool = False
    weighted: bool = False
    variant: str | None = None


# In the order figures and legends list them.
KINDS: tuple[LensKind, ...] = (
    LensKind("logit", "logit lens", "Logit lens", "Logit", "logit", "logit", "#6c8ebf", "dot"),
    LensKind("jacobian", "Jacobian lens", "Jacobian lens", "Jacobian", "Jac", "J", "#d6762b", "solid", "jacobian"),
    LensKind("relevance", "R-lens", "R-lens", "R-lens", "R", "R", "#8e5bb5", "dash", "relevance", variant="relevance"),
    LensKind("tuned", "tuned lens", "Tuned lens", "Tuned", "Tuned", "tuned", "#4c9a5a", "dashdot"),
    LensKind("jacobian++", "J++ lens", "J++ lens", "J++", "J++", "J++", "#b03a2e", "longdash", "jacobian",
             experts=True, weighted=True, variant="jpp"),
    LensKind("relevance++", "R++ lens", "R++ lens", "R++", "R++", "R++", "#2a9d8f", "longdashdot", "relevance",
             experts=True, weighted=True, variant="rpp"),
    LensKind("jacobian-experts", "J-experts lens (uniform weights)", "J-experts lens (uniform)", "J-experts",
             "J-exp", "J-experts (uniform)", "#e9a86b", "longdash", "jacobian", experts=True),
    LensKind("relevance-experts", "R-experts lens (uniform weights)", "R-experts lens (uniform)", "R-experts",
             "R-exp", "R-experts (uniform)", "#c3a6dc", "longdashdot", "relevance", experts=True),
)
BY_KIND: dict[str, LensKind] = {k.kind: k for k in KINDS}
FIELDS = tuple(f.name for f in fields(LensKind))
# the backward rules a fit takes, in table order ("jacobian": ordinary gradients; "relevance": the R-lens's rules)
RULES: tuple[str, ...] = tuple(dict.fromkeys(k.rules for k in KINDS if k.rules))


def expert_kind(rules: str, weighted: bool) -> str:
    """The kind of an expert lens fitted with ``rules``: its ++ kind with learned weights, else its uniform kind.

    Raises:
        KeyError: no expert kind has those rules.
    """
    return next(k.kind for k in KINDS if k.experts and k.rules == rules and k.weighted == bool(weighted))


def lens_kind(lens: object) -> str:
    """The kind a lens reads as: ``lens.kind``, except that a plain Jacobian lens combined from an expert lens
    (:meth:`~jlens_core.lenses.experts.ExpertLens.to_jacobian_lens`, its settings record ``expert_kind``)
    is that expert lens's kind (``"jacobian++"``, ``"relevance-experts"``, ...)."""
    kind = str(getattr(lens, "kind", "lens"))
    settings = getattr(lens, "settings", None)
    plain = kind in BY_KIND and BY_KIND[kind].rules is not None and not BY_KIND[kind].experts
    if plain and isinstance(settings, dict) and settings.get("expert_kind"):
        return str(settings["expert_kind"])
    return kind


__all__ = ["BY_KIND", "FIELDS", "KINDS", "RULES", "LensKind", "expert_kind", "lens_kind"]
