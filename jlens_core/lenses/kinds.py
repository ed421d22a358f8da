"""The kinds of lens, in one table: what each is called, how figures draw it, what it can do, its shipped file.

A lens's kind is ``lens.kind``, or (:func:`lens_kind`) the expert kind a combined one-matrix file records.
Everything that names, draws or decides by a kind reads :data:`KINDS`: the shipped variants
(:data:`jlens_core.lenses.shipped.VARIANTS`), the names to a reader (``KIND_NAMES``), the figures' names,
colours and line styles (:mod:`jlens_core.figures.labels`), the rules a fit takes, the expert lens's
kind, the app's slot tags; and every decision that depends on a kind asks a capability
(:func:`capabilities`: fitted or not, split halves, the logit baseline, weighted experts, backward rules,
in the wheel), never compares a kind's name. Adding a kind is one :class:`LensKind` line here
(tests/test_kinds.py checks that it has every field, and a colour and tag of its own).
No torch here: the CLI's parser reads it.
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
        baseline: the logit lens: it fits nothing and reads residuals as they are; comparisons and controls are
            made against it.
        trained: learned by gradient descent on the model's output (the tuned lens), not fitted by ``jlens fit``.
        in_wheel: its shipped file, where one ships, is in the wheel (False: only in a source checkout's
            ``assets/lenses/``, for PyPI's size limit).

    Capabilities derived from those (properties): :attr:`fitted` (by ``jlens fit``: it has backward ``rules``),
    :attr:`has_halves` (its fit keeps split halves and a canary, docs/method.md §3.3, §4.2).
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
    baseline: bool = False
    trained: bool = False
    in_wheel: bool = True

    @property
    def fitted(self) -> bool:
        """Fitted by ``jlens fit`` (an average Jacobian under its backward :attr:`rules`): J, R-lens, experts."""
        return self.rules is not None

    @property
    def has_halves(self) -> bool:
        """Its fit keeps split halves (docs/method.md §3.3) and a canary (§4.2): every fitted kind."""
        return self.fitted


# In the order figures and legends list them.
KINDS: tuple[LensKind, ...] = (
    LensKind("logit", "logit lens", "Logit lens", "Logit", "logit", "logit", "#6c8ebf", "dot", baseline=True),
    LensKind("jacobian", "Jacobian lens", "Jacobian lens", "Jacobian", "Jac", "J", "#d6762b", "solid", "jacobian"),
    LensKind("relevance", "R-lens", "R-lens", "R-lens", "R", "R", "#8e5bb5", "dash", "relevance", variant="relevance"),
    LensKind("tuned", "tuned lens", "Tuned lens", "Tuned", "Tuned", "tuned", "#4c9a5a", "dashdot", trained=True),
    LensKind("jacobian++", "J++ lens", "J++ lens", "J++", "J++", "J++", "#b03a2e", "longdash", "jacobian",
             experts=True, weighted=True, variant="jpp", in_wheel=False),
    LensKind("relevance++", "R++ lens", "R++ lens", "R++", "R++", "R++", "#2a9d8f", "longdashdot", "relevance",
             experts=True, weighted=True, variant="rpp", in_wheel=False),
    LensKind("jacobian-experts", "J-experts lens (uniform weights)", "J-experts lens (uniform)", "J-experts",
             "J-exp", "J-experts (uniform)", "#e9a86b", "longdash", "jacobian", experts=True),
    LensKind("relevance-experts", "R-experts lens (uniform weights)", "R-experts lens (uniform)", "R-experts",
             "R-exp", "R-experts (uniform)", "#c3a6dc", "longdashdot", "relevance", experts=True),
)
BY_KIND: dict[str, LensKind] = {k.kind: k for k in KINDS}
FIELDS = tuple(f.name for f in fields(LensKind))
# the backward rules a fit takes, in table order ("jacobian": ordinary gradients; "relevance": the R-lens's rules):
# the one tuple of them (the fit settings, the lens files and the CLI read it)
RULES: tuple[str, ...] = tuple(dict.fromkeys(k.rules for k in KINDS if k.rules))
# the rules of the plain fit (ordinary gradients: the J lens), which a file from before the R-lens has
PLAIN_RULES: str = RULES[0]
# the logit lens's kind: the baseline that readings, comparisons and controls add (``"logit"``)
BASELINE: str = next(k.kind for k in KINDS if k.baseline)
# the tuned lens's kind (``"tuned"``): trained on the model's output, not fitted by ``jlens fit``
TRAINED: str = next(k.kind for k in KINDS if k.trained)
# the plain fitted lens's kind (``"jacobian"``): the lens a model is read with unless a shipped variant beat it
PLAIN: str = next(k.kind for k in KINDS if k.rules == PLAIN_RULES and not k.experts)
# the kinds that are not expert lenses, in table order: one slot (and reading mode) each in the app
SINGLE_KINDS: tuple[str, ...] = tuple(k.kind for k in KINDS if not k.experts)
# the fitted kinds that are not expert lenses (``"jacobian"``, ``"relevance"``): one matrix per layer from a plain fit
PLAIN_FITTED: tuple[str, ...] = tuple(k.kind for k in KINDS if k.fitted and not k.experts)
# the shipped variants (``<model>.<variant>.safetensors``) that are not in the wheel, only in a source checkout
SOURCE_ONLY_VARIANTS: tuple[str, ...] = tuple(k.variant for k in KINDS if k.variant and not k.in_wheel)


def capabilities(lens_or_kind: object) -> LensKind | None:
    """The table's row of a lens (by :func:`lens_kind`) or of a kind's name; ``None`` for a kind not in the table
    (a lens of another library): callers then assume it is fitted by nothing they know."""
    kind = lens_or_kind if isinstance(lens_or_kind, str) else lens_kind(lens_or_kind)
    return BY_KIND.get(kind)


def is_baseline(lens_or_kind: object) -> bool:
    """Whether a lens (or a kind's name) is the logit lens, the baseline (:attr:`LensKind.baseline`)."""
    row = capabilities(lens_or_kind)
    return row is not None and row.baseline


def is_trained(lens_or_kind: object) -> bool:
    """Whether a lens (or a kind's name) is trained on the model's output (:attr:`LensKind.trained`: the tuned lens)."""
    row = capabilities(lens_or_kind)
    return row is not None and row.trained


def relevance_backward(rules: str) -> bool:
    """Whether a fit under ``rules`` changes the backward pass (the R-lens's relevance rules, docs/method.md §9.1)
    rather than taking ordinary gradients."""
    return rules in RULES and rules != PLAIN_RULES


def expert_kind(rules: str, weighted: bool) -> str:
    """The kind of an expert lens fitted with ``rules``: its ++ kind with learned weights, else its uniform kind.

    Raises:
        KeyError: no expert kind has those rules.
    """
    return next(k.kind for k in KINDS if k.experts and k.rules == rules and k.weighted == bool(weighted))


def plain_kind(rules: str) -> str:
    """The kind of a lens fitted with ``rules`` without experts (``"jacobian"``, ``"relevance"``).

    Raises:
        KeyError: no kind has those rules.
    """
    found = next((k.kind for k in KINDS if not k.experts and k.rules == rules), None)
    if found is None:
        raise KeyError(f"No lens kind is fitted with rules={rules!r}: the rules are {RULES}.")
    return found


def lens_kind(lens: object) -> str:
    """The kind a lens reads as: ``lens.kind``, except that a plain Jacobian lens combined from an expert lens
    (:meth:`~jlens_core.lenses.experts.ExpertLens.to_jacobian_lens`: its record's ``combined_from``, its file's
    settings' ``expert_kind``) is that expert lens's kind (``"jacobian++"``, ``"relevance-experts"``, ...)."""
    kind = str(getattr(lens, "kind", "lens"))
    origin = getattr(getattr(lens, "record", None), "combined_from", None)
    plain = kind in BY_KIND and BY_KIND[kind].fitted and not BY_KIND[kind].experts
    origin_kind = getattr(origin, "kind", None)
    if plain and origin_kind:
        return str(origin_kind)
    return kind


__all__ = ["BASELINE", "BY_KIND", "FIELDS", "KINDS", "PLAIN", "PLAIN_RULES", "RULES", "SINGLE_KINDS",
           "SOURCE_ONLY_VARIANTS", "TRAINED", "LensKind", "capabilities", "expert_kind", "is_baseline", "is_trained", "lens_kind",
           "plain_kind", "relevance_backward"]
