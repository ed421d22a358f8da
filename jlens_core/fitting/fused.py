"""An analytic backward for Llama-style decoder layers: the ``"fused"`` estimator method.

The per-prompt Jacobian (docs/method.md §2) is ``d_model`` vector-Jacobian products through the same
forward pass. Every backward step is linear in the cotangent, and all its elementwise
coefficients (RMSNorm scales, the gated-SiLU derivative, RoPE, the attention probabilities)
depend on the forward pass only. Autograd recomputes them on every backward call; here they are
computed once per prompt (:func:`prepare_layers`), and each chunk of ``dim_batch`` cotangents runs
through a hand-written backward of matmuls and a few in-place elementwise passes
(:func:`backward_layer`). The result is the same Jacobian (tests compare it with autograd).

Supported: decoder layers laid out as Llama's (``input_layernorm`` RMSNorm, ``self_attn.{q,k,v,o}_proj``
with rotary embeddings and grouped-query attention, ``post_attention_layernorm``, a gated-SiLU
``mlp.{gate,up,down}_proj``) in the families Llama, Mistral (without a sliding window shorter than
the prompt) and Qwen2. :func:`fused_unsupported_reason` says why a model is not supported; the
forward pass is also checked layer by layer against the model's own layer outputs, and a
mismatch raises :class:`FusedMismatchError` (the estimator then falls back to autograd).

Exact savings shared with the autograd path (docs/method.md §2, causality): only the valid positions
``V = [skip_first, seq_len - 1)`` carry gradients (the prefix enters as constant keys and
values), the last token is dropped, nothing above the target layer or below the lowest source
layer is differentiated. Specific to this path: the first backward step through the target
layer's ``down_proj`` reads rows of the weight instead of multiplying by a one-hot cotangent; and,
where the memory allows (:func:`use_layer_major`), all ``d`` rows go through one layer at a time,
so the MLP half can be one ``d x d`` matrix per position (:func:`mlp_jacobians`), formed once and
applied to every row: ``4 n d^2 ff + 2 n d^3`` FLOPs per layer instead of ``6 n d^2 ff``.

``rules="relevance"`` (docs/method.md §9.1) changes only the coefficients: the RMSNorms' ``C`` term
(the derivative of the denominator) is zero, the SiLU derivative is ``silu(z) / z = sigmoid(z)``
(0.5 at 0), and both factors of ``silu(gate) * up`` get half their gradient. The same backward
then runs, at the same cost.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..models.layouts import get_path
from ..models.model import LensModel, weight_of
from ..models.placement import is_dispatched
from ..models.recorder import ActivationRecorder
from .routing import routed_sums

log = logging.getLogger(__name__)

FUSED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# positions whose MLP matrices one product forms (mlp_jacobians); 1..8 ran at the same rate here
MLP_BLOCK = 4


class FusedMismatchError(RuntimeError):
    """The re-implemented forward pass does not reproduce the model's own layer outputs."""


@dataclass
class LayerCoefficients:
    """Everything the backward of one decoder layer needs, for the ``n`` valid positions.

    Shapes use ``n`` valid positions, ``S`` keys (all positions but the last), ``Hkv`` key/value
    heads, ``rep`` query heads per key/value head, ``hd`` head width, ``ff`` MLP width.
    """

    # RMSNorm backward, g_x = A * g - C * sum(B * g): for the input norm (1) and post-attention norm (2)
    a1: torch.Tensor  # [n, d]  weight * r
    b1: torch.Tensor  # [n, d]  weight * x
    c1: torch.Tensor  # [n, d]  x * r^3 / d
    a2: torch.Tensor
    b2: torch.Tensor
    c2: torch.Tensor
    silu_gate: torch.Tensor  # [n, ff]  d act / d up = silu(gate)
    dact_gate: torch.Tensor  # [n, ff]  d act / d gate = up * silu'(gate)
    probs: torch.Tensor  # [Hkv, rep * n, S]  attention probabilities of the valid queries
    probs_valid_t: torch.Tensor  # [Hkv, n, rep * n]  their columns at valid keys, transposed
    attn_out: torch.Tensor  # [Hkv, rep * n, hd]  probs @ values (per head, before o_proj)
    keys_scaled: torch.Tensor  # [Hkv, S, hd]  rotated keys * softmax scale
    queries_scaled: torch.Tensor  # [Hkv, rep * n, hd]  rotated valid queries * softmax scale
    values_t: torch.Tensor  # [Hkv, hd, S]
    # A Llama-layout decoder layer: its parts are found by name (checked by fused_unsupported_reason),
    # so they are typed Any rather than through nn.Module's ``Tensor | Module`` attribute type.
    layer: Any


