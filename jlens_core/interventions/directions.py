"""Kept for old imports: a lens's read directions now live in :mod:`jlens_core.interventions.read_directions`."""

from .read_directions import (
    check_layers,
    default_layers,
    head_row,
    last_source_layer,
    norm_gain,
    read_vector,
    token_direction,
)

__all__ = ["check_layers", "default_layers", "head_row", "last_source_layer", "norm_gain", "read_vector",
           "token_direction"]
