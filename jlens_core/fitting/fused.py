"""An analytic backward of the decoder layers: the ``"fused"`` estimator method (docs/method.md §2.2).

The per-prompt Jacobian (docs/method.md §2) is ``d_model`` vector-Jacobian products through the same
forward pass. Every backward step is linear in the cotangent, and all its elementwise
coefficients (norm scales, the activation's derivative, RoPE, the attention probabilities) depend on
the forward pass only. Autograd recomputes them on every backward call; here they are computed once
per prompt (:func:`prepare_layers`), and each chunk of ``dim_batch`` cotangents runs through a
hand-written backward of matmuls and a few in-place elementwise passes (:func:`backward_layer`).
The result is the same Jacobian (tests compare it with autograd).

Supported families (:mod:`~jlens_core.fitting.fused_layouts`): Llama, Mistral, Qwen2 (RMSNorm,
gated SiLU), Gemma (``(1 + w)`` RMSNorm, gated GELU-tanh), Gemma 2 (also post-norms, soft-capped
attention logits, sliding windows), GPT-2 (LayerNorm, fused ``Conv1D`` projections, learned
positions, GELU), GPT-NeoX (parallel residual, partial rotary) and Phi (parallel attention and MLP
on one LayerNorm, partial rotary). Grouped-query attention and any sliding window the attention
module declares are handled. :func:`fused_unsupported_reason` says why a model is not supported;
the forward pass is also checked layer by layer against the model's own layer outputs, and a
mismatch raises :class:`FusedMismatchError` (the estimator then falls back to autograd).

Across devices (a ``device_map``): each layer's coefficients are computed on the device the layer
runs on, the cotangents are carried to that device before its backward, and an offloaded layer's
weights are loaded once per backward group (:func:`~jlens_core.fitting.fused_layouts.layer_weights`):
once per layer in the layer-major order, once per chunk of rows and layer in the row-major one.

Exact savings shared with the autograd path (docs/method.md §2, causality): only the valid positions
``V = [skip_first, seq_len - 1)`` carry gradients (the prefix enters as constant keys and
values), the last token is dropped, nothing above the target layer or below the lowest source
layer is differentiated. Specific to this path: the first backward step through the target
layer's MLP output projection reads rows of the weight instead of multiplying by a one-hot
cotangent; and, where the memory allows (:func:`use_layer_major`), all ``d`` rows go through one
layer at a time, so the MLP half can be one ``d x d`` matrix per position (:func:`mlp_jacobians`),
formed once and applied to every row: ``4 n d^2 ff + 2 n d^3`` FLOPs per layer instead of
``6 n d^2 ff`` (gated; ``2 n d^2 ff + 2 n d^3`` instead of ``4 n d^2 ff`` for a plain MLP).

``rules="relevance"`` (docs/method.md §9.1) changes only the coefficients: the norms' denominator
terms are zero (a LayerNorm's centring stays), the activation's derivative is ``f(z) / z`` (0.5 at
0), and both factors of a gated product get half their gradient. The same backward then runs, at
the same cost.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..lenses.kinds import relevance_backward
from ..models.layouts import get_path
from ..models.model import LensModel
from ..models.placement import execution_device, is_offloaded, materialised
from ..models.recorder import ActivationRecorder
from .fused_activations import activation_coefficients
from .fused_layouts import (
    FUSED_MODEL_TYPES,
    FusedLayout,
    LayerWeights,
    apply_linear,
    fused_unsupported_reason,
    layer_weights,
    layout_for,
)
from .fused_norms import NormBackward, norm_forward
from .routing import routed_sums

log = logging.getLogger(__name__)

# positions whose MLP matrices one product forms (mlp_jacobians); 1..8 ran at the same rate here
MLP_BLOCK = 4


class FusedMismatchError(RuntimeError):
    """The re-implemented forward pass does not reproduce the model's own layer outputs."""


@dataclass
class AttentionCoefficients:
    """The attention backward of one layer at the ``n`` valid query positions.

    Shapes use ``S`` keys (all positions but the last), ``Hkv`` key/value heads, ``rep`` query heads
    per key/value head, ``hd`` head width, ``rd`` rotary width (``<= hd``).
    """

    score_weights: torch.Tensor  # [Hkv, rep * n, S]  probabilities (times the soft cap's slope 1 - tanh^2)
    probs_valid_t: torch.Tensor  # [Hkv, n, rep * n]  probabilities at valid keys, transposed
    attn_out: torch.Tensor  # [Hkv, rep * n, hd]  probs @ values (per head, before the output projection)
    keys_scaled: torch.Tensor  # [Hkv, S, hd]  (rotated) keys * softmax scale
    queries_scaled: torch.Tensor  # [Hkv, rep * n, hd]  (rotated) valid queries * softmax scale
    values_t: torch.Tensor  # [Hkv, hd, S]
    rotary: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None  # cos, sin [n, rd]; rep'd [rep n, rd]
    kv_heads: int
    rep: int
    head_dim: int


