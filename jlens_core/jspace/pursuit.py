"""Greedy sparse nonnegative pursuit over a dictionary of atoms (docs/method.md §11.2): plain tensors, no model.

A dictionary is ``n_atoms`` rows in ``d`` dimensions; every atom is used as its unit vector ``a_i / ||a_i||`` (a
zero row is never selected), and coefficients are on those unit atoms, so a coefficient is a length in the
units of ``x``. For each row ``x`` of a batch, ``k`` greedy steps:

1. select the atom with the largest positive correlation ``<r, â_i>`` with the residual ``r = x - sum c_j â_j``
   among those not yet selected; stop (for that row) when none is positive;
2. update the coefficients of the selected atoms, keeping them ``>= 0``:

   * ``"gradient_pursuit"`` (Blumensath & Davies 2008, "Gradient pursuits", nonnegative): one step along the
     projected gradient ``g = A_S r`` (its entries where ``c_j = 0`` and ``g_j < 0`` zeroed), with the exact
     line-search length ``<g, g> / ||A_S^T g||^2``, then ``c <- max(c, 0)``;
   * ``"nnls"``: the nonnegative least-squares problem on the selected atoms solved exactly (Lawson-Hanson
     active sets, batched), so the result satisfies the KKT conditions (:func:`kkt_violation`).

Both work in the selected atoms' Gram matrix ``G = A_S A_S^T`` and ``b = A_S x`` (float64); only the selection
needs correlations with the whole dictionary (``correlate``), which a caller may compute without forming it
(:mod:`jlens_core.jspace.dictionary` does, from the lens and the head). The fit ``x_J = sum c_j â_j``: with
``"nnls"`` it is the orthogonal projection of ``x`` onto the span of the active atoms (KKT: the residual is
orthogonal to every atom with ``c_j > 0``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float, Int

METHODS = ("gradient_pursuit", "nnls")
# relative to ||x||: a correlation at or below this is "not positive" (rounding of an exact fit)
POSITIVE_TOL = 1e-7


@dataclass(frozen=True)
class Pursuit:
    """What a pursuit found for each row of ``x [n, d]``.

    Attributes:
        indices: ``LongTensor[n, k]``: the selected atoms (dictionary rows) in selection order, ``-1`` after an
            early stop.
        coefficients: ``float64[n, k]``, ``>= 0``, on the unit atoms; 0 at padding.
        fitted: ``float64[n, d]``: ``x_J = sum_j c_j â_j``.
        residual_by_step: ``float64[n, k]``: ``||x - x_J||^2`` after each step (the last value carried on after
            an early stop).
        method: ``"gradient_pursuit"`` or ``"nnls"``.
    """

    indices: Int[torch.Tensor, "n k"]
    coefficients: Float[torch.Tensor, "n k"]
    fitted: Float[torch.Tensor, "n d"]
    residual_by_step: Float[torch.Tensor, "n k"]
    method: str

    @property
    def active(self) -> Bool[torch.Tensor, "n k"]:
        """``bool[n, k]``: selected atoms with a nonzero coefficient."""
        return (self.indices >= 0) & (self.coefficients > 0)


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not a pursuit method: use one of {', '.join(METHODS)}.")
    return method


def _solve_on(gram: torch.Tensor, b: torch.Tensor, passive: torch.Tensor) -> torch.Tensor:
    """Least squares restricted to ``passive`` per row: ``z [n, j]``, zero outside it (the rest of the system is
    replaced by the identity, so it decouples)."""
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    both = passive[:, :, None] & passive[:, None, :]
    g = torch.where(both, gram, eye)
    # a tiny ridge keeps nearly collinear atoms solvable; it is far below the fits' precision
    g = g + 1e-13 * g.diagonal(dim1=1, dim2=2).abs().amax(-1)[:, None, None] * eye
    z = torch.linalg.solve(g, torch.where(passive, b, 0.0)[..., None])[..., 0]
    return torch.where(passive, z, 0.0)


def nnls_gram(gram: Float[torch.Tensor, "n j j"], b: Float[torch.Tensor, "n j"],
              valid: Bool[torch.Tensor, "n j"] | None = None) -> Float[torch.Tensor, "n j"]:
    """``argmin_{c >= 0} 0.5 c^T G c - b^T c`` per row (``c = 0`` where not ``valid``): Lawson-Hanson active sets,
    batched over rows (float64 advised). ``G = A A^T`` and ``b = A x`` give NNLS of ``x`` on the rows of ``A``."""
    n, j = b.shape
    valid = torch.ones_like(b, dtype=torch.bool) if valid is None else valid
    c = torch.zeros_like(b)
    passive = torch.zeros_like(valid)
    scale = b.abs().amax(-1, keepdim=True).clamp_min(1e-300)
    rows = torch.arange(n, device=b.device)
    for _ in range(3 * j + 3):
        w = b - (gram @ c[..., None])[..., 0]
        candidates = valid & ~passive & (w > 1e-11 * scale)
        todo = candidates.any(-1)
        if not bool(todo.any()):
            break
        pick = torch.where(candidates, w, -torch.inf).argmax(-1)
        passive[rows[todo], pick[todo]] = True
        for _ in range(3 * j + 3):
            z = _solve_on(gram, b, passive)
            blocked = passive & (z <= 0) & todo[:, None]
            stuck = blocked.any(-1)
            done = todo & ~stuck
            c = torch.where(done[:, None], z, c)
            if not bool(stuck.any()):
                break
            # move from c toward z as far as feasibility allows; the blocking coefficient reaches 0 and leaves
            ratio = torch.where(blocked, c / (c - z).clamp_min(1e-300), torch.inf)
            alpha, leaving = ratio.min(-1)
            step = c + alpha[:, None].clamp(0.0, 1.0) * (z - c)
            c = torch.where(stuck[:, None], step, c)
            drop = stuck[:, None] & passive & (c <= 1e-14 * scale)
            drop[rows[stuck], leaving[stuck]] = True
            passive = passive & ~drop
            c = torch.where(passive, c, 0.0).clamp_min(0.0)
            todo = stuck
    return c


def kkt_violation(gram: Float[torch.Tensor, "n j j"], b: Float[torch.Tensor, "n j"],
                  c: Float[torch.Tensor, "n j"]) -> Float[torch.Tensor, " n"]:
    """The largest violation of the NNLS optimality conditions per row, relative to ``max |b|``: ``c >= 0``; the
    gradient ``w = b - G c`` is 0 where ``c > 0`` and ``<= 0`` where ``c = 0``."""
    w = b - (gram @ c[..., None])[..., 0]
    scale = b.abs().amax(-1).clamp_min(1e-300)
    negative = (-c).clamp_min(0).amax(-1)
    on = torch.where(c > 0, w.abs(), 0.0).amax(-1)
    off = torch.where(c <= 0, w.clamp_min(0), 0.0).amax(-1)
    return torch.maximum(torch.maximum(negative, on), off) / scale


def _gradient_step(gram: torch.Tensor, b: torch.Tensor, c: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """One nonnegative gradient-pursuit step: exact line search along the projected gradient, then ``max(c, 0)``."""
    g = torch.where(valid, b - (gram @ c[..., None])[..., 0], 0.0)
    g = torch.where((c <= 0) & (g < 0), 0.0, g)  # would leave the feasible set at once
    num = (g * g).sum(-1)
    den = (g[:, None, :] @ gram @ g[..., None])[:, 0, 0]
    step = torch.where(den > 0, num / den.clamp_min(1e-300), 0.0)
    return (c + step[:, None] * g).clamp_min(0.0)


def greedy_pursuit(x: Float[torch.Tensor, "n d"], k: int, *,
                   correlate: Callable[[torch.Tensor], torch.Tensor],
                   fetch: Callable[[torch.Tensor], torch.Tensor],
                   method: str = "gradient_pursuit") -> Pursuit:
    """The pursuit of the module docstring for rows ``x [n, d]``, with the dictionary given by two functions.

    Args:
        x: targets ``[n, d]`` (any float dtype; the fit runs in float64).
        k: greedy steps (atoms selected at most), ``>= 1``.
        correlate: fp32 residuals ``[n, d]`` -> their correlations ``[n, n_atoms]`` with the *unit* atoms.
        fetch: atom indices ``LongTensor[m]`` -> those unit atoms ``[m, d]``.
        method: ``"gradient_pursuit"`` or ``"nnls"``.
    """
    check_method(method)
    x64 = x.detach().double()
    n, d = x64.shape
    k = int(k)
    idx = torch.full((n, k), -1, dtype=torch.long)
    coef = torch.zeros(n, k, dtype=torch.float64)
    atoms = torch.zeros(n, k, d, dtype=torch.float64)
    gram = torch.eye(k, dtype=torch.float64).repeat(n, 1, 1)  # unit atoms: 1 on the diagonal (padding too)
    b = torch.zeros(n, k, dtype=torch.float64)
    residual_by_step = torch.zeros(n, k, dtype=torch.float64)
    xnorm = x64.norm(dim=-1)
    alive = xnorm > 0
    fitted = torch.zeros_like(x64)
    rows = torch.arange(n)
    for step in range(k):
        r = x64 - fitted
        if bool(alive.any()):
            corr = correlate(r[alive].float())  # [m, n_atoms]
            if step:
                chosen = idx[alive, :step]
                corr = corr.scatter_(1, chosen, -torch.inf)
            best, pick = corr.max(-1)
            ok = best.double() > POSITIVE_TOL * xnorm[alive]
            live_rows = rows[alive]
            alive[live_rows[~ok]] = False
            live_rows, pick = live_rows[ok], pick[ok]
        else:
            live_rows = rows[:0]
        if live_rows.numel():
            new = fetch(pick).double()  # [m, d]
            idx[live_rows, step] = pick
            atoms[live_rows, step] = new
            cross = (atoms[live_rows, : step + 1] @ new[..., None])[..., 0]  # [m, step + 1]
            gram[live_rows, step, : step + 1] = cross
            gram[live_rows, : step + 1, step] = cross
            b[live_rows, step] = (new * x64[live_rows]).sum(-1)
            valid = idx[live_rows] >= 0
            g, bb = gram[live_rows], b[live_rows]
            if method == "nnls":
                c = nnls_gram(g, bb, valid)
            else:
                c = _gradient_step(g, bb, coef[live_rows], valid)
            coef[live_rows] = c
            fitted[live_rows] = (c[:, None, :] @ atoms[live_rows])[:, 0]
        residual_by_step[:, step] = (x64 - fitted).pow(2).sum(-1)
    return Pursuit(idx, coef, fitted, residual_by_step, method)


def pursuit(dictionary: Float[torch.Tensor, "n_atoms d"], x: Float[torch.Tensor, "*n d"], k: int, *,
            method: str = "gradient_pursuit") -> Pursuit:
    """Sparse nonnegative pursuit of ``x`` (``[d]`` or ``[n, d]``) over the rows of ``dictionary`` (module docstring).

    Raises:
        ValueError: shapes that do not match, ``k < 1``, an unknown method, or a dictionary with no nonzero row.
    """
    check_method(method)
    if dictionary.dim() != 2 or x.shape[-1] != dictionary.shape[1] or x.dim() not in (1, 2):
        raise ValueError(f"x {tuple(x.shape)} and dictionary {tuple(dictionary.shape)} do not match: give x [d] or "
                         "[n, d] and a dictionary [n_atoms, d].")
    if int(k) < 1:
        raise ValueError(f"k={k} selects no atom: give k >= 1.")
    unit = dictionary.detach().double()
    norms = unit.norm(dim=-1)
    if not bool((norms > 0).any()):
        raise ValueError("The dictionary has no nonzero atom.")
    unit = torch.where(norms[:, None] > 0, unit / norms.clamp_min(1e-300)[:, None], 0.0)
    unit32 = unit.float()
    rows = x.detach().reshape(-1, x.shape[-1])
    return greedy_pursuit(rows, min(int(k), int(dictionary.shape[0])), correlate=lambda r: r @ unit32.T,
                          fetch=lambda i: unit[i], method=method)


__all__ = ["METHODS", "Pursuit", "greedy_pursuit", "kkt_violation", "nnls_gram", "pursuit"]
