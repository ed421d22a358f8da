"""Lenses that ship with jlens (``assets/lenses/``): the fitted lens of the embedded default model."""

from __future__ import annotations

import logging
from pathlib import Path

from .._paths import ASSETS_DIR
from ..models.loading import DEFAULT_ALIASES, DEFAULT_MODEL
from ..models.model import LensModel
from .hub import resolve_lens_path
from .lens import JacobianLens
from .tuned import FORMAT_NAME as TUNED_FORMAT
from .tuned import TunedLens

log = logging.getLogger(__name__)

LENS_DIR = ASSETS_DIR / "lenses"
SHIPPED_LENSES = {DEFAULT_MODEL: LENS_DIR / f"{DEFAULT_MODEL}.safetensors"}
SHIPPED_TUNED_LENSES = {DEFAULT_MODEL: LENS_DIR / f"{DEFAULT_MODEL}.tuned.safetensors"}


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


def shipped_lens_path(name: str = DEFAULT_MODEL) -> Path | None:
    """The shipped lens file for model ``name``, or ``None`` if none ships (or it is not on disk)."""
    key = DEFAULT_MODEL if str(name).lower() in DEFAULT_ALIASES else str(name)
    path = SHIPPED_LENSES.get(key)
    return path if path is not None and path.is_file() else None


def load_lens(spec: str = DEFAULT_MODEL, *, model: LensModel | None = None) -> JacobianLens | TunedLens:
    """A lens by model name (the shipped lens, e.g. :data:`DEFAULT_MODEL`), by path (a Jacobian lens
    file, a tuned lens file, or a tuned-lens folder: ``config.json`` + ``params.pt``) or from the Hub
    (``hf://owner/repo[@revision]/path/in/repo.pt``, through ``huggingface_hub``'s cache).

    Args:
        model: if given, the lens must belong to it.

    Raises:
        FileNotFoundError: no shipped lens for that name, and no such file.
        LensFileError: not a lens, truncated, or for another model.
    """
    path = shipped_lens_path(spec)
    if path is None:
        path = resolve_lens_path(spec)  # hf://owner/repo[@revision]/path through the Hub cache
        if path.is_dir() or (path.is_file() and is_tuned_lens_file(path)):
            return TunedLens.load(path, model=model)
        if not path.is_file():
            shipped = ", ".join(sorted(k for k, v in SHIPPED_LENSES.items() if v.is_file())) or "none"
            raise FileNotFoundError(f"No lens file at {spec!r}, and no shipped lens by that name (shipped: "
                                    f"{shipped}). Fit one with `jlens fit --out LENS`.")
    return JacobianLens.load(path, model=model)


def default_tuned_lens(model: LensModel) -> TunedLens | None:
    """The shipped tuned lens for ``model``, or ``None``."""
    path = shipped_tuned_lens_path(model.name)
    return None if path is None else TunedLens.load(path, model=model)


def default_lens(model: LensModel) -> JacobianLens | None:
    """The shipped lens for ``model`` (an :class:`~jlens_core.models.model.HFLensModel`), or ``None``."""
    path = shipped_lens_path(model.name)
    if path is None:
        return None
    return JacobianLens.load(path, model=model)
