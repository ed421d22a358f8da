"""Kept for old imports: steer, ablate and swap now live in :mod:`jlens_core.interventions.lens_edits`."""

from .lens_edits import MAX_ALPHA, MAX_STRENGTH, Ablate, Steer, Swap, random_directions

__all__ = ["MAX_ALPHA", "MAX_STRENGTH", "Ablate", "Steer", "Swap", "random_directions"]