@dataclass
class LayerCoefficients:
    """Everything the backward of one decoder layer needs, for the ``n`` valid positions, on ``device``."""

    attn: AttentionCoefficients
    attn_norm: NormBackward  # [n, d]
    mlp_norm: NormBackward | None  # None: the MLP reads the attention's normed input (Phi)
    attn_post_norm: NormBackward | None  # Gemma 2's norms of each branch's output
    mlp_post_norm: NormBackward | None
    mlp: tuple[torch.Tensor, ...]  # [n, ff] each, aligned with LayerWeights.mlp_in: gated (d/d gate, d/d up)
    layout: FusedLayout
    # The decoder layer: its parts are found by the layout's paths (checked by fused_unsupported_reason),
    # so it is typed Any rather than through nn.Module's ``Tensor | Module`` attribute type.
    layer: Any
    offloaded: bool  # weights offloaded by accelerate: loaded per backward group (layer_weights)
    device: torch.device


def attention_window(layout: FusedLayout, layer: nn.Module, config: Any) -> int | None:
    """The sliding window of ``layer``'s attention (``None``: every earlier position): the module's own
    ``sliding_window`` where it declares one (Gemma 2, Qwen2), else the config's (Mistral)."""
    attn = get_path(layer, layout.attn)
    if hasattr(attn, "sliding_window"):
        window = attn.sliding_window
    elif getattr(config, "use_sliding_window", True) is False:
        window = None
    else:
        window = getattr(config, "sliding_window", None)
    return None if window is None else int(window)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``rd = cos.shape[-1]`` channels of ``x`` [..., hd] (partial rotary keeps the rest)."""
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        return torch.cat((_rotate(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)
    half = rd // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rotate_backward(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The transpose of :func:`_rotate` applied to a cotangent ``g`` [..., hd]."""
    rd = cos.shape[-1]
    if rd < g.shape[-1]:
        return torch.cat((_rotate_backward(g[..., :rd], cos, sin), g[..., rd:]), dim=-1)
    half = rd // 2
    out = g * cos
    out[..., :half].addcmul_(g[..., half:], sin[..., half:])
    out[..., half:].addcmul_(g[..., :half], sin[..., :half], value=-1)
    return out


