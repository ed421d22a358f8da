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

Centred directions (docs/method.md §9.1): ``v_t - m_l`` with ``m_l = mean_t v_t`` over the vocabulary
(:func:`mean_read_vector`). Every lens logit then shifts by the same ``h . m_l``, so readings do not
change; edits along the unit vector do. :func:`read_vector_norms` gives ``||v_t||`` (or the centred
norm) for the whole vocabulary at once, for swap success's norm-matched control.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Sequence

import torch
from jaxtyping import Float
from torch import nn

from ..layerspec import normalise_layers
from ..lenses.protocol import Lens
from ..models.model import LensModel
from ..models.placement import execution_device, materialised
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
        with materialised(norm):  # an offloaded gain is a meta tensor until loaded
            weight = getattr(norm, "weight", None)
            return (weight.detach().float().cpu().clone() if weight is not None else torch.ones(d)), True
    eps = next((float(getattr(norm, a)) for a in ("variance_epsilon", "eps", "epsilon") if
                isinstance(getattr(norm, a, None), (int, float))), 0.0)
    param = next(norm.parameters(), None)
    device = execution_device(norm, default=model.device)
    dtype = param.dtype if param is not None else torch.float32
    with torch.no_grad():
        out = norm(torch.ones(1, d, device=device, dtype=dtype)).float().cpu()[0]
    return out * math.sqrt(1.0 + eps), False


def _head_gradient(model: LensModel, token_id: int | None) -> torch.Tensor:
    """The gradient ``[d_model]`` fp32 (CPU), with respect to the final norm's output, of token ``token_id``'s
    logit, or of the mean logit over the vocabulary (``None``), through the pre-head modules and the head."""
    head_param = next(model.head.parameters())
    z = torch.zeros(1, model.d_model, device=execution_device(model.head), dtype=torch.float32, requires_grad=True)
    with torch.enable_grad():
        x = z.to(head_param.dtype)
        for module in model.pre_head:
            x = module(x)
        logits = model.head(x)[0]
        picked = logits[: int(model.vocab_size)].float().mean() if token_id is None else logits[int(token_id)].float()
        (grad,) = torch.autograd.grad(picked, z)
    return grad[0].detach().cpu()


# model -> {token id: head row}; every swap arm asks for the same few rows at every edited layer
_HEAD_ROWS: weakref.WeakKeyDictionary[LensModel, dict[int, torch.Tensor]] = weakref.WeakKeyDictionary()
_HEAD_ROWS_KEPT = 4096  # rows kept per model (16 MiB at d_model 1024); the oldest go first


def head_row(model: LensModel, token_id: int) -> torch.Tensor:
    """``P^T u_t`` ``[d_model]`` fp32: the gradient of token ``t``'s logit with respect to the final
    norm's output, through any pre-head modules and the head (all linear). Cached per model (the
    head is frozen); a model whose head changes in place keeps the old rows."""
    try:
        rows = _HEAD_ROWS.setdefault(model, {})
    except TypeError:  # a model that cannot be weakly referenced is not cached
        return _head_gradient(model, token_id)
    key = int(token_id)
    if key not in rows:
        if len(rows) >= _HEAD_ROWS_KEPT:
            rows.pop(next(iter(rows)))
        rows[key] = _head_gradient(model, key)
    return rows[key].clone()


def mean_head_row(model: LensModel) -> torch.Tensor:
    """``mean_t P^T u_t`` ``[d_model]`` fp32 over the model's vocabulary (``t < model.vocab_size``; padded
    head rows past it are left out): the gradient of the mean logit, since the head is linear."""
    return _head_gradient(model, None)


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


def _pull_back(model: LensModel, lens: Lens, layer: int, row: torch.Tensor) -> torch.Tensor:
    """``M_l^T C (gamma * row)`` ``[d_model]`` (or ``[k, d_model]`` for rows ``[k, d_model]``) fp32: head-side
    vectors carried back to layer ``layer``, all in one vector-Jacobian product."""
    gamma, centres = norm_gain(model)
    r = gamma * row  # [d] or [k, d]
    if centres:
        r = r - r.mean(dim=-1, keepdim=True)
    h = torch.zeros(r.shape, dtype=torch.float32)
    # torch types vjp's result as a 3-tuple (the has_aux form); without has_aux it is (output, vjp_fn)
    _, vjp = torch.func.vjp(lambda x: lens.transport(x, int(layer)), h)  # type: ignore[misc]
    (v,) = vjp(r)
    return v.detach().float()


# lens -> {(id(model), layer): mean read vector}; weak, so a lens that goes away takes its entries along
_MEAN_CACHE: weakref.WeakKeyDictionary[Lens, dict[tuple[int, int], torch.Tensor]] = weakref.WeakKeyDictionary()


