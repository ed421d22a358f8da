"""Edits on the J-space split (docs/method.md §11.5): swap a concept along its J or non-J part, clamp J
coordinates to their clean values, ablate the J-space component. Same protocol as :class:`Steer`, :class:`Ablate`
and :class:`Swap` (``layers``, ``selects()``, ``apply()``, ``needs_clean``; ``generate(..., edits=[...])`` and
``read_prompt(..., edits=[...])``); each is the identity at strength 0 (the run is bit-identical to the clean one)
and has a random control (``random=True``).

* :class:`VectorSwap`: ``h <- h + s (part(B) - part(A))`` at every band layer and selected position, ``A`` and ``B``
  concept vectors per layer (:func:`~jlens_core.jspace.concepts.concept_vectors`), ``part`` the full vector, its J
  part or its non-J part (:func:`~jlens_core.jspace.decompose.split`). ``magnitude="norm_matched"`` rescales the
  part difference to the norm of the full difference; ``random=True`` replaces it by a seeded random direction of
  the same norm.
* :class:`ClampJ`: with ``V`` the unit read directions of the named tokens and ``V⁺`` its pseudo-inverse (as
  :class:`Swap`'s basis), ``h <- h + V (V⁺ h_clean - V⁺ h)``: their J coordinates held at the clean run's values.
  Placed after another edit in the list, it undoes that edit's movement along those directions.
* :class:`AblateJSpace`: ``h <- h - s x_J(h)``, ``x_J`` the top-``k`` J-space component of each selected position
  (:func:`~jlens_core.jspace.decompose.decompose`); ``random=True`` removes instead the fit of a random dictionary
  of the same size (the span of ``k`` random atoms), rescaled to the norm of ``x_J`` row by row.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import torch
from jaxtyping import Float

from .._keywords import checked_options, options_value
from ..jspace.decompose import DEFAULT_K, check_k, jspace_pursuit, random_pursuit, split
from ..jspace.dictionary import check_gauge, jspace
from ..jspace.pursuit import check_method
from ..lenses.protocol import Lens
from ..models.model import LensModel
from ..reading.tokens import token_id
from ..seeds import generator, unit_directions
from .lens_edits import MAX_STRENGTH, _LensEdit
from .read_directions import token_directions

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

PARTS = ("full", "j", "non_j")
MAGNITUDES = ("natural", "norm_matched")


@dataclass(frozen=True)
class SplitOptions:
    """How a J-space edit splits a vector and what its random control draws: one value, or its fields given one by
    one as keywords (:class:`SplitKeywords`; a keyword wins).

    Attributes:
        k, gauge, method: the J-space split (:func:`~jlens_core.jspace.decompose.split`; ``k`` atoms, the gauge
            ``"centred"`` or ``"raw"``, the pursuit ``method``).
        random: the edit's random control in place of the J-space (each edit's Args say what it draws).
        seed: the random control's seed (:mod:`jlens_core.seeds`).
    """

    k: int = DEFAULT_K
    gauge: str = "centred"
    method: str = "gradient_pursuit"
    random: bool = False
    seed: int = 0


class SplitKeywords(TypedDict, total=False):
    """:class:`SplitOptions`'s fields given one by one (the older spelling, kept)."""

    k: int
    gauge: str
    method: str
    random: bool
    seed: int


class VectorSwapKeywords(SplitKeywords, total=False):
    """:class:`VectorSwap`'s further keywords: :class:`SplitKeywords`, ``magnitude`` and ``on_generated``."""

    magnitude: str
    on_generated: bool


def _check_strength(strength: float) -> float:
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not math.isfinite(strength) \
            or abs(strength) > MAX_STRENGTH:
        raise ValueError(f"Strength {strength!r} is out of range: give a number in [-{MAX_STRENGTH:g}, "
                         f"{MAX_STRENGTH:g}] (1 = the whole difference or component).")
    return float(strength)