def fused_unsupported_reason(model: LensModel) -> str | None:
    """Why the fused backward cannot run on ``model`` (``None`` when it can).

    Checks the family (``config.model_type`` in :data:`FUSED_MODEL_TYPES`), the activation
    (SiLU), the rotary-embedding module, that the weights sit on one device and none is offloaded
    (no ``device_map`` spreading or offloading them), and the module names of every decoder layer.
    """
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in FUSED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {FUSED_MODEL_TYPES}"
    act = getattr(config, "hidden_act", None)
    if act != "silu":
        return f"hidden_act {act!r} is not 'silu'"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    if getattr(model.base, "rotary_emb", None) is None:  # a module of the family's own code
        return "no rotary_emb module on the decoder stack"
    if is_dispatched(model.hf_model):  # weights read directly, where they live: one device, none offloaded
        return "the model is spread over several devices or has offloaded weights (a device_map)"
    for i, layer in enumerate(model.layers):
        for path in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                     "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            if get_path(layer, path) is None:
                return f"layer {i} has no {path}"
    return None


def sliding_window_shorter_than(config: Any, seq_len: int) -> bool:
    """Whether ``config`` has a sliding attention window shorter than ``seq_len`` tokens (the fused
    backward attends to every earlier position, so it cannot run there)."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return False
    return int(window) < seq_len


def _rms_coefficients(x: torch.Tensor, norm: nn.Module, dtype: torch.dtype, relevance: bool = False
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """RMSNorm forward of ``x`` [m, d] and the backward coefficients (A, B, C) of its rows.

    ``relevance``: the denominator is a constant (docs/method.md §9.1), so ``C = 0``.
    """
    eps: float | None = getattr(norm, "variance_epsilon", None)
    if eps is None:
        eps = getattr(norm, "eps", 1e-6)
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [m, 1]
    gain = weight_of(norm)
    weight = gain.float()
    normed = gain * (xf * r).to(x.dtype)
    d = x.shape[-1]
    a, b, c = (weight * r, weight * xf, torch.zeros_like(xf) if relevance else xf * r.pow(3) / d)
    return normed, (a.to(dtype), b.to(dtype), c.to(dtype))


def _linear(x: torch.Tensor, module: nn.Linear) -> torch.Tensor:
    return nn.functional.linear(x, module.weight, module.bias)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rotate_backward(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The transpose of :func:`_rotate` applied to a cotangent ``g`` [..., hd]."""
    half = g.shape[-1] // 2
    out = g * cos
    out[..., :half].addcmul_(g[..., half:], sin[..., half:])
    out[..., half:].addcmul_(g[..., :half], sin[..., :half], value=-1)
    return out


