"""Old module paths kept for a while after a move: a module-level ``__getattr__`` that forwards to the new
module and warns once (a leaf: it names the new module as a string, imported on first use)."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def moved_module(old: str, new: str, removed_in: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the shim at ``old``: every name is ``new``'s; the first look-up warns
    (``DeprecationWarning``, once per process) that ``old`` goes in jlens ``removed_in``."""
    warned = False

    def __getattr__(name: str) -> Any:
        nonlocal warned
        if name.startswith("__"):  # module protocol look-ups (__path__, __file__ ...) are not uses
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        target = importlib.import_module(new)
        if not warned:
            warned = True
            warnings.warn(f"{old} moved to {new}: import from there (or from jlens_core); the old path goes in "
                          f"jlens {removed_in}.", DeprecationWarning, stacklevel=2)
        return getattr(target, name)

    def __dir__() -> list[str]:
        return sorted(dir(importlib.import_module(new)))

    return __getattr__, __dir__
