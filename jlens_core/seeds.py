"""The one seeded random scheme: a seed and the keys of a draw (an item, a layer, a token) folded into one seed,
its generator, and the unit Gaussian directions every random control draws (docs/method.md §7).

Every seeded generator in ``jlens_core`` comes from :func:`generator` (``tests/test_seeds.py`` checks that
``manual_seed(`` appears nowhere else), and every random direction from :func:`unit_directions`: the swap's
floor control, make-it-say's random arm, the J-space edits' random twins, the decomposition's random
dictionary, the introspection experiment's random injections. A draw is named by its keys, not by the order it
happens to be made in, so adding an item or a layer does not move the other draws.
"""

from __future__ import annotations

import operator

import torch

SEED_STRIDE = 1_000_003  # a prime: (seed, key) pairs stay distinct for keys below it
SEED_MODULUS = 2**63  # torch's generator takes seeds below 2**64; a nonnegative int64 everywhere


def derive_seed(seed: int, *keys: int) -> int:
    """``seed`` with ``keys`` folded in, one at a time: ``s -> (s * 1_000_003 + key) mod 2**63``; ``seed mod 2**63``
    without keys (so a plain seed draws what ``torch.Generator().manual_seed(seed)`` draws).

    Raises:
        TypeError: a seed or key that is not an integer.
    """
    out = _integer(seed, "seed") % SEED_MODULUS
    for key in keys:
        out = (out * SEED_STRIDE + _integer(key, "key")) % SEED_MODULUS
    return out


def generator(seed: int, *keys: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with :func:`derive_seed` of ``seed`` and ``keys``."""
    return torch.Generator().manual_seed(derive_seed(seed, *keys))


def unit_directions(n: int, d_model: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` Gaussian directions ``[n, d_model]`` fp32 drawn from ``gen`` (one ``randn(n, d_model)``), each scaled to
    unit length: norm-matched stand-ins for unit read directions (every edit uses unit vectors, so a random edit
    has the same size).

    Raises:
        ValueError: ``n < 1`` or ``d_model < 1``.
    """
    if int(n) < 1 or int(d_model) < 1:
        raise ValueError(f"Cannot draw {n} directions of size {d_model}: give n >= 1 and d_model >= 1.")
    draws = torch.randn(int(n), int(d_model), generator=gen)
    return draws / draws.norm(dim=-1, keepdim=True)


def _integer(value: object, what: str) -> int:
    if not isinstance(value, bool):
        try:
            return operator.index(value)  # type: ignore[arg-type]  # ints and numpy's integers
        except TypeError:
            pass
    raise TypeError(f"The {what} {value!r} is not an integer: seeds and keys are ints.")


__all__ = ["SEED_MODULUS", "SEED_STRIDE", "derive_seed", "generator", "unit_directions"]