class VectorSwap(_LensEdit):
    """Swap concept ``A`` (``source``) for ``B`` (``replacement``) along the full vector, its J part or its non-J part
    (module docstring).

    Args:
        model, lens: the model and the lens whose J-space splits the vectors.
        source, replacement: ``{layer: vector [d_model]}`` (concept vectors); every band layer needs both.
        part: ``"full"``, ``"j"`` or ``"non_j"``.
        strength: ``s`` in [-4, 4] (0: the identity; 1: ``A``'s part replaced by ``B``'s).
        magnitude: ``"natural"`` (the part difference as it is) or ``"norm_matched"`` (rescaled to the norm of the full
            difference ``B - A``).
        layers: band layers (default: the layers both dicts have).
        positions, on_generated: the position rule (:mod:`jlens_core.interventions.lens_edits`).
        split_options: the :class:`SplitOptions` (default ``SplitOptions()``); its fields may be given one by one:
        k, gauge, method: the J-space split (:func:`~jlens_core.jspace.decompose.split`).
        random: replace each layer's difference by a seeded random direction of the same norm (the control).
        seed: the random direction's seed.

    Attributes:
        deltas: ``{layer: the difference added at strength 1 [d_model]}``.
        j_shares: ``{layer: (A's J share, B's J share)}`` (NaN for ``part="full"``).

    Raises:
        ValueError: an unknown part or magnitude, a strength out of range, a layer missing from either dict or outside
            the lens, a zero vector, or a zero part difference that cannot be norm-matched.
        TypeError: a keyword that is not one of :class:`VectorSwapKeywords`.
    """

    def __init__(self, model: LensModel, lens: Lens, source: dict[int, Float[torch.Tensor, " d_model"]],
                 replacement: dict[int, Float[torch.Tensor, " d_model"]], split_options: SplitOptions | None = None, *,
                 part: str = "full", strength: float = 1.0, layers: Iterable[int] | None = None,
                 positions: Iterable[int] | None = None, **options: Unpack[VectorSwapKeywords]) -> None:
        own = checked_options("VectorSwap", options, VectorSwapKeywords)
        magnitude: str = own.pop("magnitude", "natural")
        on_generated: bool = own.pop("on_generated", False)
        o = options_value("VectorSwap", split_options, SplitOptions, own, SplitKeywords)
        k, gauge, method, random, seed = o.k, o.gauge, o.method, o.random, o.seed
        if part not in PARTS:
            raise ValueError(f"part={part!r} is not a part: use 'full', 'j' or 'non_j'.")
        if magnitude not in MAGNITUDES:
            raise ValueError(f"magnitude={magnitude!r} is not a magnitude: use 'natural' or 'norm_matched'.")
        self.strength = _check_strength(strength)
        check_gauge(gauge)
        check_method(method)
        if layers is None:
            layers = sorted(set(source) & set(replacement))
            if not layers:
                raise ValueError("source and replacement share no layer: give vectors for the same layers.")
        super().__init__(model, lens, layers, positions, on_generated)
        self.part, self.magnitude, self.random, self.gauge = part, magnitude, bool(random), gauge
        self.deltas: dict[int, torch.Tensor] = {}
        self.j_shares: dict[int, tuple[float, float]] = {}
        d = int(model.d_model)
        for layer in self.layers:
            missing = [name for name, vecs in (("source", source), ("replacement", replacement)) if layer not in vecs]
            if missing:
                raise ValueError(f"{missing[0]} has no vector for layer {layer}: give one per band layer.")
            a = source[layer].detach().float().cpu().reshape(-1)
            b = replacement[layer].detach().float().cpu().reshape(-1)
            full = b - a
            if part == "full":
                delta = full
                self.j_shares[layer] = (math.nan, math.nan)
            else:
                sa = split(model, lens, a, layer, k=k, gauge=gauge, method=method, controls=False)
                sb = split(model, lens, b, layer, k=k, gauge=gauge, method=method, controls=False)
                self.j_shares[layer] = (sa.j_share, sb.j_share)
                delta = sb.j_part - sa.j_part if part == "j" else sb.non_j_part - sa.non_j_part
            if magnitude == "norm_matched" and part != "full":
                norm = float(delta.norm())
                if norm == 0.0:
                    raise ValueError(f"The {part} parts of the two vectors are equal at layer {layer}: there is no "
                                     "difference to norm-match.")
                delta = delta * (float(full.norm()) / norm)
            if self.random:
                delta = unit_directions(1, d, generator(seed, layer))[0] * float(delta.norm())
            self.deltas[layer] = delta

    def apply(self, layer: int, h: Float[torch.Tensor, "rows d_model"],
              clean: Float[torch.Tensor, "rows d_model"] | None) -> Float[torch.Tensor, "rows d_model"]:
        if self.strength == 0.0:
            return h
        return h.float() + self.strength * self.deltas[layer].to(h.device)

    def __repr__(self) -> str:
        what = "random" if self.random else self.part
        return f"VectorSwap({what}, strength={self.strength:g}, {self.magnitude}, {self._where()})"