def _project_qkv(layout: FusedLayout, attn: nn.Module, xn: torch.Tensor, skip: int, heads: int, kv_heads: int,
                 hd: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries at the valid positions ``[n, H, hd]``, keys and values at all ``[S, Hkv, hd]``."""
    S = xn.shape[0]
    if layout.qkv == "separate":
        q = apply_linear(get_path(attn, layout.q), xn[skip:]).view(S - skip, heads, hd)
        k = apply_linear(get_path(attn, layout.k), xn).view(S, kv_heads, hd)
        v = apply_linear(get_path(attn, layout.v), xn).view(S, kv_heads, hd)
        return q, k, v
    qkv = apply_linear(get_path(attn, layout.q), xn)  # [S, 3 H hd]
    if layout.qkv == "gpt2":  # [q | k | v], each [H, hd]
        q, k, v = (part.view(S, heads, hd) for part in qkv.split(heads * hd, dim=-1))
    else:  # "neox": per head [q k v]
        q, k, v = qkv.view(S, heads, 3 * hd).split(hd, dim=-1)
    return q[skip:], k, v


def _qkv_backward(layout: FusedLayout, w: LayerWeights, g_q: torch.Tensor, g_k: torch.Tensor,
                  g_v: torch.Tensor, heads: int, hd: int) -> torch.Tensor:
    """``[m, d]``: cotangents at the attention's input from those of the queries ``[m, H hd]``, keys and
    values ``[m, Hkv hd]`` (one product per weight; one for a fused projection)."""
    if layout.qkv == "separate":
        w_q, w_k, w_v = w.qkv
        return (g_q @ w_q).addmm_(g_k, w_k).addmm_(g_v, w_v)
    m = g_q.shape[0]
    if layout.qkv == "gpt2":
        g_qkv = torch.cat((g_q, g_k, g_v), dim=-1)  # [m, 3 H hd]
    else:
        g_qkv = torch.cat((g_q.view(m, heads, hd), g_k.view(m, heads, hd), g_v.view(m, heads, hd)), dim=-1)
        g_qkv = g_qkv.view(m, 3 * heads * hd)
    return g_qkv @ w.qkv[0]


def _attention_forward(layout: FusedLayout, attn: nn.Module, xn: torch.Tensor,
                       rotary: tuple[torch.Tensor, torch.Tensor] | None, skip: int, config: Any,
                       window: int | None) -> tuple[torch.Tensor, AttentionCoefficients]:
    """The attention of the valid queries over ``xn`` [S, d] (before the output projection's residual):
    its output ``[n, d]`` and its backward coefficients."""
    dtype = xn.dtype
    S, d = xn.shape
    n = S - skip
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(attn, "head_dim", None) or getattr(attn, "head_size", None) or d // heads
    rep = heads // kv_heads
    scale = getattr(attn, "scaling", None) or hd ** -0.5
    cap = getattr(attn, "attn_logit_softcapping", None)

    q, k, v = _project_qkv(layout, attn, xn, skip, heads, kv_heads, hd)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, n, hd], [Hkv, S, hd]
    rotary_coefficients = None
    if rotary is not None:
        cos, sin = rotary  # [S, rd]
        q = _rotate(q, cos[skip:], sin[skip:])
        k = _rotate(k, cos, sin)
        rotary_coefficients = (cos[skip:], sin[skip:], cos[skip:].repeat(rep, 1), sin[skip:].repeat(rep, 1))
    # Query head h reads key/value head h // rep: group the queries by their key/value head.
    q = q.reshape(kv_heads, rep * n, hd)  # [Hkv, rep * n, hd]
    scores = (q @ k.transpose(1, 2)).float() * scale  # [Hkv, rep * n, S]
    slope = None
    if cap is not None:  # Gemma 2: cap * tanh(s / cap), slope 1 - tanh^2
        capped = torch.tanh(scores / cap)
        slope = 1 - capped * capped
        scores = capped * cap
    query_pos = (torch.arange(n, device=xn.device) + skip).repeat(rep)  # [rep * n]
    key_pos = torch.arange(S, device=xn.device)[None, :]
    hidden = key_pos > query_pos[:, None]  # [rep * n, S]: the future
    if window is not None:
        hidden |= key_pos <= query_pos[:, None] - window  # outside the sliding window
    scores.masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [Hkv, rep * n, S]
    weights = (probs * slope if slope is not None else probs).to(dtype)
    probs = probs.to(dtype)
    out = probs @ v  # [Hkv, rep * n, hd]
    merged = out.view(kv_heads, rep, n, hd).permute(2, 0, 1, 3).reshape(n, heads * hd)
    coefficients = AttentionCoefficients(
        score_weights=weights, probs_valid_t=probs[:, :, skip:].transpose(1, 2).contiguous(), attn_out=out,
        keys_scaled=(k * scale).contiguous(), queries_scaled=(q * scale).contiguous(),
        values_t=v.transpose(1, 2).contiguous(), rotary=rotary_coefficients, kv_heads=kv_heads, rep=rep, head_dim=hd)
    return apply_linear(get_path(attn, layout.o), merged), coefficients


def _mlp_forward(layout: FusedLayout, layer: nn.Module, xn: torch.Tensor, relevance: bool
                 ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The MLP of ``xn`` [n, d] and its backward coefficients ``[n, ff]`` (gated: d/d gate, d/d up)."""
    dtype = xn.dtype
    act = get_path(layer, layout.act)
    if layout.gated:
        gate = apply_linear(get_path(layer, layout.mlp_in[0]), xn)  # [n, ff]
        up = apply_linear(get_path(layer, layout.mlp_in[1]), xn).float()
        value, slope = activation_coefficients(act, gate, relevance)
        hidden = (value * up).to(dtype)
        half = 0.5 if relevance else 1.0  # the half rule on act(gate) * up
        coefficients: tuple[torch.Tensor, ...] = ((half * up * slope).to(dtype), (half * value).to(dtype))
    else:
        z = apply_linear(get_path(layer, layout.mlp_in[0]), xn)  # [n, ff]
        value, slope = activation_coefficients(act, z, relevance)
        hidden = value.to(dtype)
        coefficients = (slope.to(dtype),)
    return apply_linear(get_path(layer, layout.mlp_out), hidden), coefficients


def _layer_forward(layout: FusedLayout, layer: nn.Module, x: torch.Tensor,
                   rotary: tuple[torch.Tensor, torch.Tensor] | None, skip: int, config: Any,
                   rules: str = "jacobian") -> tuple[torch.Tensor, LayerCoefficients]:
    """Re-run one decoder layer on ``x`` [S, d] (its weights real tensors); return its output at the
    valid positions [n, d] and its coefficients. ``rules="relevance"``: the coefficients of
    docs/method.md §9.1 (the forward is the same)."""
    relevance = relevance_backward(rules)
    dtype = x.dtype
    kind = layout.norm

    def norm(path: str, values: torch.Tensor) -> tuple[torch.Tensor, NormBackward]:
        return norm_forward(kind, values, get_path(layer, path), dtype, relevance)

    xn, attn_norm = norm(layout.attn_norm, x)  # xn: [S, d]
    attn = get_path(layer, layout.attn)
    attn_out, attn_c = _attention_forward(layout, attn, xn, rotary, skip, config,
                                          attention_window(layout, layer, config))  # [n, d]
    attn_post = mlp_post = mlp_norm = None
    if layout.attn_post_norm is not None:
        attn_out, attn_post = norm(layout.attn_post_norm, attn_out)
    residual = x[skip:]
    if layout.parallel:
        if layout.mlp_norm is None:  # one norm for both branches
            mlp_out, mlp_c = _mlp_forward(layout, layer, xn[skip:], relevance)
        else:
            yn, mlp_norm = norm(layout.mlp_norm, residual)
            mlp_out, mlp_c = _mlp_forward(layout, layer, yn, relevance)
        h = residual + attn_out + mlp_out
    else:
        assert layout.mlp_norm is not None  # a sequential layout normalises the MLP's input
        y = residual + attn_out  # [n, d]
        yn, mlp_norm = norm(layout.mlp_norm, y)
        mlp_out, mlp_c = _mlp_forward(layout, layer, yn, relevance)
        if layout.mlp_post_norm is not None:
            mlp_out, mlp_post = norm(layout.mlp_post_norm, mlp_out)
        h = y + mlp_out
    coefficients = LayerCoefficients(attn=attn_c, attn_norm=attn_norm.rows(skip), mlp_norm=mlp_norm,
                                     attn_post_norm=attn_post, mlp_post_norm=mlp_post, mlp=mlp_c, layout=layout,
                                     layer=layer, offloaded=False, device=x.device)
    return h, coefficients


@dataclass
class PreparedPrompt:
    """The forward pass of one prompt, ready for any number of backward chunks."""

    layers: dict[int, LayerCoefficients]  # {decoder layer j: coefficients}, lowest source + 1 .. target
    n_valid: int
    # {layer: [n, d]}: the model's residuals at the valid positions, lowest source .. target - 1 (routing)
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def like(self) -> torch.Tensor:
        """A tensor of the backward's dtype on the target layer's device (for routes made to match)."""
        return self.layers[max(self.layers)].attn_norm.a


def prepare_layers(model: LensModel, ids: torch.Tensor, lowest_source: int, target: int, skip_first: int,
                   rtol: float | None = None, rules: str = "jacobian") -> PreparedPrompt:
    """Forward pass of ``ids`` [1, seq] with the coefficients of layers ``lowest_source + 1 .. target``.

    The model's own forward records the residual before each of those layers (the input of layer
    ``j`` is exactly what the model computed, on whatever device it ran); each layer is then re-run
    here on its execution device (an offloaded layer's weights loaded for the re-run) and its
    output at the valid positions compared with the model's. ``rules`` chooses the backward
    coefficients (``"jacobian"`` or ``"relevance"``, docs/method.md §9.1).

    Raises:
        ValueError: the model is not supported (:func:`fused_unsupported_reason`).
        FusedMismatchError: a re-run layer differs from the model's by more than ``rtol``
            (relative L2; default 1e-4 in fp32, 2e-2 in half precision).
    """
    reason = fused_unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"The fused backward does not support {model.name!r}: {reason}.")
    config = model.config
    layout = layout_for(model)
    S = ids.shape[1] - 1
    if rtol is None:
        rtol = 1e-4 if model.dtype == torch.float32 else 2e-2
    with torch.no_grad(), ActivationRecorder(model.layers, range(lowest_source, target + 1),
                                             stop_after=target) as rec:
        model.run_with_cache(ids[:, :S])
    resid = {j: h[0] for j, h in rec.activations.items()}  # {j: [S, d]}
    rotary_by_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    cos_sin = None
    if layout.rotary:
        base: Any = model.base  # rotary_emb found by name (fused_unsupported_reason)
        x0 = resid[lowest_source]
        positions = torch.arange(S, device=x0.device)[None]
        with torch.no_grad():
            cos, sin = base.rotary_emb(x0[None], positions)
        cos_sin = (cos[0].to(x0.dtype), sin[0].to(x0.dtype))  # [S, rd]
    layers = {}
    with torch.no_grad():
        for j in range(lowest_source + 1, target + 1):
            layer = model.layers[j]
            device = execution_device(layer)
            rotary = None
            if cos_sin is not None:
                if device not in rotary_by_device:
                    rotary_by_device[device] = (cos_sin[0].to(device), cos_sin[1].to(device))
                rotary = rotary_by_device[device]
            offloaded = is_offloaded(layer)
            with materialised(layer):
                out, coeffs = _layer_forward(layout, layer, resid[j - 1].to(device), rotary, skip_first, config,
                                             rules)
            coeffs.offloaded = offloaded
            expected = resid[j][skip_first:].to(device).float()
            err = float((out.float() - expected).norm() / expected.norm().clamp_min(1e-30))
            if not err <= rtol:
                raise FusedMismatchError(
                    f"The fused backward's re-run of layer {j} differs from the model's output by {err:.2e} "
                    f"(relative; allowed {rtol:.0e}): this model's layers are not the {config.model_type} layout "
                    "it assumes.")
            layers[j] = coeffs
    return PreparedPrompt(layers=layers, n_valid=S - skip_first,
                          residuals={j: resid[j][skip_first:] for j in range(lowest_source, target)})


def _mlp_core_backward(c: LayerCoefficients, w: LayerWeights, grad: torch.Tensor,
                       u: torch.Tensor | None = None) -> torch.Tensor:
    """``[k, n, d]``: cotangents at the MLP's (normed) input from ``grad`` [k, n, d] at its output.

    ``u`` [k, n, ff], when given, is ``grad`` through the output projection already (the target
    layer's one-hot rows: an expanded weight row); it is overwritten when it is a temporary.
    """
    k, n, d = grad.shape
    if u is None:
        u = grad @ w.mlp_out  # [k, n, ff]
    last = len(c.mlp) - 1
    out = None
    for i, (coefficient, w_in) in enumerate(zip(c.mlp, w.mlp_in)):
        # the last factor may reuse u's memory (a temporary, except the target layer's expanded rows)
        g_z = u.mul_(coefficient) if i == last and u.is_contiguous() else u * coefficient  # [k, n, ff]
        g_z = g_z.view(k * n, -1)
        out = g_z @ w_in if out is None else out.addmm_(g_z, w_in)  # [k * n, d]
    assert out is not None
    return out.view(k, n, d)


def _attention_core_backward(c: LayerCoefficients, w: LayerWeights, grad: torch.Tensor) -> torch.Tensor:
    """``[k, n, d]``: cotangents at the attention's (normed) input from ``grad`` [k, n, d] at its output."""
    a = c.attn
    n, kv_heads, rep, hd = grad.shape[1], a.kv_heads, a.rep, a.head_dim
    k, _, d = grad.shape
    g_out = grad.reshape(k * n, d) @ w.o  # [k * n, H * hd]
    g_out = g_out.view(k, n, kv_heads, rep, hd).permute(0, 2, 3, 1, 4).reshape(k, kv_heads, rep * n, hd)
    g_probs = g_out @ a.values_t  # [k, Hkv, rep * n, S]
    delta = (g_out * a.attn_out).sum(-1, keepdim=True)  # [k, Hkv, rep * n, 1]
    g_scores = g_probs.sub_(delta).mul_(a.score_weights)  # softmax (and soft cap) backward
    skip = g_scores.shape[-1] - n
    g_q = g_scores @ a.keys_scaled  # [k, Hkv, rep * n, hd]
    g_k = g_scores[..., skip:].transpose(-1, -2) @ a.queries_scaled  # [k, Hkv, n, hd]
    g_v = a.probs_valid_t @ g_out  # [k, Hkv, n, hd]
    del g_probs, g_scores, g_out
    if a.rotary is not None:
        cos, sin, cos_rep, sin_rep = a.rotary
        g_q = _rotate_backward(g_q, cos_rep, sin_rep)
        g_k = _rotate_backward(g_k, cos, sin)
    g_q = g_q.view(k, kv_heads, rep, n, hd).permute(0, 3, 1, 2, 4).reshape(k * n, kv_heads * rep * hd)
    g_k = g_k.permute(0, 2, 1, 3).reshape(k * n, kv_heads * hd)
    g_v = g_v.permute(0, 2, 1, 3).reshape(k * n, kv_heads * hd)
    return _qkv_backward(c.layout, w, g_q, g_k, g_v, kv_heads * rep, hd).view(k, n, d)


def _attention_half_backward(c: LayerCoefficients, w: LayerWeights, grad: torch.Tensor) -> torch.Tensor:
    """A sequential layer's attention half, with its residual: ``grad + R1(attn'(post'(grad)))``."""
    g = grad if c.attn_post_norm is None else c.attn_post_norm.apply(grad.clone())
    return c.attn_norm.apply(_attention_core_backward(c, w, g), grad)


def _layer_backward(c: LayerCoefficients, w: LayerWeights, grad: torch.Tensor,
                    u: torch.Tensor | None = None) -> torch.Tensor:
    """``[k, n, d]`` at the layer's input from ``grad`` [k, n, d] at its output (``u``: as in
    :func:`_mlp_core_backward`)."""
    if c.layout.parallel:
        branch = _mlp_core_backward(c, w, grad, u)
        attn_in = _attention_core_backward(c, w, grad)
        if c.mlp_norm is None:  # one norm for both branches: grad + R(mlp' + attn')
            return c.attn_norm.apply(branch.add_(attn_in), grad)
        return c.attn_norm.apply(attn_in, c.mlp_norm.apply(branch, grad))
    assert c.mlp_norm is not None
    g = grad if c.mlp_post_norm is None else c.mlp_post_norm.apply(grad.clone())
    mid = c.mlp_norm.apply(_mlp_core_backward(c, w, g, u), grad)
    return _attention_half_backward(c, w, mid)


def _one_hot(rows: range | int, n: int, d: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``e_i`` at every valid position for each row ``i``: ``([k, n, d], index [k])``."""
    index = torch.arange(rows, device=like.device) if isinstance(rows, int) else torch.tensor(list(rows),
                                                                                              device=like.device)
    grad = torch.zeros(len(index), n, d, dtype=like.dtype, device=like.device)
    grad[torch.arange(len(index), device=like.device), :, index] = 1
    return grad, index


def backward_layer(prep: PreparedPrompt, j: int, grad: torch.Tensor | None, rows: range | None = None) -> torch.Tensor:
    """The cotangents ``[k, n, d]`` at layer ``j``'s input (on its device), from those at its output.

    ``grad`` is ``[k, n, d]`` on any device (carried to layer ``j``'s); ``None`` means the one-hot
    cotangents ``e_i`` (``i`` in ``rows``) at every valid position, whose backward through the MLP's
    output projection is a row lookup (unless a post-norm comes after it). An offloaded layer's
    weights are loaded for this call.
    """
    c = prep.layers[j]
    with layer_weights(c.layout, c.layer, c.offloaded) as w:
        u = None
        if grad is None:
            if rows is None:
                raise ValueError("backward_layer needs the rows of the one-hot cotangents when grad is None.")
            grad, index = _one_hot(rows, prep.n_valid, c.attn_norm.a.shape[-1], c.attn_norm.a)
            if c.mlp_post_norm is None:
                u = w.mlp_out[index][:, None, :].expand(len(rows), prep.n_valid, -1)  # [k, n, ff]
        else:
            grad = grad.to(c.device)
        return _layer_backward(c, w, grad, u)


def mlp_jacobians(c: LayerCoefficients, w: LayerWeights, block: int = MLP_BLOCK, out: torch.Tensor | None = None,
                  scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``[n, d, d]``: the MLP branch of one layer as a matrix per valid position.

    A row cotangent ``g`` [d] at the branch's output becomes ``g @ M[p]`` at the layer's input, with
    ``M[p] = P[p] W_out diag(coef[p]) W_in R[p]``: the MLP (gated: ``W_in`` stacks gate and up, ``W_out``
    is repeated; ``coef`` their two coefficients), ``R[p]`` the MLP's input norm backward (none where
    the MLP shares the attention's norm, Phi) and ``P[p]`` a post-norm's (Gemma 2). Forming ``M``
    costs ``2 n d^2 F`` FLOPs once per layer (``F`` the stacked width); applying it to all ``d`` rows
    costs ``2 n d^3``, against ``3 n d^2 F`` for the products per row it replaces.
    ``block`` positions are formed per matmul (their scaled weights are ``block * d * F`` values).
    ``out`` ([n, d, d]) and ``scratch`` ([block, d, F]) are reused buffers: allocating fresh
    tensors of this size for every layer costs page faults comparable to the matmuls' time.
    """
    parts = len(c.mlp)
    n, d = c.attn_norm.a.shape
    w_out = w.mlp_out if parts == 1 else torch.cat([w.mlp_out] * parts, dim=1)  # [d, F]
    w_in = w.mlp_in[0] if parts == 1 else torch.cat(w.mlp_in, dim=0)  # [F, d]
    coef = c.mlp[0] if parts == 1 else torch.cat(c.mlp, dim=-1)  # [n, F]
    width = w_in.shape[0]
    m = torch.empty(n, d, d, dtype=coef.dtype, device=coef.device) if out is None else out
    if scratch is None:
        scratch = torch.empty(block, d, width, dtype=coef.dtype, device=coef.device)
    for start in range(0, n, block):
        stop = min(n, start + block)
        scaled = torch.mul(w_out[None], coef[start:stop, None, :], out=scratch[: stop - start, :, :width])
        torch.mm(scaled.view(-1, width), w_in, out=m[start:stop].view(-1, d))
    if c.mlp_norm is not None:
        c.mlp_norm.right_multiply(m)
    if c.mlp_post_norm is not None:
        c.mlp_post_norm.left_multiply(m)
    return m


def mlp_width(model: LensModel) -> int:
    """The MLP's hidden width (GPT-2's ``n_inner``, default ``4 d``)."""
    config = model.config
    return int(getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * model.d_model)


def layer_major_bytes(d: int, d_ff: int, n_valid: int, dtype: torch.dtype, block: int = MLP_BLOCK) -> int:
    """Memory the layer-major backward holds at its peak: three ``[n, d, d]`` tensors (the MLP
    matrices, and the cotangents of all ``d`` rows at a layer's middle and at its output/input) and
    the ``[block, d, 2 d_ff]`` scaled weights :func:`mlp_jacobians` forms them from."""
    return (3 * n_valid * d * d + block * d * 2 * d_ff) * torch.finfo(dtype).bits // 8


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not Linux: assume too little
        return 0


def use_layer_major(model: LensModel, n_valid: int, fraction: float = 0.25) -> bool:
    """Whether :func:`layer_major_bytes` fits in ``fraction`` of the free memory of every device the
    decoder layers run on (RAM on the CPU). Both orders give the same Jacobian; the layer-major one
    needs fewer FLOPs."""
    need = layer_major_bytes(model.d_model, mlp_width(model), n_valid, model.dtype)
    devices = {execution_device(layer) for layer in model.layers} or {model.device}
    return all(need <= fraction * _available_bytes(device) for device in devices)


def _layer_major_step(c: LayerCoefficients, w: LayerWeights, is_target: bool, m: torch.Tensor, mid: torch.Tensor,
                      grad: torch.Tensor, scratch: torch.Tensor, dim_batch: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer of the layer-major order: ``grad`` [d rows, n, d] at the layer's output (ignored at the
    target: the one-hot rows) to its input. ``m``, ``mid`` ([n, d, d]) and ``grad`` are buffers of the
    same size; returns them as ``(m, mid, grad)`` again, their roles possibly swapped."""
    n, d = c.attn_norm.a.shape
    mlp_jacobians(c, w, out=m, scratch=scratch)  # [n, d, d]
    if not c.layout.parallel:
        if is_target:  # e_i at every valid position: g + g @ M[p] is row i of I + M[p]
            m, mid = mid, m
            mid.diagonal(dim1=1, dim2=2).add_(1)
        else:
            by_position = grad.transpose(0, 1)  # [n, d rows, d]
            torch.baddbmm(by_position, by_position, m, out=mid)
        for start in range(0, d, dim_batch):  # grad is free again: mid holds all it carried
            rows = slice(start, min(start + dim_batch, d))
            grad[rows] = _attention_half_backward(c, w, mid[:, rows].transpose(0, 1))
        return m, mid, grad
    # parallel: both branches read the layer's input cotangents, so the result goes to a third buffer
    if is_target:
        grad.zero_()
        every = torch.arange(d, device=grad.device)
        grad[every, :, every] = 1
    by_position = grad.transpose(0, 1)  # [n, d rows, d]
    if c.mlp_norm is None:  # one norm for both branches: mid = g @ M[p], before the norm
        torch.bmm(by_position, m, out=mid)
    else:  # mid = g + g @ M[p]
        torch.baddbmm(by_position, by_position, m, out=mid)
    out = m.view(d, n, d)
    for start in range(0, d, dim_batch):
        rows = slice(start, min(start + dim_batch, d))
        g = grad[rows]  # [k, n, d]
        attn_in = _attention_core_backward(c, w, g)
        mid_rows = mid[:, rows].transpose(0, 1)
        if c.mlp_norm is None:
            out[rows] = c.attn_norm.apply(attn_in.add_(mid_rows), g)
        else:
            out[rows] = c.attn_norm.apply(attn_in, mid_rows)
    return grad.view(n, d, d), mid, out


def _layer_major_jacobians(prep: PreparedPrompt, sources: list[int], target: int, d: int,
                           dim_batch: int, routes: dict[int, torch.Tensor] | None = None,
                           expert_sums: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
    """All ``d`` rows at once, one layer at a time: the MLP branch by :func:`mlp_jacobians`, the
    attention in chunks of ``dim_batch`` rows. ``routes`` / ``expert_sums``: as in :func:`fused_backward`.

    Three ``[n, d, d]`` buffers per device: on reaching a layer on another device the cotangents are
    carried over and the buffers made there (the previous device's freed).
    """
    n = prep.n_valid
    wanted = set(sources)
    jacobians = {}
    device: torch.device | None = None
    m = mid = grad = scratch = torch.empty(0)
    for j in range(target, sources[0], -1):
        c = prep.layers[j]
        if c.device != device:
            like = c.attn_norm.a
            carried = grad if device is not None else None
            m, mid, grad = (torch.empty(n, d, d, dtype=like.dtype, device=like.device) for _ in range(3))
            grad = grad.view(d, n, d)  # the cotangents of every row at layer j's output: [d rows, n, d]
            if carried is not None:
                grad.copy_(carried)
            del carried
            width = max(sum(t.shape[-1] for t in other.mlp) for other in prep.layers.values())
            scratch = torch.empty(MLP_BLOCK, d, width, dtype=like.dtype, device=like.device)
            device = c.device
        with layer_weights(c.layout, c.layer, c.offloaded) as w:  # loaded once for the layer
            m, mid, grad = _layer_major_step(c, w, j == target, m, mid, grad, scratch, dim_batch)
        if j - 1 in wanted:
            jacobians[j - 1] = grad.float().sum(dim=1).cpu() / n
            if routes is not None and expert_sums is not None:  # grad: [d rows, n, d], every row at once
                expert_sums[j - 1].copy_(routed_sums(routes[j - 1].to(grad.device), grad).cpu())
    return jacobians


def fused_jacobians(model: LensModel, ids: torch.Tensor, sources: list[int], target: int, skip_first: int,
                    dim_batch: int, rtol: float | None = None,
                    layer_major: bool | None = None, rules: str = "jacobian") -> dict[int, torch.Tensor]:
    """``{l: J_l}`` (fp32, CPU, ``[d, d]``) for one prompt ``ids`` [1, seq], by the analytic backward.

    Same definition and result as the autograd estimator (docs/method.md §2): :func:`prepare_layers`,
    then :func:`fused_backward` (which says how the rows run, and what ``layer_major`` chooses).
    ``rules``: ``"jacobian"`` or ``"relevance"`` (docs/method.md §9.1; only the coefficients differ).
    Raises as :func:`prepare_layers`.
    """
    prep = prepare_layers(model, ids, sources[0], target, skip_first, rtol, rules)
    return fused_backward(model, prep, sources, target, dim_batch, layer_major)


def fused_backward(model: LensModel, prep: PreparedPrompt, sources: list[int], target: int, dim_batch: int,
                   layer_major: bool | None = None, routes: dict[int, torch.Tensor] | None = None,
                   expert_sums: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
    """``{l: J_l}`` (fp32, CPU, ``[d, d]``) from a prepared prompt, in one of two orders:

    * layer-major (``layer_major=True``): all ``d`` rows go through one layer at a time; the MLP
      branch is a ``d x d`` matrix per position (:func:`mlp_jacobians`), which saves about a fifth of
      a gated MLP's FLOPs; the attention runs in chunks of ``dim_batch`` rows. Holds
      :func:`layer_major_bytes` (0.47 GB for a 576-wide model at seq 128 in fp32; 6.1 GB at
      2048 wide, ff 8192). An offloaded layer's weights are loaded once.
    * row-major (``False``): chunks of ``dim_batch`` rows run through all the layers, from the
      target down to the lowest source; memory grows with ``dim_batch``, not ``d``. An offloaded
      layer's weights are loaded once per chunk.

    ``None`` (default) takes layer-major when its memory fits (:func:`use_layer_major`). On a model
    spread over devices the cotangents go from layer to layer's device; the result is on the CPU.

    Expert routing (docs/method.md §9.1, experts): with ``routes`` (``{l: one-hot Tensor[E, n_valid]}``,
    :func:`~jlens_core.fitting.routing.one_hot_routes`, on any device) and ``expert_sums``
    (``{l: Tensor[E, d, d]}``, fp32 CPU, filled here), each source position's row block is also added
    to its expert's sum, ``S_{l,e} = sum_{p in e} G_p``, from the same backward passes (``E d^2``
    fp32 more on the device per layer at a time).
    """
    d = model.d_model
    n = prep.n_valid
    if layer_major is None:
        layer_major = use_layer_major(model, n)
    if layer_major:
        with torch.no_grad():
            return _layer_major_jacobians(prep, sources, target, d, dim_batch, routes, expert_sums)
    wanted = set(sources)
    jacobians = {layer: torch.zeros(d, d, dtype=torch.float32) for layer in sources}
    with torch.no_grad():
        for start in range(0, d, dim_batch):
            rows = range(start, min(start + dim_batch, d))
            grad = None
            for j in range(target, sources[0], -1):
                grad = backward_layer(prep, j, grad, rows)  # [k, n, d] at h_{j-1}, on layer j's device
                if j - 1 in wanted:
                    jacobians[j - 1][start: rows.stop] = grad.float().sum(dim=1).cpu() / n
                    if routes is not None and expert_sums is not None:
                        routed = routed_sums(routes[j - 1].to(grad.device), grad)
                        expert_sums[j - 1][:, start: rows.stop] = routed.cpu()
    return jacobians


__all__ = ["FUSED_MODEL_TYPES", "FusedMismatchError", "LayerCoefficients", "PreparedPrompt", "backward_layer",
           "fused_backward", "fused_jacobians", "fused_unsupported_reason", "layer_major_bytes", "mlp_jacobians",
           "prepare_layers", "use_layer_major"]
