"""Lenses that ship with jlens (``assets/lenses/``), and :func:`load_lens`, which reads any lens file.

The embedded default model ships its Jacobian lens (``<model>.safetensors``) and its tuned lens
(``<model>.tuned.safetensors``); its other lenses, when fitted, lie beside them as
``<model>.<variant>.safetensors`` with ``variant`` one of :data:`VARIANTS`: ``relevance`` (the R-lens),
``jpp`` and ``rpp`` (the J++ and R++ lenses, each combined into one matrix per layer:
:meth:`~jlens_core.lenses.experts.ExpertLens.to_jacobian_lens`, or a full expert lens file).
"""

from __future__ import annotations

import logging
from pathlib import Path

from .._paths import ASSETS_DIR
from ..models.loading import DEFAULT_ALIASES, DEFAULT_MODEL
from ..models.model import LensModel
from .experts import ExpertLens, is_expert_lens_file
from .hub import resolve_lens_path
from .lens import JacobianLens, LensFileError
from .tuned import FORMAT_NAME as TUNED_FORMAT
from .tuned import TunedLens

log = logging.getLogger(__name__)

LENS_DIR = ASSETS_DIR / "lenses"
SHIPPED_LENSES = {DEFAULT_MODEL: LENS_DIR / f"{DEFAULT_MODEL}.safetensors"}
SHIPPED_TUNED_LENSES = {DEFAULT_MODEL: LENS_DIR / f"{DEFAULT_MODEL}.tuned.safetensors"}
# The shipped lenses beside a model's Jacobian lens: ``<model>.<variant>.safetensors``.
VARIANTS = {"relevance": "R-lens", "jpp": "J++ lens", "rpp": "R++ lens"}
# The lens each model's readings open with beside the logit lens (the app's default): the Jacobian lens
# (``"jacobian"``) unless a shipped variant beat it on held-out items and under the decoy control
# (docs/results.md, "The default lens": the default model's J++ and R++ win the first, tie the second).
DEFAULT_READING_LENS = {DEFAULT_MODEL: "jacobian"}
# How each kind of lens (``lens_kind``) is named to a reader.
KIND_NAMES = {"logit": "logit lens", "jacobian": "Jacobian lens", "relevance": "R-lens", "tuned": "tuned lens",
              "jacobian++": "J++ lens", "relevance++": "R++ lens", "jacobian-experts": "J-experts lens (uniform weights)",
              "relevance-experts": "R-experts lens (uniform weights)"}


def shipped_tuned_lens_path(name: str = DEFAULT_MODEL) -> Path | None:
    """The shipped tuned lens for model ``name``, or ``None``."""
    key = DEFAULT_MODEL if str(name).lower() in DEFAULT_ALIASES else str(name)
    path = SHIPPED_TUNED_LENSES.get(key)
    return path if path is not None and path.is_file() else None


def is_tuned_lens_file(path: str | Path) -> bool:
    """Whether ``path`` is a tuned lens: a tuned-lens folder, or a safetensors file of format ``jlens-tuned``."""
    import json
    import struct

    path = Path(path)
    if path.is_dir():
        return (path / "config.json").is_file() and (path / "params.pt").is_file()
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 1 << 26:
                return False
            header = json.loads(f.read(size))
        info = json.loads(header.get("__metadata__", {}).get("jlens", "{}"))
    except (OSError, ValueError, struct.error, AttributeError):
        return False
    return info.get("format") == TUNED_FORMAT


def _model_key(name: str) -> str:
    return DEFAULT_MODEL if str(name).lower() in DEFAULT_ALIASES else str(name)


def shipped_lens_path(name: str = DEFAULT_MODEL, variant: str | None = None) -> Path | None:
    """The shipped lens file for model ``name``, or ``None`` if none ships (or it is not on disk).

    ``variant`` (one of :data:`VARIANTS`) asks for ``assets/lenses/<model>.<variant>.safetensors``
    instead of the Jacobian lens: the R-lens, or the J++ / R++ lens.

    Raises:
        ValueError: ``variant`` is not one of :data:`VARIANTS`.
    """
    key = _model_key(name)
    if variant is None:
        path = SHIPPED_LENSES.get(key)
        return path if path is not None and path.is_file() else None
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not a shipped lens variant: use one of {', '.join(VARIANTS)} "
                         "(or None for the Jacobian lens).")
    base = SHIPPED_LENSES.get(key)
    stems = [base.name.removesuffix(".safetensors")] if base is not None else []
    stems += [key.replace("/", "--"), Path(key).name]  # a Hub id's file name, or a folder's
    for stem in dict.fromkeys(s for s in stems if s and s not in (".", "..")):
        path = LENS_DIR / f"{stem}.{variant}.safetensors"
        if path.is_file():
            return path
    return None


def default_reading_lens(name: str = DEFAULT_MODEL) -> str:
    """The lens model ``name`` is read with by default (:data:`DEFAULT_READING_LENS`): ``"jacobian"``, or a
    shipped variant of :data:`VARIANTS` (``"relevance"``, ``"jpp"``, ``"rpp"``) when it ships for the model."""
    choice = DEFAULT_READING_LENS.get(_model_key(name), "jacobian")
    if choice != "jacobian" and shipped_lens_path(name, choice) is None:
        return "jacobian"
    return choice


