"""Kept for old imports: a lens's read directions now live in :mod:`jlens_core.interventions.read_directions`."""

from .read_directions import (
    check_layers,
    default_layers,
    head_row,
    last_source_layer,
    mean_head_row,
    mean_read_vector,
    norm_gain,
    read_vector,
    read_vector_norms,
    token_direction,
    token_directions,
)

__all__ = ["check_layers", "default_layers", "head_row", "last_source_layer", "mean_head_row", "mean_read_vector",
           "norm_gain", "read_vector", "read_vector_norms", "token_direction", "token_directions"]
