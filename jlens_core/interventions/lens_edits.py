"""Steer, ablate and swap along a lens's read directions (docs/method.md §7): residual edits for
``generate(..., edits=[...])`` and ``read_prompt(..., edits=[...])``.

Each edit acts on the outputs of its decoder ``layers`` at the positions its
:class:`~jlens_core.reading.edit_hooks.PositionRule` selects (default: every prompt position but the
first, an attention sink; generated tokens only with ``on_generated=True``), with ``v̂_t`` the unit
read direction of token ``t`` at that layer (:func:`~jlens_core.interventions.read_directions.token_direction`;
with ``centred=True`` the unit vector of ``v_t - m_l``, ``m_l`` the mean read direction over the vocabulary,
docs/method.md §9.1):

* :class:`Steer` ``t``, strength ``s`` in [-4, 4]: ``h <- h + s ||h|| v̂_t`` per position;
* :class:`Ablate` ``t``: ``h <- h - (h . v̂_t) v̂_t``;
* :class:`Swap` ``A -> B``, scale ``alpha``: with ``V = [v̂_A v̂_B]`` and ``V⁺`` its pseudo-inverse, the
  clean coordinates ``c = V⁺ h_clean`` come from an unedited forward over the same tokens, the target
  is ``c* = c + alpha (swap(c) - c)`` (the two coordinates exchanged at ``alpha = 1``), and at every
  edited layer ``h <- h + V (c* - V⁺ h)``. Taking the targets from the clean run keeps a later layer
  from undoing the swap. This is the swap of the Jacobian-lens paper's causal test (the clamp of the
  two read coordinates to their exchanged clean values). A layer where ``|cos(v_A, v_B)| > 0.999``
  is skipped (``V`` is nearly singular there) and listed in ``skipped_layers``.

``strength=0`` and ``alpha=0`` are the identity: the run is bit-identical to the clean one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
from jaxtyping import Bool, Float, Int

from ..lenses.kinds import is_baseline
from ..lenses.lens import LogitLens
from ..lenses.protocol import Lens
from ..models.model import LensModel
from ..reading.edit_hooks import PositionRule
from ..reading.tokens import token_id
from ..seeds import generator, unit_directions
from .read_directions import check_layers, default_layers, token_direction

MAX_STRENGTH = 4.0
MAX_ALPHA = 16.0
COLLINEAR_COS = 0.999


def _rule(positions: Iterable[int] | None, on_generated: bool) -> PositionRule:
    if positions is not None:
        positions = tuple(sorted({int(p) for p in positions}))
        if not positions:
            raise ValueError("positions is empty: give at least one position, or None for every prompt "
                             "position but the first.")
        if positions[0] < 0:
            raise ValueError(f"Position {positions[0]} is negative: positions are absolute token indices.")
    return PositionRule(positions, bool(on_generated))


class _LensEdit:
    """What the three edits share: the model, the lens, the layers and the position rule."""

    needs_clean = False

    def __init__(self, model: LensModel, lens: Lens, layers: Iterable[int] | None, positions: Iterable[int] | None,
                 on_generated: bool) -> None:
        self.lens_kind = str(lens.kind)
        self.layers: list[int] = check_layers(model, lens, default_layers(model, lens) if layers is None else layers)
        self.rule = _rule(positions, on_generated)

    def selects(self, positions: Int[torch.Tensor, " seq"], n_prompt: int) -> Bool[torch.Tensor, " seq"]:
        return self.rule.selects(positions, n_prompt)

    def _where(self, centred: bool = False, random: bool = False) -> str:
        span = f"{self.layers[0]}..{self.layers[-1]}" if len(self.layers) > 1 else str(self.layers[0])
        if random:  # the lens only chose the layers: the directions are the caller's (a random control)
            return f"layers {span}, given directions"
        return f"layers {span}, {self.lens_kind} lens" + (", centred directions" if centred else "")


def _unit_directions(model: LensModel, lens: Lens, layers: Sequence[int], tid: int, centred: bool,
                     given: dict[int, torch.Tensor] | None) -> dict[int, torch.Tensor]:
    """``{layer: unit direction [d_model] fp32}``: the lens's read direction of ``tid``, or ``given``'s (normalised).

    Raises:
        ValueError: ``given`` lacks one of ``layers``, or holds a zero vector there.
    """
    if given is None:
        return {layer: token_direction(model, lens, layer, tid, centred=centred) for layer in layers}
    out = {}
    for layer in layers:
        if layer not in given:
            raise ValueError(f"directions has no vector for layer {layer}: give one per edited layer.")
        v = given[layer].detach().float().cpu().reshape(-1)
        norm = float(v.norm())
        if not math.isfinite(norm) or norm == 0.0:
            raise ValueError(f"The direction given for layer {layer} is zero: give a non-zero vector.")
        out[layer] = v / norm
    return out


class Steer(_LensEdit):
    """``h <- h + s ||h|| v̂_t``: push the residual toward what the lens reads as ``token``.

    ``directions={layer: v}`` replaces ``v̂_t`` by the given vectors (normalised; the random-direction control of
    :func:`~jlens_core.interventions.say.make_it_say`); the lens then only checks the layers.

    Raises:
        ValueError: a strength outside [-4, 4], a token that is not one vocabulary token, a layer
            outside the lens.
    """

    def __init__(self, model: LensModel, lens: Lens, token: str | int, strength: float, *,
                 layers: Iterable[int] | None = None, positions: Iterable[int] | None = None,
                 on_generated: bool = False, centred: bool = False,
                 directions: dict[int, Float[torch.Tensor, " d_model"]] | None = None) -> None:
        if not isinstance(strength, (int, float)) or not math.isfinite(strength) or abs(strength) > MAX_STRENGTH:
            raise ValueError(f"Steering strength {strength!r} is out of range: give a number in "
                             f"[-{MAX_STRENGTH:g}, {MAX_STRENGTH:g}] (multiples of the residual's norm).")
        super().__init__(model, lens, layers, positions, on_generated)
        self.token_id = token_id(model.tokenizer, token, rule="word", vocab_size=model.vocab_size)
        self.token = model.decode([self.token_id])
        self.strength = float(strength)
        self.centred = bool(centred) and directions is None
        self.random = directions is not None
        self.directions = _unit_directions(model, lens, self.layers, self.token_id, self.centred, directions)

    def apply(self, layer: int, h: Float[torch.Tensor, "rows d_model"],
              clean: Float[torch.Tensor, "rows d_model"] | None) -> Float[torch.Tensor, "rows d_model"]:
        if self.strength == 0.0:
            return h
        v = self.directions[layer].to(device=h.device, dtype=torch.float32)  # [d]
        hf = h.float()  # [n, d]
        return hf + self.strength * hf.norm(dim=-1, keepdim=True) * v

    def __repr__(self) -> str:
        return f"Steer({self.token!r}, strength={self.strength:g}, {self._where(self.centred, self.random)})"


class Ablate(_LensEdit):
    """``h <- h - (h . v̂_t) v̂_t``: remove what the lens reads as ``token`` (``directions={layer: v}``: along the
    given vectors instead, normalised, as :class:`Steer`)."""

    def __init__(self, model: LensModel, lens: Lens, token: str | int, *, layers: Iterable[int] | None = None,
                 positions: Iterable[int] | None = None, on_generated: bool = False, centred: bool = False,
                 directions: dict[int, Float[torch.Tensor, " d_model"]] | None = None) -> None:
        super().__init__(model, lens, layers, positions, on_generated)
        self.token_id = token_id(model.tokenizer, token, rule="word", vocab_size=model.vocab_size)
        self.token = model.decode([self.token_id])
        self.centred = bool(centred) and directions is None
        self.random = directions is not None
        self.directions = _unit_directions(model, lens, self.layers, self.token_id, self.centred, directions)

    def apply(self, layer: int, h: Float[torch.Tensor, "rows d_model"],
              clean: Float[torch.Tensor, "rows d_model"] | None) -> Float[torch.Tensor, "rows d_model"]:
        v = self.directions[layer].to(device=h.device, dtype=torch.float32)  # [d]
        hf = h.float()  # [n, d]
        return hf - (hf @ v)[:, None] * v

    def __repr__(self) -> str:
        return f"Ablate({self.token!r}, {self._where(self.centred, self.random)})"


class Swap(_LensEdit):
    """Exchange the read coordinates of ``source`` and ``replacement`` (scaled by ``alpha``).

    Args:
        model, lens: the model and the lens whose read directions define the swap.
        source, replacement: the tokens ``A`` and ``B`` (one vocabulary token each, not the same).
        alpha: 0 = no change, 1 = the two coordinates exchanged, more = pushed beyond (0..16).
        layers: decoder layers to edit (default: ``n_layers // 3`` to the lens's last source layer).
        positions, on_generated: the position rule (see the module docstring).
        directions: ``{layer: (v_A, v_B)}`` to use instead of the lens's (the random-direction control).
        centred: use the centred read directions (:func:`token_direction` ``centred=True``; ignored with
            ``directions``).

    Attributes:
        skipped_layers: layers left alone because ``|cos(v_A, v_B)| > 0.999`` there.
    """

    needs_clean = True

    def __init__(self, model: LensModel, lens: Lens, source: str | int, replacement: str | int, alpha: float = 1.0, *,
                 layers: Iterable[int] | None = None, positions: Iterable[int] | None = None,
                 on_generated: bool = False,
                 directions: dict[int, tuple[Float[torch.Tensor, " d_model"],
                                             Float[torch.Tensor, " d_model"]]] | None = None,
                 centred: bool = False) -> None:
        if not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or not 0 <= alpha <= MAX_ALPHA:
            raise ValueError(f"Swap scale alpha={alpha!r} is out of range: give a number in [0, {MAX_ALPHA:g}] "
                             "(1 exchanges the two coordinates).")
        super().__init__(model, lens, layers, positions, on_generated)
        a = token_id(model.tokenizer, source, rule="word", vocab_size=model.vocab_size)
        b = token_id(model.tokenizer, replacement, rule="word", vocab_size=model.vocab_size)
        if a == b:
            raise ValueError(f"Cannot swap {source!r} with itself: give two different tokens.")
        self.source_id, self.replacement_id = a, b
        self.source, self.replacement, self.alpha = model.decode([a]), model.decode([b]), float(alpha)
        self.centred = bool(centred) and directions is None
        self.random = directions is not None
        self.bases: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer: (V [d, 2], V⁺ [2, d])
        self.skipped_layers: list[int] = []
        for layer in self.layers:
            if directions is not None:
                va, vb = (x.float() / x.float().norm() for x in directions[layer])
            else:
                va, vb = (token_direction(model, lens, layer, t, centred=self.centred) for t in (a, b))
            pair = swap_basis(va, vb)
            if pair is None:
                self.skipped_layers.append(layer)
            else:
                self.bases[layer] = pair

    def apply(self, layer: int, h: Float[torch.Tensor, "rows d_model"],
              clean: Float[torch.Tensor, "rows d_model"] | None) -> Float[torch.Tensor, "rows d_model"]:
        if self.alpha == 0.0 or layer not in self.bases:
            return h
        if clean is None:
            raise ValueError("Swap needs the clean residuals (it is a needs_clean edit).")
        basis, pinv = (x.to(h.device) for x in self.bases[layer])
        c = clean.float() @ pinv.T  # [n, 2] clean coordinates
        target = c + self.alpha * swap_step(c)  # [n, 2]
        hf = h.float()
        return hf + (target - hf @ pinv.T) @ basis.T

    def coordinates(self, layer: int,
                    h: Float[torch.Tensor, "*batch d_model"]) -> Float[torch.Tensor, "*batch 2"]:
        """``V⁺ h``: the read coordinates ``[n, 2]`` (``A``, ``B``) of residuals ``h [n, d]`` at ``layer``."""
        _, pinv = self.bases[layer]
        return h.float() @ pinv.to(h.device).T

    def __repr__(self) -> str:
        return f"Swap({self.source!r} -> {self.replacement!r}, alpha={self.alpha:g}, {self._where(self.centred, self.random)})"


def swap_basis(va: Float[torch.Tensor, " d_model"],
               vb: Float[torch.Tensor, " d_model"]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The swap's basis of two unit directions: ``(V [d, 2], V⁺ [2, d])`` fp32, ``V = [va vb]`` and its
    pseudo-inverse taken in float64; ``None`` where ``|cos(va, vb)| > COLLINEAR_COS`` (``V`` nearly singular: the
    layer is skipped). :class:`Swap` edits with it and make-it-say's first-order ranking predicts with it, so
    the prediction and the replay cannot drift apart."""
    if abs(float(va @ vb)) > COLLINEAR_COS:
        return None
    basis = torch.stack([va, vb], dim=1).double()  # [d, 2]
    return basis.float(), torch.linalg.pinv(basis).float()


def swap_step(c: Float[torch.Tensor, "*batch 2"]) -> Float[torch.Tensor, "*batch 2"]:
    """``swap(c) - c``: the move of read coordinates ``c [..., 2]`` that exchanges them (``alpha = 1``)."""
    return c.flip(-1) - c


def with_logit_control(model: LensModel, lenses: Mapping[str, Lens]) -> dict[str, Lens]:
    """``lenses`` as a new dict, with the logit lens added as ``"logit"`` (last) when none of them is one: the
    control every success run (swap, make-it-say) compares a lens with."""
    out = dict(lenses)
    if not any(is_baseline(lens) for lens in out.values()):
        out["logit"] = LogitLens.for_model(model)
    return out


# -- the seeded random directions (the controls of the swap and of make-it-say) ------------------------------
def random_directions(layers: Sequence[int], d_model: int,
                      seed: int) -> dict[int, tuple[Float[torch.Tensor, " d_model"],
                                                    Float[torch.Tensor, " d_model"]]]:
    """Two random unit directions per layer (:func:`jlens_core.seeds.unit_directions` from the generator of
    ``(seed, layer)``): the swap's floor control."""
    out = {}
    for layer in layers:
        pair = unit_directions(2, d_model, generator(seed, int(layer)))
        out[int(layer)] = (pair[0], pair[1])
    return out


__all__ = ["COLLINEAR_COS", "MAX_ALPHA", "MAX_STRENGTH", "Ablate", "Steer", "Swap", "random_directions", "swap_basis",
           "swap_step", "with_logit_control"]