def mean_read_vector(model: LensModel, lens: Lens, layer: int) -> torch.Tensor:
    """``m_l = mean_t v_t`` ``[d_model]`` fp32 over the vocabulary (``t < model.vocab_size``): the mean read
    direction at ``layer``, the centre of :func:`token_direction`'s ``centred=True`` (docs/method.md §9.1).

    ``v_t`` is linear in the head row, so ``m_l = M_l^T C (gamma * mean_t P^T u_t)``: one backward pass
    through the head and one through the lens. Cached per (lens, model, layer); a lens whose matrices
    change in place after a call keeps the old mean (build a new lens object instead).
    """
    key = (id(model), int(layer))
    try:
        per_lens = _MEAN_CACHE.setdefault(lens, {})
    except TypeError:  # a lens that cannot be weakly referenced is not cached
        per_lens = {}
    if key not in per_lens:
        per_lens[key] = _pull_back(model, lens, layer, mean_head_row(model))
    return per_lens[key]


def read_vector(model: LensModel, lens: Lens, layer: int, token_id: int, *, centred: bool = False) -> torch.Tensor:
    """``v_t = M_l^T C (gamma * P^T u_t)`` ``[d_model]`` fp32 (not normalised); with ``centred``,
    ``v_t - m_l`` (:func:`mean_read_vector`)."""
    v = _pull_back(model, lens, layer, head_row(model, token_id))
    return v - mean_read_vector(model, lens, layer) if centred else v


# model -> its head matrix; read_vector_norms asks for it once per edited layer
_HEAD_MATRIX: weakref.WeakKeyDictionary[LensModel, torch.Tensor] = weakref.WeakKeyDictionary()


def head_matrix(model: LensModel) -> torch.Tensor:
    """``[d_model, vocab_size]`` in the head's dtype and device: column ``t`` is ``P^T u_t`` (:func:`head_row`),
    from ``d_model`` basis vectors through the pre-head modules and the head, minus its bias. The last one
    built is kept (one per model, while the model lives)."""
    try:
        cached = _HEAD_MATRIX.get(model)
    except TypeError:  # a model that cannot be weakly referenced is not cached
        cached = None
    if cached is not None:
        return cached
    d, vocab = int(model.d_model), int(model.vocab_size)
    head_param = next(model.head.parameters())
    with torch.no_grad():
        x = torch.cat([torch.zeros(1, d), torch.eye(d)]).to(device=execution_device(model.head),
                                                            dtype=head_param.dtype)
        for module in model.pre_head:
            x = module(x)
        out = model.head(x)[:, :vocab]  # [1 + d, vocab]
        head_t = out[1:] - out[:1]  # [d, vocab]: the head is linear up to its bias
    try:
        _HEAD_MATRIX.clear()  # one matrix at a time: it is d x vocab
        _HEAD_MATRIX[model] = head_t
    except TypeError:
        pass
    return head_t


def read_vector_norms(model: LensModel, lens: Lens, layer: int, *, centred: bool = False,
                      chunk: int = 4096) -> torch.Tensor:
    """``||v_t||`` (or ``||v_t - m_l||`` with ``centred``) for every vocabulary token ``t < model.vocab_size``:
    ``[vocab_size]`` fp32 (CPU). Used to draw swap success's norm-matched control (docs/method.md §7).

    The head's matrix comes from the head itself (``d_model`` basis vectors through the pre-head modules and
    the head, minus its bias), the lens's from its transport of the identity, so the numbers match
    :func:`read_vector` for any linear head and transport. Memory: the ``[d_model, vocab]`` head matrix
    once, in the head's dtype and device; ``chunk`` vocabulary rows at a time in fp32 after that.
    """
    d, vocab = int(model.d_model), int(model.vocab_size)
    gamma, centres = norm_gain(model)
    with torch.no_grad():
        head_t = head_matrix(model)  # [d, vocab]
        probe = torch.cat([torch.zeros(1, d), torch.eye(d)])
        moved = lens.transport(probe, int(layer)).float()
        transport_t = (moved[1:] - moved[:1]).to(head_t.device)  # [d, d]: row i is M_l e_i, i.e. M_l^T
        gamma = gamma.to(head_t.device)
        mean = mean_read_vector(model, lens, layer).to(head_t.device) if centred else None
        norms = []
        for start in range(0, vocab, int(chunk)):
            rows = head_t[:, start:start + int(chunk)].T.float() * gamma  # [k, d]: gamma * P^T u_t
            if centres:
                rows = rows - rows.mean(dim=1, keepdim=True)
            v = rows @ transport_t.T  # [k, d]: (M_l^T r_t)^T
            if mean is not None:
                v = v - mean
            norms.append(v.norm(dim=1).cpu())
    return torch.cat(norms)