def _layer_forward(layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, skip: int,
                   config: Any, rules: str = "jacobian") -> tuple[torch.Tensor, LayerCoefficients]:
    """Re-run one decoder layer on ``x`` [S, d]; return its output at the valid positions [n, d].

    ``rules="relevance"``: the coefficients of docs/method.md §9.1 (the forward is the same).
    """
    relevance = rules == "relevance"
    dtype = x.dtype
    attn, mlp = layer.self_attn, layer.mlp
    S, d = x.shape
    n = S - skip
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    hd = getattr(attn, "head_dim", None) or d // heads
    rep = heads // kv_heads
    scale = getattr(attn, "scaling", None) or hd ** -0.5

    xn, (a1, b1, c1) = _rms_coefficients(x, layer.input_layernorm, dtype, relevance)  # xn: [S, d]
    q = _linear(xn[skip:], attn.q_proj).view(n, heads, hd).transpose(0, 1)  # [H, n, hd]
    k = _linear(xn, attn.k_proj).view(S, kv_heads, hd).transpose(0, 1)  # [Hkv, S, hd]
    v = _linear(xn, attn.v_proj).view(S, kv_heads, hd).transpose(0, 1)  # [Hkv, S, hd]
    q = _rotate(q, cos[skip:], sin[skip:])
    k = _rotate(k, cos, sin)
    # Query head h reads key/value head h // rep: group the queries by their key/value head.
    q = q.reshape(kv_heads, rep * n, hd)  # [Hkv, rep * n, hd]
    scores = (q @ k.transpose(1, 2)).float() * scale  # [Hkv, rep * n, S]
    query_pos = (torch.arange(n, device=x.device) + skip).repeat(rep)  # [rep * n]
    future = torch.arange(S, device=x.device)[None, :] > query_pos[:, None]  # [rep * n, S]
    scores.masked_fill_(future, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(dtype)  # [Hkv, rep * n, S]
    out = probs @ v  # [Hkv, rep * n, hd]
    merged = out.view(kv_heads, rep, n, hd).permute(2, 0, 1, 3).reshape(n, heads * hd)
    y = x[skip:] + _linear(merged, attn.o_proj)  # [n, d]

    yn, (a2, b2, c2) = _rms_coefficients(y, layer.post_attention_layernorm, dtype, relevance)
    gate = _linear(yn, mlp.gate_proj).float()  # [n, ff]
    up = _linear(yn, mlp.up_proj).float()
    sig = torch.sigmoid(gate)
    silu = gate * sig
    h = y + _linear((silu * up).to(dtype), mlp.down_proj)  # [n, d]
    if relevance:  # identity rule silu(z)/z = sigmoid(z); half rule on silu(gate) * up
        dsilu, silu = 0.5 * sig, 0.5 * silu
    else:
        dsilu = sig * (1 + gate * (1 - sig))
    coefficients = LayerCoefficients(
        a1=a1[skip:], b1=b1[skip:], c1=c1[skip:], a2=a2, b2=b2, c2=c2,
        silu_gate=silu.to(dtype), dact_gate=(up * dsilu).to(dtype),
        probs=probs, probs_valid_t=probs[:, :, skip:].transpose(1, 2).contiguous(), attn_out=out,
        keys_scaled=(k * scale).contiguous(), queries_scaled=(q * scale).contiguous(),
        values_t=v.transpose(1, 2).contiguous(), layer=layer)
    return h, coefficients


@dataclass
class PreparedPrompt:
    """The forward pass of one prompt, ready for any number of backward chunks."""

    layers: dict[int, LayerCoefficients]  # {decoder layer j: coefficients}, lowest source + 1 .. target
    cos: torch.Tensor  # [n, hd] at the valid positions
    sin: torch.Tensor
    cos_rep: torch.Tensor  # [rep * n, hd]: the same, for queries grouped by key/value head
    sin_rep: torch.Tensor
    n_valid: int
    kv_heads: int
    rep: int
    head_dim: int
    # {layer: [n, d]}: the model's residuals at the valid positions, lowest source .. target - 1 (routing)
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)