class ClampJ(_LensEdit):
    """Hold the J coordinates of ``tokens`` at their clean-pass values (module docstring).

    Args:
        model, lens: the lens whose read directions span the clamped coordinates.
        tokens: vocabulary tokens (text or ids; e.g. a decomposition's ``token_ids``, ``-1`` entries ignored).
        layers, positions, on_generated: the band and the position rule.
        gauge: ``"centred"`` (unit centred read directions, the J-space's default gauge) or ``"raw"``.
        random: clamp as many seeded random unit directions instead (the control).
        seed: their seed.

    Raises:
        ValueError: no token, a token that is not one vocabulary token, a layer outside the lens.
    """

    needs_clean = True

    def __init__(self, model: LensModel, lens: Lens, tokens: Sequence[str | int], *,
                 layers: Iterable[int] | None = None, positions: Iterable[int] | None = None,
                 on_generated: bool = False, gauge: str = "centred", random: bool = False, seed: int = 0) -> None:
        check_gauge(gauge)
        super().__init__(model, lens, layers, positions, on_generated)
        items = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        flat = [t for t in _flatten(items) if not (isinstance(t, int) and t == -1)]
        ids = list(dict.fromkeys(token_id(model.tokenizer, t, rule="word", vocab_size=model.vocab_size)
                                 for t in flat))
        if not ids:
            raise ValueError("ClampJ has no token to clamp: give at least one.")
        self.token_ids = ids
        self.tokens = [model.decode([t]) for t in ids]
        self.gauge, self.random = gauge, bool(random)
        self.bases: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer: (V [d, m], V⁺ [m, d])
        for layer in self.layers:
            if self.random:
                v = unit_directions(len(ids), int(model.d_model), generator(seed, layer))
            else:
                v = token_directions(model, lens, layer, ids, centred=gauge == "centred")
            basis = v.T.double()
            self.bases[layer] = (basis.float(), torch.linalg.pinv(basis).float())

    def coordinates(self, layer: int, h: Float[torch.Tensor, "rows d_model"]) -> Float[torch.Tensor, "rows m"]:
        """``V⁺ h``: the clamped coordinates ``[n, m]`` of residuals ``h [n, d]`` at ``layer``."""
        return h.float() @ self.bases[layer][1].to(h.device).T

    def apply(self, layer: int, h: Float[torch.Tensor, "rows d_model"],
              clean: Float[torch.Tensor, "rows d_model"] | None) -> Float[torch.Tensor, "rows d_model"]:
        if clean is None:
            raise ValueError("ClampJ needs the clean residuals (it is a needs_clean edit).")
        basis, pinv = (x.to(h.device) for x in self.bases[layer])
        hf = h.float()
        return hf + (clean.float() @ pinv.T - hf @ pinv.T) @ basis.T

    def __repr__(self) -> str:
        what = f"{len(self.token_ids)} random directions" if self.random else ", ".join(map(repr, self.tokens[:5]))
        return f"ClampJ({what}, {self._where(self.gauge == 'centred', self.random)})"


