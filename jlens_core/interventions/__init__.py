"""Causal tests of what a lens reads (docs/method.md §7): edit the residual stream along a lens's read
directions and see whether the model's output follows.

``read_directions`` (:func:`token_direction`: the unit direction a lens reads as a token), ``lens_edits``
(:class:`Steer`, :class:`Ablate`, :class:`Swap`: residual edits for ``generate`` and
``read_prompt``), ``swap_success`` (the swap experiment over a set of items, with controls),
``say`` (:func:`make_it_say`: search the edit that makes the model say a word, verified by replay, with
controls; ``say_ranking`` and ``say_replay`` are its two halves), ``say_success`` (that search over a set),
``intervals`` (Clopper-Pearson and Wilson intervals of their rates).
Imports :mod:`jlens_core.models`, :mod:`jlens_core.lenses`, :mod:`jlens_core.reading` and the leaves.
"""

from .lens_edits import Ablate, Steer, Swap
from .read_directions import token_direction
from .say import SayOptions, SayResult, make_it_say
from .say_success import SaySuccessReport, load_say_set, say_success
from .swap_success import SwapOptions, SwapReport, load_swap_set, swap_success

__all__ = ["Ablate", "SayOptions", "SayResult", "SaySuccessReport", "Steer", "Swap", "SwapOptions", "SwapReport",
           "load_say_set", "load_swap_set", "make_it_say", "say_success", "swap_success", "token_direction"]