def prepare_layers(model: LensModel, ids: torch.Tensor, lowest_source: int, target: int, skip_first: int,
                   rtol: float | None = None, rules: str = "jacobian") -> PreparedPrompt:
    """Forward pass of ``ids`` [1, seq] with the coefficients of layers ``lowest_source + 1 .. target``.

    The model's own forward records the residual before each of those layers (the input of layer
    ``j`` is exactly what the model computed); each layer is then re-run here and its output at the
    valid positions compared with the model's. ``rules`` chooses the backward coefficients
    (``"jacobian"`` or ``"relevance"``, docs/method.md §9.1).

    Raises:
        ValueError: the model is not supported (:func:`fused_unsupported_reason`).
        FusedMismatchError: a re-run layer differs from the model's by more than ``rtol``
            (relative L2; default 1e-4 in fp32, 2e-2 in half precision).
    """
    reason = fused_unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"The fused backward does not support {model.name!r}: {reason}.")
    config = model.config
    seq_len = ids.shape[1]
    S = seq_len - 1
    if sliding_window_shorter_than(config, S):
        raise ValueError(f"The fused backward does not support a sliding window ({config.sliding_window}) "
                         f"shorter than the prompt ({S} tokens).")
    if rtol is None:
        rtol = 1e-4 if model.dtype == torch.float32 else 2e-2
    n = S - skip_first
    with torch.no_grad(), ActivationRecorder(model.layers, range(lowest_source, target + 1),
                                             stop_after=target) as rec:
        model.run_with_cache(ids[:, :S])
    resid = {j: h[0] for j, h in rec.activations.items()}  # {j: [S, d]}
    base: Any = model.base  # a Llama-layout stack: rotary_emb found by name (fused_unsupported_reason)
    x0 = resid[lowest_source]
    positions = torch.arange(S, device=x0.device)[None]
    cos, sin = base.rotary_emb(x0[None], positions)
    cos, sin = cos[0].to(x0.dtype), sin[0].to(x0.dtype)  # [S, hd]
    layers = {}
    with torch.no_grad():
        for j in range(lowest_source + 1, target + 1):
            out, coeffs = _layer_forward(model.layers[j], resid[j - 1], cos, sin, skip_first, config, rules)
            expected = resid[j][skip_first:].float()
            err = float((out.float() - expected).norm() / expected.norm().clamp_min(1e-30))
            if not err <= rtol:
                raise FusedMismatchError(
                    f"The fused backward's re-run of layer {j} differs from the model's output by {err:.2e} "
                    f"(relative; allowed {rtol:.0e}): this model's layers are not the Llama layout it assumes.")
            layers[j] = coeffs
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    rep = heads // kv_heads
    hd = cos.shape[-1]
    return PreparedPrompt(layers=layers, cos=cos[skip_first:], sin=sin[skip_first:],
                          cos_rep=cos[skip_first:].repeat(rep, 1), sin_rep=sin[skip_first:].repeat(rep, 1),
                          n_valid=n, kv_heads=kv_heads, rep=rep, head_dim=hd,
                          residuals={j: resid[j][skip_first:] for j in range(lowest_source, target)})


def _rms_backward(g: torch.Tensor, residual: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  c: torch.Tensor) -> torch.Tensor:
    """``residual + A * g - C * sum(B * g)`` over the last axis; ``g``, ``residual``: [k, n, d].

    Overwrites ``g`` (a temporary of the caller) with the result.
    """
    dot = (g * b).sum(-1, keepdim=True)  # [k, n, 1]
    return g.mul_(a).add_(residual).addcmul_(c, dot, value=-1)  # g is a temporary: reuse its memory


