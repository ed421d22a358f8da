"""Lenses that ship with jlens (``assets/lenses/``): the fitted lens of the embedded default model."""

from __future__ import annotations

import logging
from pathlib import Path

from .._paths import ASSETS_DIR
from ..models.loading import DEFAULT_ALIASES, DEFAULT_MODEL
from .lens import JacobianLens

log = logging.getLogger(__name__)

LENS_DIR = ASSETS_DIR / "lenses"
SHIPPED_LENSES = {DEFAULT_MODEL: LENS_DIR / f"{DEFAULT_MODEL}.safetensors"}


def shipped_lens_path(name: str = DEFAULT_MODEL) -> Path | None:
    """The shipped lens file for model ``name``, or ``None`` if none ships (or it is not on disk)."""
    key = DEFAULT_MODEL if str(name).lower() in DEFAULT_ALIASES else str(name)
    path = SHIPPED_LENSES.get(key)
    return path if path is not None and path.is_file() else None


def load_lens(spec: str = DEFAULT_MODEL, *, model=None) -> JacobianLens:
    """A lens by model name (the shipped lens, e.g. :data:`DEFAULT_MODEL`) or by file path.

    Args:
        model: if given, the lens must belong to it.

    Raises:
        FileNotFoundError: no shipped lens for that name, and no such file.
        LensFileError: not a lens, truncated, or for another model.
    """
    path = shipped_lens_path(spec)
    if path is None:
        path = Path(spec).expanduser()
        if not path.is_file():
            shipped = ", ".join(sorted(k for k, v in SHIPPED_LENSES.items() if v.is_file())) or "none"
            raise FileNotFoundError(f"No lens file at {spec!r}, and no shipped lens by that name (shipped: "
                                    f"{shipped}). Fit one with `jlens fit --out LENS`.")
    return JacobianLens.load(path, model=model)


def default_lens(model) -> JacobianLens | None:
    """The shipped lens for ``model`` (an :class:`~jlens_core.models.model.HFLensModel`), or ``None``."""
    path = shipped_lens_path(getattr(model, "name", ""))
    if path is None:
        return None
    return JacobianLens.load(path, model=model)
