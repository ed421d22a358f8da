"""The optional extras of ``pyproject.toml`` and the one sentence that names a missing one.

A leaf (no jlens imports, no torch): the CLI, the model loader, the figures and the PNG plots check their
extra before importing it, so a plain ``pip install jacobian-lens`` stops with the command to run, not a traceback.
"""

from __future__ import annotations

import importlib.util

# extra -> the modules it installs (pyproject.toml's [project.optional-dependencies]; tests/test_wheel.py
# checks that the two agree)
EXTRAS: dict[str, tuple[str, ...]] = {
    "gguf": ("gguf", "accelerate"),
    "app": ("streamlit", "plotly"),
    "plot": ("matplotlib",),
}


class MissingExtraError(ImportError):
    """An optional extra is not installed; the message is one sentence with the pip command."""


def missing_modules(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be imported here (found without importing them)."""
    if extra not in EXTRAS:
        raise ValueError(f"Unknown extra {extra!r}: one of {', '.join(sorted(EXTRAS))}.")
    return [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]


def require_extra(extra: str, what: str) -> None:
    """Raise :class:`MissingExtraError` when a module of ``extra`` is missing.

    Args:
        extra: a key of :data:`EXTRAS` (``"gguf"``, ``"app"``, ``"plot"``).
        what: what needs it, the sentence's subject (``"jlens app"``).

    Raises:
        MissingExtraError: e.g. "jlens app needs the optional extra [app] (streamlit is not installed):
            pip install 'jacobian-lens[app]' (from a checkout: pip install -e '.[app]')."
        ValueError: an unknown extra.
    """
    missing = missing_modules(extra)
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise MissingExtraError(f"{what} needs the optional extra [{extra}] ({', '.join(missing)} {verb} not "
                                f"installed): pip install 'jacobian-lens[{extra}]' (from a checkout: pip install -e "
                                f"'.[{extra}]').")