def lens_kind(lens: object) -> str:
    """The kind a lens reads as: ``lens.kind``, except that a plain Jacobian lens combined from an expert lens
    (:meth:`~jlens_core.lenses.experts.ExpertLens.to_jacobian_lens`, its settings record ``expert_kind``)
    is that expert lens's kind (``"jacobian++"``, ``"relevance-experts"``, ...)."""
    settings = getattr(lens, "settings", None)
    if isinstance(lens, JacobianLens) and isinstance(settings, dict) and settings.get("expert_kind"):
        return str(settings["expert_kind"])
    return str(getattr(lens, "kind", "lens"))


def load_lens_file(path: str | Path, *, model: LensModel | None = None) -> JacobianLens | ExpertLens | TunedLens:
    """The lens in a local file or folder, whatever its kind: a tuned lens (a jlens tuned file, or a
    tuned-lens folder), an expert lens (:meth:`ExpertLens.load`), else a Jacobian lens (a jlens file,
    the combined one-matrix J++ / R++ file among them, or the reference's ``.pt``).

    Raises:
        FileNotFoundError: no such file or folder.
        LensFileError: not a lens, truncated, or (with ``model=``) for another model.
    """
    path = Path(path)
    if path.is_dir() or (path.is_file() and is_tuned_lens_file(path)):
        return TunedLens.load(path, model=model)
    if is_expert_lens_file(path):
        return ExpertLens.load(path, model=model)
    return JacobianLens.load(path, model=model)


def _split_variant(spec: str) -> tuple[str, str | None]:
    """``"<model>:<variant>"`` (e.g. ``"smollm2-135m:jpp"``) as ``(model, variant)``; anything else as ``(spec, None)``."""
    if not spec.startswith("hf://") and ":" in spec:
        name, _, variant = spec.rpartition(":")
        if variant in VARIANTS and name:
            return name, variant
    return spec, None


def load_lens(spec: str = DEFAULT_MODEL, *, model: LensModel | None = None,
              variant: str | None = None) -> JacobianLens | ExpertLens | TunedLens:
    """A lens by model name (the shipped lens, e.g. :data:`DEFAULT_MODEL`; ``variant=`` or ``"<model>:<variant>"``
    for its shipped R-lens, J++ or R++ lens, :data:`VARIANTS`), by path (a Jacobian lens file, an expert lens
    file, a combined J++ / R++ file, a tuned lens file, or a tuned-lens folder: ``config.json`` + ``params.pt``)
    or from the Hub (``hf://owner/repo[@revision]/path/in/repo.pt``, through ``huggingface_hub``'s cache).

    Args:
        model: if given, the lens must belong to it.

    Raises:
        FileNotFoundError: no shipped lens for that name (and variant), and no such file.
        LensFileError: not a lens, truncated, or for another model.
        ValueError: an unknown ``variant``.
    """
    if variant is None:
        spec, variant = _split_variant(spec)
    path = shipped_lens_path(spec, variant)
    if path is None and variant is not None:
        raise FileNotFoundError(f"No shipped {VARIANTS[variant]} for {spec!r} (assets/lenses/<model>.{variant}."
                                "safetensors): fit one (docs/fitting.md), or load a lens file by path.")
    if path is None:
        path = resolve_lens_path(spec)  # hf://owner/repo[@revision]/path through the Hub cache
        if not path.exists():
            shipped = ", ".join(sorted(k for k, v in SHIPPED_LENSES.items() if v.is_file())) or "none"
            raise FileNotFoundError(f"No lens file at {spec!r}, and no shipped lens by that name (shipped: "
                                    f"{shipped}). Fit one with `jlens fit --out LENS`.")
    return load_lens_file(path, model=model)


def default_tuned_lens(model: LensModel) -> TunedLens | None:
    """The shipped tuned lens for ``model``, or ``None``."""
    path = shipped_tuned_lens_path(model.name)
    return None if path is None else TunedLens.load(path, model=model)


def default_lens(model: LensModel, variant: str | None = None) -> JacobianLens | ExpertLens | None:
    """The shipped lens for ``model`` (an :class:`~jlens_core.models.model.HFLensModel`), or ``None``.

    ``variant`` (:data:`VARIANTS`) asks for the shipped R-lens, J++ or R++ lens instead of the Jacobian lens
    (a combined file reads as a :class:`JacobianLens`, a full expert lens file as an :class:`ExpertLens`).
    """
    path = shipped_lens_path(model.name, variant)
    if path is None:
        return None
    lens = load_lens_file(path, model=model)
    if isinstance(lens, TunedLens):  # a tuned file under a Jacobian lens's name
        raise LensFileError(f"{str(path)!r} is a tuned lens, not a {VARIANTS.get(variant or '', 'Jacobian lens')}.")
    return lens
