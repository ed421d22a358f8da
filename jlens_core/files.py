"""jlens's files, publicly: where the shipped assets are, and writing a file whole.

A thin public front over the private leaves ``_paths`` and ``_atomic``, for the app and scripts
(which import only public ``jlens_core`` modules; ``tests/test_layout.py`` checks it).
"""

from __future__ import annotations

from pathlib import Path

from ._atomic import atomic_write, atomic_write_text
from ._paths import ASSETS_DIR


def assets_dir() -> Path:
    """The folder of the files that ship with jlens (``lenses/``, ``evaluations/``, ``example_prompts.json``):
    the checkout's ``assets/``, or the installed package data ``jlens_assets``."""
    return ASSETS_DIR


__all__ = ["assets_dir", "atomic_write", "atomic_write_text"]