def _flatten(items: list) -> list:
    out: list = []
    for item in items:
        out.extend(_flatten(item) if isinstance(item, list) else [item])
    return out


class AblateJSpace(_LensEdit):
    """Remove ``strength`` times the top-``k`` J-space component of every selected position (module docstring).

    Args:
        model, lens: the lens whose J-space is ablated.
        split_options: the :class:`SplitOptions` (default ``SplitOptions()``); its fields may be given one by one:
        k, gauge, method: the decomposition (:func:`~jlens_core.jspace.decompose.decompose`).
        strength: ``s`` in [-4, 4] (0: the identity; 1: the component removed).
        random: remove the fit of a seeded random dictionary of the same size instead, rescaled per row to the norm of
            the J component (the control).
        seed: the random dictionary's seed.
        layers, positions, on_generated: the band and the position rule.

    Attributes:
        removed_norms: ``{layer: ||removed|| [n]}`` of the last call at each layer (for reports).
    """

    def __init__(self, model: LensModel, lens: Lens, split_options: SplitOptions | None = None, *,
                 strength: float = 1.0, layers: Iterable[int] | None = None, positions: Iterable[int] | None = None,
                 on_generated: bool = False, **options: Unpack[SplitKeywords]) -> None:
        o = options_value("AblateJSpace", split_options, SplitOptions, options, SplitKeywords)
        k, gauge, method, random, seed = o.k, o.gauge, o.method, o.random, o.seed
        self.strength = _check_strength(strength)
        check_gauge(gauge)
        check_method(method)
        super().__init__(model, lens, layers, positions, on_generated)
        self.spaces = {layer: jspace(model, lens, layer, gauge=gauge) for layer in self.layers}
        self.k = check_k(k, min(int(model.d_model), self.spaces[self.layers[0]].n_atoms))
        self.gauge, self.method, self.random, self.seed = gauge, method, bool(random), int(seed)
        self.removed_norms: dict[int, torch.Tensor] = {}

    def removed(self, layer: int, h: Float[torch.Tensor, "rows d_model"]) -> Float[torch.Tensor, "rows d_model"]:
        """What :meth:`apply` subtracts at strength 1 from rows ``h [n, d]`` (fp32, CPU)."""
        space = self.spaces[layer]
        rows = h.detach().float().cpu()
        fit = jspace_pursuit(space, rows, self.k, self.method).fitted
        if self.random:
            other = random_pursuit(rows, self.k, space.n_atoms, self.seed, self.method).fitted
            scale = fit.norm(dim=-1, keepdim=True) / other.norm(dim=-1, keepdim=True).clamp_min(1e-300)
            fit = other * torch.where(other.norm(dim=-1, keepdim=True) > 0, scale, 0.0)
        return fit.float()

    def apply(self, layer: int, h: Float[torch.Tensor, "rows d_model"],
              clean: Float[torch.Tensor, "rows d_model"] | None) -> Float[torch.Tensor, "rows d_model"]:
        if self.strength == 0.0:
            return h
        gone = self.removed(layer, h)
        self.removed_norms[layer] = gone.norm(dim=-1)
        return h.float() - self.strength * gone.to(h.device)

    def __repr__(self) -> str:
        what = "random" if self.random else f"k={self.k}"
        return f"AblateJSpace({what}, strength={self.strength:g}, {self._where(self.gauge == 'centred', self.random)})"


__all__ = ["MAGNITUDES", "PARTS", "AblateJSpace", "ClampJ", "SplitKeywords", "SplitOptions", "VectorSwap", "VectorSwapKeywords"]