def _mlp_backward(c: LayerCoefficients, grad: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Cotangents ``[k, n, d]`` through the MLP half (with its residual) of one layer.

    ``u`` [k, n, ff] is ``grad`` through ``down_proj`` (the cotangent of the activation).
    """
    mlp = c.layer.mlp
    k, n, d = grad.shape
    g_gate = u * c.dact_gate  # [k, n, ff]; act = silu(gate) * up
    # u is the down_proj product, a temporary, except at the target layer (an expanded weight row)
    g_up = u.mul_(c.silu_gate) if u.is_contiguous() else u * c.silu_gate
    g_norm = (g_gate.view(k * n, -1) @ mlp.gate_proj.weight).view(k, n, d)
    g_norm.view(k * n, d).addmm_(g_up.view(k * n, -1), mlp.up_proj.weight)
    return _rms_backward(g_norm, grad, c.a2, c.b2, c.c2)


def _attention_backward(prep: PreparedPrompt, c: LayerCoefficients, grad: torch.Tensor) -> torch.Tensor:
    """Cotangents ``[k, n, d]`` through the attention half (with its residual) of one layer."""
    attn = c.layer.self_attn
    n, kv_heads, rep, hd = prep.n_valid, prep.kv_heads, prep.rep, prep.head_dim
    k, _, d = grad.shape
    g_out = grad.reshape(k * n, d) @ attn.o_proj.weight  # [k * n, H * hd]
    g_out = g_out.view(k, n, kv_heads, rep, hd).permute(0, 2, 3, 1, 4).reshape(k, kv_heads, rep * n, hd)
    g_probs = g_out @ c.values_t  # [k, Hkv, rep * n, S]
    delta = (g_out * c.attn_out).sum(-1, keepdim=True)  # [k, Hkv, rep * n, 1]
    g_scores = g_probs.sub_(delta).mul_(c.probs)  # softmax backward
    skip = g_scores.shape[-1] - n
    g_q = g_scores @ c.keys_scaled  # [k, Hkv, rep * n, hd]
    g_k = g_scores[..., skip:].transpose(-1, -2) @ c.queries_scaled  # [k, Hkv, n, hd]
    g_v = c.probs_valid_t @ g_out  # [k, Hkv, n, hd]
    del g_probs, g_scores, g_out
    g_q = _rotate_backward(g_q, prep.cos_rep, prep.sin_rep)
    g_k = _rotate_backward(g_k, prep.cos, prep.sin)
    g_q = g_q.view(k, kv_heads, rep, n, hd).permute(0, 3, 1, 2, 4).reshape(k * n, kv_heads * rep * hd)
    g_k = g_k.permute(0, 2, 1, 3).reshape(k * n, kv_heads * hd)
    g_v = g_v.permute(0, 2, 1, 3).reshape(k * n, kv_heads * hd)
    g_norm = g_q @ attn.q_proj.weight  # [k * n, d]
    g_norm.addmm_(g_k, attn.k_proj.weight).addmm_(g_v, attn.v_proj.weight)
    return _rms_backward(g_norm.view(k, n, d), grad, c.a1, c.b1, c.c1)


def backward_layer(prep: PreparedPrompt, j: int, grad: torch.Tensor | None, rows: range | None = None) -> torch.Tensor:
    """The cotangents ``[k, n, d]`` at layer ``j``'s input, from those at its output.

    ``grad`` is ``[k, n, d]``; ``None`` means the one-hot cotangents ``e_i`` (``i`` in ``rows``) at every
    valid position, whose ``down_proj`` backward is a row lookup.
    """
    c = prep.layers[j]
    if grad is None:
        if rows is None:
            raise ValueError("backward_layer needs the rows of the one-hot cotangents when grad is None.")
        k, n, d = len(rows), prep.n_valid, c.a1.shape[-1]
        index = torch.tensor(list(rows), device=c.a1.device)
        u = c.layer.mlp.down_proj.weight[index][:, None, :].expand(k, n, -1)  # [k, n, ff]
        grad = torch.zeros(k, n, d, dtype=c.a1.dtype, device=c.a1.device)
        grad[torch.arange(k), :, index] = 1
    else:
        u = grad @ c.layer.mlp.down_proj.weight  # [k, n, ff]
    return _attention_backward(prep, c, _mlp_backward(c, grad, u))


def mlp_jacobians(c: LayerCoefficients, block: int = MLP_BLOCK, out: torch.Tensor | None = None,
                  scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``[n, d, d]``: the MLP half of one layer as a matrix per valid position.

    A row cotangent ``g`` [d] at the half's output becomes ``g + g @ M[p]`` at its input, with
    ``M[p] = (W_down diag(act'_gate[p]) W_gate + W_down diag(silu(gate[p])) W_up) R[p]`` and
    ``R[p] = diag(a2[p]) - b2[p] c2[p]^T`` the post-attention RMSNorm's backward. Forming ``M`` costs
    ``4 n d^2 ff`` FLOPs once per layer; applying it to all ``d`` rows costs ``2 n d^3``, against
    ``6 n d^2 ff`` for the three matmuls per row it replaces: cheaper whenever ``d < ff``.
    ``block`` positions are formed per matmul (their scaled weights are ``block * d * 2 ff`` values).
    ``out`` ([n, d, d]) and ``scratch`` ([block, d, 2 ff]) are reused buffers: allocating fresh
    tensors of this size for every layer costs page faults comparable to the matmuls' time.
    """
    mlp = c.layer.mlp
    n, d = c.a2.shape
    w_down = mlp.down_proj.weight  # [d, ff]
    w_down2 = torch.cat([w_down, w_down], dim=1)  # [d, 2 ff]
    w_in = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], dim=0)  # [2 ff, d]
    coef = torch.cat([c.dact_gate, c.silu_gate], dim=-1)  # [n, 2 ff]
    m = torch.empty(n, d, d, dtype=w_down.dtype, device=w_down.device) if out is None else out
    if scratch is None:
        scratch = torch.empty(block, d, w_in.shape[0], dtype=w_down.dtype, device=w_down.device)
    for start in range(0, n, block):
        stop = min(n, start + block)
        scaled = torch.mul(w_down2[None], coef[start:stop, None, :], out=scratch[: stop - start])  # [b, d, 2 ff]
        torch.mm(scaled.view(-1, scaled.shape[-1]), w_in, out=m[start:stop].view(-1, d))
    m_b = torch.bmm(m, c.b2[:, :, None])  # [n, d, 1]: before the columns are scaled by a2
    m.mul_(c.a2[:, None, :]).baddbmm_(m_b, c.c2[:, None, :], alpha=-1)
    return m


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
    """Whether :func:`layer_major_bytes` fits in ``fraction`` of the free memory of ``model``'s device
    (RAM on the CPU). Both orders give the same Jacobian; the layer-major one needs fewer FLOPs."""
    d_ff = model.config.intermediate_size
    return layer_major_bytes(model.d_model, d_ff, n_valid, model.dtype) <= fraction * _available_bytes(model.device)


