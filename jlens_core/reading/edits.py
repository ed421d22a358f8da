"""Kept for old imports: the residual-edit protocol now lives in :mod:`jlens_core.reading.edit_hooks`."""

from .edit_hooks import EditRunner, PositionRule, ResidualEdit, check_edits

__all__ = ["EditRunner", "PositionRule", "ResidualEdit", "check_edits"]
