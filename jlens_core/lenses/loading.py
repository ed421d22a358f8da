"""Opening lenses: :func:`load_lens` reads any lens (a shipped one by model name, a file or folder, a Hub
path) and :func:`default_lens` / :func:`default_tuned_lens` a model's shipped ones
(:mod:`jlens_core.lenses.shipped` is the catalogue of where they lie)."""

from __future__ import annotations

from pathlib import Path

from ..models.loading import DEFAULT_MODEL
from ..models.model import LensModel
from . import shipped
from .experts import ExpertLens, is_expert_lens_file
from .header import LensFileError
from .hub import resolve_lens_path
from .kinds import BY_KIND
from .lens import JacobianLens
from .shipped import (
    VARIANTS,
    is_tuned_lens_file,
    missing_variant_message,
    shipped_lens_path,
    shipped_tuned_lens_path,
)
from .tuned import TunedLens


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
        raise FileNotFoundError(missing_variant_message(spec, variant))
    if path is None:
        path = resolve_lens_path(spec)  # hf://owner/repo[@revision]/path through the Hub cache
        if not path.exists():
            names = ", ".join(sorted(k for k, v in shipped.SHIPPED_LENSES.items() if v.is_file())) or "none"
            raise FileNotFoundError(f"No lens file at {spec!r}, and no shipped lens by that name (shipped: "
                                    f"{names}). Fit one with `jlens fit --out LENS`.")
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
        what = VARIANTS.get(variant or "", BY_KIND["jacobian"].name)
        raise LensFileError(f"{str(path)!r} is a tuned lens, not a {what}.")
    return lens


__all__ = ["default_lens", "default_tuned_lens", "load_lens", "load_lens_file"]