def _layer_major_jacobians(prep: PreparedPrompt, sources: list[int], target: int, d: int,
                           dim_batch: int, routes: dict[int, torch.Tensor] | None = None,
                           expert_sums: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
    """All ``d`` rows at once, one layer at a time: the MLP half by :func:`mlp_jacobians`, the
    attention half in chunks of ``dim_batch`` rows. ``routes`` / ``expert_sums``: as in :func:`fused_backward`."""
    n = prep.n_valid
    wanted = set(sources)
    jacobians = {}
    like = prep.layers[target].a2
    m, mid, grad = (torch.empty(n, d, d, dtype=like.dtype, device=like.device) for _ in range(3))
    ff2 = 2 * prep.layers[target].silu_gate.shape[-1]
    scratch = torch.empty(MLP_BLOCK, d, ff2, dtype=like.dtype, device=like.device)
    grad = grad.view(d, n, d)  # the cotangents of every row at layer j's output: [d rows, n, d]
    for j in range(target, sources[0], -1):
        c = prep.layers[j]
        mlp_jacobians(c, out=m, scratch=scratch)  # [n, d, d]
        if j == target:  # e_i at every valid position: g + g @ M[p] is row i of I + M[p]
            m, mid = mid, m
            mid.diagonal(dim1=1, dim2=2).add_(1)
        else:
            by_position = grad.transpose(0, 1)  # [n, d rows, d]
            torch.baddbmm(by_position, by_position, m, out=mid)
        for start in range(0, d, dim_batch):  # grad is free again: mid holds all it carried
            rows = slice(start, min(start + dim_batch, d))
            grad[rows] = _attention_backward(prep, c, mid[:, rows].transpose(0, 1))
        if j - 1 in wanted:
            jacobians[j - 1] = grad.float().sum(dim=1).cpu() / n
            if routes is not None and expert_sums is not None:  # grad: [d rows, n, d], every row at once
                expert_sums[j - 1].copy_(routed_sums(routes[j - 1], grad).cpu())
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
      half is a ``d x d`` matrix per position (:func:`mlp_jacobians`), which saves about a fifth of
      the MLP's FLOPs; the attention half runs in chunks of ``dim_batch`` rows. Holds
      :func:`layer_major_bytes` (0.47 GB for a 576-wide model at seq 128 in fp32; 6.1 GB at
      2048 wide, ff 8192).
    * row-major (``False``): chunks of ``dim_batch`` rows run through all the layers, from the
      target down to the lowest source; memory grows with ``dim_batch``, not ``d``.

    ``None`` (default) takes layer-major when its memory fits (:func:`use_layer_major`).

    Expert routing (docs/method.md §9.1, experts): with ``routes`` (``{l: one-hot Tensor[E, n_valid]}``
    on the model's device, :func:`~jlens_core.fitting.routing.one_hot_routes`) and ``expert_sums``
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
                grad = backward_layer(prep, j, grad, rows)  # [k, n, d] at h_{j-1}
                if j - 1 in wanted:
                    jacobians[j - 1][start: rows.stop] = grad.float().sum(dim=1).cpu() / n
                    if routes is not None and expert_sums is not None:
                        expert_sums[j - 1][:, start: rows.stop] = routed_sums(routes[j - 1], grad).cpu()
    return jacobians
