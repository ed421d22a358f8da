"""Deprecated: moved to :mod:`jlens_core.evaluation.labelled_items` (set-level evaluation has its own subpackage); this
path warns once and goes in jlens 0.3.0 (tests/test_layout.py fails when the version reaches it)."""

from .._deprecated import moved_module

__getattr__, __dir__ = moved_module(__name__, "jlens_core.evaluation.labelled_items", removed_in="0.3.0")
