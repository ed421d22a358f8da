"""The norms of the fused backward (docs/method.md §2.2): each norm's forward and its backward as coefficients.

Every norm the fused path knows has a backward of the same shape, a diagonal minus a low-rank term
per position:

    g_x = A * g - sum_t C_t * sum(B_t * g)          (row vector g at the norm's output, [.., d])

* RMSNorm, ``weight * x r`` (Llama: the product rounded to the model's dtype first), or Gemma's
  ``(1 + weight) * x r``, with ``r = rsqrt(mean(x^2) + eps)`` and gain ``w``: ``A = w r`` and one
  term ``B = w x``, ``C = x r^3 / d`` (the derivative of the denominator).
* LayerNorm, ``w (x - mean(x)) r + bias``, ``r = rsqrt(var(x) + eps)``, ``xhat = (x - mean) r``:
  ``A = w r`` and two terms: the centring ``B = w``, ``C = r / d``, and the denominator's
  ``B = w xhat``, ``C = xhat r / d``.

``relevance=True`` (docs/method.md §9.1): the denominator is a constant, so its term is left out;
a LayerNorm's centring stays.

As a matrix per position, ``g_x = g @ R[p]`` with ``R[p] = diag(A[p]) - sum_t B_t[p] C_t[p]^T``
(:meth:`NormBackward.right_multiply`, :meth:`NormBackward.left_multiply` apply it to ``[n, d, d]``
matrices, for the layer-major order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..models.model import weight_of

# how each family's norm computes: see the module docstring
NORM_KINDS = ("rms", "rms_one_plus", "layer")


@dataclass
class NormBackward:
    """The backward of one norm at ``m`` positions: ``g -> A * g - sum_t C_t * sum(B_t * g)``."""

    a: torch.Tensor  # [m, d]
    terms: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # ((B_t [m, d], C_t [m, d]), ...)

    def rows(self, start: int) -> NormBackward:
        """The coefficients of positions ``start ..`` (the valid positions, from those of every position)."""
        return NormBackward(self.a[start:], tuple((b[start:], c[start:]) for b, c in self.terms))

    def apply(self, g: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``residual + A * g - sum_t C_t * sum(B_t * g)`` for ``g`` [k, m, d]; overwrites ``g`` (a
        temporary of the caller) with the result."""
        dots = [(g * b).sum(-1, keepdim=True) for b, _ in self.terms]  # each [k, m, 1]
        g.mul_(self.a)
        if residual is not None:
            g.add_(residual)
        for (_, c), dot in zip(self.terms, dots):
            g.addcmul_(c, dot, value=-1)
        return g

    def right_multiply(self, m: torch.Tensor) -> torch.Tensor:
        """``M[p] @ R[p]`` for ``m`` [n, d, d], in place: the norm applied after ``M`` (row vectors)."""
        products = [torch.bmm(m, b[:, :, None]) for b, _ in self.terms]  # each [n, d, 1], before m changes
        m.mul_(self.a[:, None, :])
        for (_, c), mb in zip(self.terms, products):
            m.baddbmm_(mb, c[:, None, :], alpha=-1)
        return m

    def left_multiply(self, m: torch.Tensor) -> torch.Tensor:
        """``R[p] @ M[p]`` for ``m`` [n, d, d], in place: the norm applied before ``M`` (row vectors)."""
        products = [torch.bmm(c[:, None, :], m) for _, c in self.terms]  # each [n, 1, d]
        m.mul_(self.a[:, :, None])
        for (b, _), cm in zip(self.terms, products):
            m.baddbmm_(b[:, :, None], cm, alpha=-1)
        return m

    def to(self, device: torch.device) -> NormBackward:
        return NormBackward(self.a.to(device), tuple((b.to(device), c.to(device)) for b, c in self.terms))


def _eps(norm: nn.Module) -> float:
    for name in ("variance_epsilon", "eps"):
        value = getattr(norm, name, None)
        if value is not None:
            return float(value)
    return 1e-6


def norm_forward(kind: str, x: torch.Tensor, norm: nn.Module, dtype: torch.dtype, relevance: bool = False
                 ) -> tuple[torch.Tensor, NormBackward]:
    """The norm of ``x`` [m, d] (the module's own arithmetic) and its backward coefficients in ``dtype``.

    ``norm``'s weights must be real tensors (materialised when offloaded). ``relevance``: the
    denominator is a constant (docs/method.md §9.1).
    """
    eps = _eps(norm)
    d = x.shape[-1]
    xf = x.float()
    gain = weight_of(norm)
    if kind == "layer":
        bias = getattr(norm, "bias", None)
        normed = nn.functional.layer_norm(x, (d,), gain, bias, eps)
        mean = xf.mean(-1, keepdim=True)
        r = torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + eps)  # [m, 1]
        xhat = (xf - mean) * r  # [m, d]
        w = gain.float() if gain is not None else torch.ones(d, device=x.device)
        a = (w * r).expand_as(xf)
        terms = [(w.expand_as(xf), (r / d).expand_as(xf))]
        if not relevance:
            terms.append((w * xhat, xhat * r / d))
    else:
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [m, 1]
        if kind == "rms_one_plus":
            w = 1.0 + gain.float()
            normed = ((xf * r) * w).to(x.dtype)
        elif kind == "rms":
            w = gain.float()
            normed = gain * (xf * r).to(x.dtype)
        else:
            raise ValueError(f"unknown norm kind {kind!r}; one of {NORM_KINDS}")
        a = w * r
        terms = [] if relevance else [(w * xf, xf * r.pow(3) / d)]
    backward = NormBackward(a.to(dtype).contiguous(),
                            tuple((b.to(dtype).contiguous(), c.to(dtype).contiguous()) for b, c in terms))
    return normed, backward
