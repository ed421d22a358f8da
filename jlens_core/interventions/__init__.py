"""Causal tests of what a lens reads (docs/method.md §7): edit the residual stream along a lens's read
directions and see whether the model's output follows.

``read_directions`` (:func:`token_direction`: the unit direction a lens reads as a token), ``lens_edits``
(:class:`Steer`, :class:`Ablate`, :class:`Swap`: residual edits for ``generate`` and
``read_prompt``), ``swap_success`` (the swap experiment over a set of items, with controls),
``intervals`` (Clopper-Pearson and Wilson intervals of its rates).
Imports :mod:`jlens_core.models`, :mod:`jlens_core.lenses`, :mod:`jlens_core.reading` and the leaves.
"""

from .lens_edits import Ablate, Steer, Swap
from .read_directions import token_direction
from .swap_success import SwapReport, load_swap_set, swap_success

__all__ = ["Ablate", "Steer", "Swap", "SwapReport", "load_swap_set", "swap_success", "token_direction"]
