"""Read directions: the residual direction a lens reads as a given token (docs/method.md §7).

The lens's logit of token ``t`` at layer ``l``, before the final norm's scale, is
``u_t . P (gamma * C (M_l h))`` (+ biases that do not depend on ``h``): ``M_l`` the lens's transport
(``J_l`` for the Jacobian lens, ``I`` for the logit lens, ``I + A_l`` for a tuned lens), ``C`` the
mean-centring of a LayerNorm (the identity for RMSNorm families), ``gamma`` the final norm's gain,
``P`` any linear map between the norm and the head (OPT's ``project_out``) and ``u_t`` the
output-head row. Its gradient with respect to ``h`` is the read direction

    v_t = M_l^T C (gamma * P^T u_t)

and :func:`token_direction` returns it unit-normalised (``v̂_t``). Nothing here is model-specific:
``P^T u_t`` is the gradient of the head through the pre-head modules (linear, so exact), the gain
comes from the norm itself (a probe with the all-ones vector, so ``1 + w`` gains such as Gemma's are
right), and ``M_l^T`` is the vector-Jacobian product of the lens's ``transport`` (linear in ``h``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from ..layerspec import normalise_layers
from ..lenses.protocol import Lens
from ..models.model import LensModel
from ..reading.tokens import token_id


def _is_layer_norm(norm: nn.Module) -> bool:
    """A norm that subtracts the mean (LayerNorm and its variants), as opposed to an RMS norm."""
    if isinstance(norm, nn.LayerNorm):
        return True
    name = type(norm).__name__.lower()
    return "layernorm" in name and "rms" not in name


def norm_gain(model: LensModel) -> tuple[torch.Tensor, bool]:
    """``(gamma [d_model] fp32, centres)``: the final norm's per-dimension gain and whether it
    mean-centres (LayerNorm). No final norm: all ones, no centring.

    The gain of an RMS norm is probed: ``norm(1) * sqrt(1 + eps)`` (the all-ones vector has RMS 1),
    which covers gains stored as ``w`` and as ``1 + w``.
    """
    d = int(model.d_model)
    norm = model.final_norm
    if norm is None:
        return torch.ones(d), False
    if _is_layer_norm(norm):
        weight = getattr(norm, "weight", None)
        return (weight.detach().float().cpu().clone() if weight is not None else torch.ones(d)), True
    eps = next((float(getattr(norm, a)) for a in ("variance_epsilon", "eps", "epsilon") if
                isinstance(getattr(norm, a, None), (int, float))), 0.0)
    param = next(norm.parameters(), None)
    device = param.device if param is not None else model.device
    dtype = param.dtype if param is not None else torch.float32
    with torch.no_grad():
        out = norm(torch.ones(1, d, device=device, dtype=dtype)).float().cpu()[0]
    return out * math.sqrt(1.0 + eps), False


def head_row(model: LensModel, token_id: int) -> torch.Tensor:
    """``P^T u_t`` ``[d_model]`` fp32: the gradient of token ``t``'s logit with respect to the final
    norm's output, through any pre-head modules and the head (all linear)."""
    head_param = next(model.head.parameters())
    z = torch.zeros(1, model.d_model, device=head_param.device, dtype=torch.float32, requires_grad=True)
    with torch.enable_grad():
        x = z.to(head_param.dtype)
        for module in model.pre_head:
            x = module(x)
        logit = model.head(x)[0, int(token_id)].float()
        (grad,) = torch.autograd.grad(logit, z)
    return grad[0].detach().cpu()


def last_source_layer(lens: Lens) -> int:
    """The highest layer the lens reads below its target (its transport is not the identity there)."""
    layers = lens.source_layers
    if not layers:
        raise ValueError("The lens reads no layer below its target layer.")
    return max(layers)


def default_layers(model: LensModel, lens: Lens) -> list[int]:
    """The middle band: from ``n_layers // 3`` to the lens's last source layer (that it reads)."""
    top = last_source_layer(lens)
    readable = set(lens.layers)
    band = [x for x in range(model.n_layers // 3, top + 1) if x in readable]
    return band or [top]


def check_layers(model: LensModel, lens: Lens, layers: Iterable[int]) -> list[int]:
    """Layers normalised (:func:`~jlens_core.layerspec.normalise_layers`: negatives count from the end,
    sorted, de-duplicated); each must be a source layer the lens reads.

    Raises:
        ValueError: a layer outside the model or the lens (names it and the lens's layers), or no layers.
    """
    chosen = normalise_layers(layers, int(model.n_layers))
    readable = [x for x in lens.layers if x != lens.target_layer]
    for layer in chosen:
        if layer not in readable:
            span = f"{readable[0]}..{readable[-1]}" if readable == list(range(readable[0], readable[-1] + 1)) \
                else str(readable)
            raise ValueError(f"Layer {layer} is outside the lens: it reads layers {span} (below its target "
                             f"layer {lens.target_layer}).")
    return chosen


def read_vector(model: LensModel, lens: Lens, layer: int, token_id: int) -> torch.Tensor:
    """``v_t = M_l^T C (gamma * P^T u_t)`` ``[d_model]`` fp32 (not normalised)."""
    gamma, centres = norm_gain(model)
    r = gamma * head_row(model, token_id)  # [d]
    if centres:
        r = r - r.mean()
    h = torch.zeros(model.d_model, dtype=torch.float32)
    # torch types vjp's result as a 3-tuple (the has_aux form); without has_aux it is (output, vjp_fn)
    _, vjp = torch.func.vjp(lambda x: lens.transport(x, int(layer)), h)  # type: ignore[misc]
    (v,) = vjp(r)
    return v.detach().float()


def token_direction(model: LensModel, lens: Lens, layer: int, token: str | int) -> torch.Tensor:
    """The unit read direction ``v̂_t`` ``[d_model]`` (fp32, CPU) of ``token`` at ``layer`` under ``lens``.

    Args:
        model: an :class:`~jlens_core.HFLensModel`.
        lens: a :class:`~jlens_core.JacobianLens`, :class:`~jlens_core.LogitLens` or any lens with a
            linear ``transport(h, layer)``.
        layer: a source layer the lens reads.
        token: one vocabulary token: an id, ``"<id:N>"``, a raw entry, or its exact text (``" Paris"``).

    Raises:
        ValueError: a token that is not a single vocabulary token (the message shows its pieces),
            a layer outside the lens, or a direction that vanishes.
    """
    check_layers(model, lens, [layer])
    tid = token_id(model.tokenizer, token, rule="exact", vocab_size=model.vocab_size)
    v = read_vector(model, lens, layer, tid)
    norm = float(v.norm())
    if not math.isfinite(norm) or norm == 0.0:
        raise ValueError(f"The read direction of token {token!r} at layer {layer} is zero.")
    return v / norm


__all__ = ["check_layers", "default_layers", "head_row", "last_source_layer", "norm_gain", "read_vector",
           "token_direction"]
