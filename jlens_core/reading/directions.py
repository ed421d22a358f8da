"""Kept for old imports: a Jacobian's decoded singular directions now live in
:mod:`jlens_core.reading.singular_directions`."""

from .singular_directions import DIRECTION_COLUMNS, top_directions

__all__ = ["DIRECTION_COLUMNS", "top_directions"]