# lens -> {(id(model), layer, token id, centred): unit direction}; an edit and a search ask for the same few
_DIRECTIONS: weakref.WeakKeyDictionary[Lens, dict[tuple[int, int, int, bool], torch.Tensor]] = \
    weakref.WeakKeyDictionary()
_DIRECTIONS_KEPT = 8192  # per lens (19 MiB at d_model 576); the oldest go first


def _direction_cache(lens: Lens) -> dict[tuple[int, int, int, bool], torch.Tensor]:
    try:
        return _DIRECTIONS.setdefault(lens, {})
    except TypeError:  # a lens that cannot be weakly referenced is not cached
        return {}


def token_directions(model: LensModel, lens: Lens, layer: int, token_ids: Sequence[int], *,
                     centred: bool = False) -> Float[torch.Tensor, "k d_model"]:
    """The unit read directions ``[k, d_model]`` (fp32, CPU) of ``token_ids`` (vocabulary ids) at ``layer``: the rows
    :func:`token_direction` gives one at a time, from one vector-Jacobian product for all of them. Cached per
    (lens, model, layer, token, centred), like the mean read vector (a lens changed in place keeps old entries).

    Raises:
        ValueError: a layer outside the lens, an id outside the vocabulary, or a direction that vanishes.
    """
    check_layers(model, lens, [layer])
    ids = [int(t) for t in token_ids]
    bad = [t for t in ids if not 0 <= t < int(model.vocab_size)]
    if bad:
        raise ValueError(f"Token id {bad[0]} is outside the vocabulary (0..{int(model.vocab_size) - 1}).")
    cache = _direction_cache(lens)
    keys = [(id(model), int(layer), t, bool(centred)) for t in ids]
    todo = list(dict.fromkeys(t for t, key in zip(ids, keys) if key not in cache))
    if todo:
        rows = torch.stack([head_row(model, t) for t in todo])  # [m, d]
        v = _pull_back(model, lens, layer, rows)  # [m, d]
        if centred:
            v = v - mean_read_vector(model, lens, layer)
        norms = v.norm(dim=-1)
        for t, vec, norm in zip(todo, v, norms.tolist()):
            if not math.isfinite(norm) or norm == 0.0:
                raise ValueError(f"The {'centred ' if centred else ''}read direction of token id {t} at layer {layer} "
                                 "is zero.")
            if len(cache) >= _DIRECTIONS_KEPT:
                cache.pop(next(iter(cache)))
            cache[(id(model), int(layer), t, bool(centred))] = vec / norm
    return torch.stack([cache[key] for key in keys]) if keys else torch.zeros(0, int(model.d_model))


def token_direction(model: LensModel, lens: Lens, layer: int, token: str | int, *,
                    centred: bool = False) -> Float[torch.Tensor, " d_model"]:
    """The unit read direction ``v̂_t`` ``[d_model]`` (fp32, CPU) of ``token`` at ``layer`` under ``lens``.

    Args:
        model: an :class:`~jlens_core.HFLensModel`.
        lens: a :class:`~jlens_core.JacobianLens`, :class:`~jlens_core.LogitLens` or any lens with a
            linear ``transport(h, layer)``.
        layer: a source layer the lens reads.
        token: one vocabulary token: an id, ``"<id:N>"``, a raw entry, or its exact text (``" Paris"``).
        centred: normalise ``v_t - m_l`` instead of ``v_t``, with ``m_l`` the mean read direction over the
            vocabulary at ``layer`` (:func:`mean_read_vector`). Every lens logit shifts by the same
            ``h . m_l``, so readings do not change; edits along the unit vector do (docs/method.md §9.1).

    Raises:
        ValueError: a token that is not a single vocabulary token (the message shows its pieces),
            a layer outside the lens, or a direction that vanishes.
    """
    check_layers(model, lens, [layer])
    tid = token_id(model.tokenizer, token, rule="exact", vocab_size=model.vocab_size)
    try:
        return token_directions(model, lens, layer, [tid], centred=centred)[0].clone()
    except ValueError:
        raise ValueError(f"The {'centred ' if centred else ''}read direction of token {token!r} at layer {layer} "
                         "is zero.") from None


__all__ = ["check_layers", "default_layers", "head_row", "last_source_layer", "mean_head_row", "mean_read_vector",
           "norm_gain", "read_vector", "read_vector_norms", "token_direction", "token_directions"]
