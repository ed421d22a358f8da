"""The catalogue of lenses that ship with jlens (``assets/lenses/``): where each lies, its variants and names.

:mod:`jlens_core.lenses.loading` opens them (``load_lens``, ``default_lens``) and any other lens file.

The embedded default model ships its Jacobian lens (``<model>.safetensors``) and its tuned lens
(``<model>.tuned.safetensors``); its other lenses, when fitted, lie beside them as
``<model>.<variant>.safetensors`` with ``variant`` one of :data:`VARIANTS`: ``relevance`` (the R-lens),
``jpp`` and ``rpp`` (the J++ and R++ lenses, each combined into one matrix per layer:
:meth:`~jlens_core.lenses.experts.ExpertLens.to_jacobian_lens`, or a full expert lens file).
"""

from __future__ import annotations

from pathlib import Path

from .._paths import ASSETS_DIR
from ..models.loading import DEFAULT_ALIASES, DEFAULT_MODEL
from .header import header_or_none
from .kinds import KINDS, PLAIN, SOURCE_ONLY_VARIANTS

LENS_DIR = ASSETS_DIR / "lenses"
SHIPPED_LENSES = {DEFAULT_MODEL: LENS_DIR / f"{DEFAULT_MODEL}.safetensors"}
SHIPPED_TUNED_LENSES = {DEFAULT_MODEL: LENS_DIR / f"{DEFAULT_MODEL}.tuned.safetensors"}
# The shipped lenses beside a model's Jacobian lens: ``<model>.<variant>.safetensors``.
VARIANTS = {k.variant: k.name for k in KINDS if k.variant}  # {"relevance": "R-lens", "jpp": "J++ lens", "rpp": ...}
# The lens each model's readings open with beside the logit lens (the app's default): the Jacobian lens
# (``"jacobian"``) unless a shipped variant beat it on held-out items and under the decoy control
# (docs/results.md, "The default lens": the default model's J++ and R++ win the first, tie the second).
DEFAULT_READING_LENS = {DEFAULT_MODEL: PLAIN}
# How each kind of lens (``lens_kind``) is named to a reader.
KIND_NAMES = {k.kind: k.name for k in KINDS}
# SOURCE_ONLY_VARIANTS (the kinds' table, ``in_wheel=False``): variants that lie in a source checkout's
# ``assets/lenses/`` but not in the wheel: PyPI refuses wheels over 100 MB, and these tie the Jacobian lens on
# held-out items (docs/results.md, "The default lens"), so the Jacobian lens's split halves took their space
# (pyproject's exclude-package-data).


def missing_variant_message(name: str, variant: str) -> str:
    """The sentence for a shipped variant lens that is not on disk: where it lies, or how to get one."""
    key = _model_key(name)
    file = f"assets/lenses/{_stems(name)[0]}.{variant}.safetensors"
    if variant in SOURCE_ONLY_VARIANTS and key in SHIPPED_LENSES:
        return (f"The {VARIANTS[variant]} of {key!r} is not in the wheel (PyPI's 100 MB limit; it ties the "
                f"Jacobian lens on held-out items): it lies in a clone of the jlens repository as {file}; load "
                "that file by path, or fit one (docs/fitting.md, experts).")
    return (f"No shipped {VARIANTS[variant]} for {name!r} ({file}): fit one (docs/fitting.md), or load a lens "
            "file by path.")


def shipped_tuned_lens_path(name: str = DEFAULT_MODEL) -> Path | None:
    """The shipped tuned lens for model ``name``, or ``None``."""
    key = DEFAULT_MODEL if str(name).lower() in DEFAULT_ALIASES else str(name)
    path = SHIPPED_TUNED_LENSES.get(key)
    return path if path is not None and path.is_file() else None


def is_tuned_lens_file(path: str | Path) -> bool:
    """Whether ``path`` is a tuned lens: a tuned-lens folder, or a safetensors file of format ``jlens-tuned``."""
    path = Path(path)
    if path.is_dir():
        return (path / "config.json").is_file() and (path / "params.pt").is_file()
    header = header_or_none(path)
    return header is not None and header.is_tuned


def _model_key(name: str) -> str:
    return DEFAULT_MODEL if str(name).lower() in DEFAULT_ALIASES else str(name)


def _stems(name: str) -> list[str]:
    """The file stems a model's shipped lenses may have in ``assets/lenses/``: its registered lens's, then its
    name, a Hub id's file name (``owner--repo``) and a folder's name."""
    key = _model_key(name)
    base = SHIPPED_LENSES.get(key)
    stems = [base.name.removesuffix(".safetensors")] if base is not None else []
    stems += [key, key.replace("/", "--"), Path(key).name]
    return list(dict.fromkeys(s for s in stems if s and s not in (".", "..")))


def shipped_lens_path(name: str = DEFAULT_MODEL, variant: str | None = None) -> Path | None:
    """The shipped lens file for model ``name``, or ``None`` if none ships (or it is not on disk):
    ``assets/lenses/<model>.safetensors``.

    ``variant`` (one of :data:`VARIANTS`) asks for ``assets/lenses/<model>.<variant>.safetensors``
    instead of the Jacobian lens: the R-lens, or the J++ / R++ lens.

    Raises:
        ValueError: ``variant`` is not one of :data:`VARIANTS`.
    """
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not a shipped lens variant: use one of {', '.join(VARIANTS)} "
                         "(or None for the Jacobian lens).")
    suffix = ".safetensors" if variant is None else f".{variant}.safetensors"
    for stem in _stems(name):
        path = LENS_DIR / f"{stem}{suffix}"
        if path.is_file():
            return path
    return None


def default_reading_lens(name: str = DEFAULT_MODEL) -> str:
    """The lens model ``name`` is read with by default (:data:`DEFAULT_READING_LENS`): ``"jacobian"``, or a
    shipped variant of :data:`VARIANTS` (``"relevance"``, ``"jpp"``, ``"rpp"``) when it ships for the model."""
    choice = DEFAULT_READING_LENS.get(_model_key(name), PLAIN)
    if choice in VARIANTS and shipped_lens_path(name, choice) is None:
        return PLAIN
    return choice
