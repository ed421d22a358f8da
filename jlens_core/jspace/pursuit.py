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

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float, Int

METHODS = ("gradient_pursuit", "nnls")
# relative to ||x||: a correlation at or below this is "not positive" (rounding of an exact fit)
POSITIVE_TOL = 1e-7
BF16_UNIT = 2.0 ** -8  # bf16's unit roundoff
FP16_UNIT = 2.0 ** -11  # fp16's unit roundoff (normal range)
FP16_SUBNORMAL = 2.0 ** -25  # half the spacing of fp16's subnormals: the absolute rounding error below 2^-14
# fp16 products are kept below 2^14 (far from the 65504 overflow): rows and targets each scaled, by powers of two
# (exact), to norms at most 2^7, so |x . w| <= ||x|| ||w|| <= 2^14
FP16_NORM = 2.0 ** 7
FP32_UNIT = 2.0 ** -24
# the bound below is proven; this factor covers what the proof leaves to the kernel (order of the fp32 sums)
BOUND_SAFETY = 2.0
# past this share of the atoms among the candidates, re-scoring costs about the full fp32 product: compute that
MAX_RESCORE_FRACTION = 0.25


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


Select = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Bf16Atoms:
    """A dictionary's rows kept in a low precision (bf16, or fp16 for a few rows) beside their fp32 originals, to
    select the best atom exactly from low-precision products (:func:`bounded_best`). Scores are
    ``s_t (z . w_t + o)`` for rows ``z`` with a per-row offset ``o`` and a per-atom scale ``s_t >= 0``; the offset
    rides along as a last coordinate (``w'_t = [w_t, 1]``, ``z' = [z, o]``), so one product gives every score.

    bf16 has fp32's exponent range, so its rows are stored as they are. fp16 has 3 more mantissa bits but overflows
    at 65504 and turns subnormal below 2^-14, so its rows are stored scaled by ``low_scale`` (a power of two: exact)
    to norms at most :data:`FP16_NORM`; :func:`bounded_best` scales the targets the same way and divides it out.

    Attributes:
        weight: ``float32[n_atoms, d]`` the rows ``w_t``, contiguous (:meth:`of` copies a transposed view: the
            re-scoring gathers rows, ~60x faster from contiguous rows than as columns of a ``[d, n_atoms]`` block).
        weight_low: ``bfloat16`` or ``float16[n_atoms, d + 1]``: ``low(low_scale [w_t, 1])``, contiguous.
        alpha: ``float32[n_atoms]``: ``(||v_t - low(v_t)|| + g ||low(v_t)||) / low_scale`` with ``v_t = low_scale w'_t``,
            ``g = (d+1) u32 / (1 - (d+1) u32)``.
        beta: ``float32[n_atoms]``: ``||w'_t||``.
        low_scale: the power of two the stored rows carry (1 for bf16).
    """

    weight: Float[torch.Tensor, "n_atoms d"]
    weight_low: torch.Tensor
    alpha: Float[torch.Tensor, " n_atoms"]
    beta: Float[torch.Tensor, " n_atoms"]
    low_scale: float = 1.0

    @classmethod
    def of(cls, weight: Float[torch.Tensor, "n_atoms d"], chunk: int = 8192,
           dtype: torch.dtype = torch.bfloat16) -> Bf16Atoms:
        """Build from fp32 rows ``weight [n_atoms, d]`` (in chunks: no fp32 copy of the ``[w, 1]`` block), stored in
        ``dtype`` (``torch.bfloat16`` or ``torch.float16``).

        Raises:
            ValueError: another dtype.
        """
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"dtype={dtype} is not a low precision to select from: use torch.bfloat16 or float16.")
        n, d = weight.shape
        g = _gamma(d + 1)
        scale = 1.0
        if dtype == torch.float16:
            largest = max(float(torch.sqrt(weight[s:s + chunk].float().pow(2).sum(-1) + 1).max())
                          for s in range(0, n, chunk))
            scale = _power_of_two_at_most(FP16_NORM / largest)
        low = torch.empty(n, d + 1, dtype=dtype)
        alpha, beta = torch.empty(n), torch.empty(n)
        for s in range(0, n, chunk):
            w = torch.cat([weight[s:s + chunk].float(), torch.ones(min(chunk, n - s), 1)], dim=1)
            beta[s:s + chunk] = w.norm(dim=-1)
            if scale != 1.0:
                w.mul_(scale)
            w_low = w.to(dtype)
            low[s:s + chunk] = w_low
            back = w_low.float()
            alpha[s:s + chunk] = ((w - back).norm(dim=-1) + g * back.norm(dim=-1)) / scale
        return cls(weight=weight.float().contiguous(), weight_low=low, alpha=alpha, beta=beta, low_scale=scale)


def _power_of_two_at_most(value: float) -> float:
    """The largest power of two ``<= value`` (``value > 0``): scaling by it is exact in any binary format."""
    return 2.0 ** math.floor(math.log2(value))


def fp16_selection_available() -> bool:
    """Whether fp16 products of one row run fast and with fp32 sums here: torch's fp16 matrix-vector kernel (x86
    with AVX2 / AVX512: F16C conversions, fp32 arithmetic) with fp16 reduced-precision reductions off (they would
    sum in fp16, which the bound does not cover). Measured on the default model's head: 1.9 ms a row against 4.8 ms
    in fp32 (docs/method.md §11.2)."""
    capability = torch.backends.cpu.get_cpu_capability()
    fp16_sums = getattr(torch._C, "_get_cpu_allow_fp16_reduced_precision_reduction", None)  # absent: unknown, so no
    return capability in ("AVX2", "AVX512") and fp16_sums is not None and not fp16_sums()


def _gamma(n: int) -> float:
    return n * FP32_UNIT / (1 - n * FP32_UNIT)


def bounded_best(z: Float[torch.Tensor, "m d"], offset: Float[torch.Tensor, " m"] | None, atoms: Bf16Atoms,
                 scale: Float[torch.Tensor, " n_atoms"] | None, chosen: Int[torch.Tensor, "m s"]
                 ) -> tuple[Float[torch.Tensor, " m"], Int[torch.Tensor, " m"], int]:
    """The best atom per row by ``score_t = s_t (z . w_t + o)`` among atoms not in ``chosen``, from low-precision
    products (``atoms.weight_low``: bf16, or fp16 for a few rows), exact: the atom the fp32 scores pick (up to fp32
    rounding ties), and its fp32 score. Written below for bf16 (unit roundoff ``u = 2^-8``); for fp16 ``u = 2^-11``,
    the targets are scaled by a power of two as the rows are (:class:`Bf16Atoms`, both exact and divided out), so
    no product nears fp16's overflow, and ``f`` also holds a subnormal output's absolute error ``2^-25`` (over
    those scales).

    1. ``p~ = bf16(z') @ bf16(w')^T`` (fp32 accumulation, output rounded to bf16), ``score~ = s p~``.
    2. A bound ``|score~_t - score_t| <= eps_t`` per row and atom, with ``x = z'``, ``x~ = bf16(x)``, ``w~ = bf16(w')``:
       ``x.w - x~.w~ = x~.(w - w~) + (x - x~).w``; the bf16 products are exact in fp32 and summed there, within
       ``g ||x~|| ||w~||``; the output is rounded to bf16, within ``u |p~| / (1 - u)``; the fp32 score is within
       ``g ||x|| ||w||`` of the exact one and its offset and scaling within four fp32 units; plus a flush-to-zero
       term ``f``. So ``eps_t = S (s_t (||x~|| alpha_t + (||x - x~|| + g ||x||) beta_t) + r |score~_t| + f)`` with
       ``r = u / (1 - u) + 4 u32`` and ``S`` = :data:`BOUND_SAFETY`.
    3. The best exact score is at least ``floor = score~_b - eps_b`` (``b`` the bf16 best). An atom can beat it only
       if ``score~_t + eps_t >= floor``; with ``K = S (||x~|| max_t s_t alpha_t + (..) max_t s_t beta_t + f)`` that
       needs ``score~_t >= (floor - K) / (1 + S r)`` (when ``floor > K``; ``/ (1 - S r)`` otherwise): one pass over
       the scores finds the atoms above that threshold (their union over rows), and the exact test
       ``score~_t + eps_t >= floor`` is made on those columns only. The atoms that pass it for some row are
       re-scored in fp32 with the same ``z``; past :data:`MAX_RESCORE_FRACTION` of the atoms every score is computed
       in fp32 instead.

    Args:
        z: ``float32[m, d]`` rows; ``offset``: ``float32[m]`` or ``None`` (0); ``scale``: ``float32[n_atoms]`` (``>= 0``)
            or ``None`` (1).
        chosen: ``int64[m, s]`` atoms each row may not pick (``s`` may be 0).

    Returns:
        ``(best [m] fp32, pick [m] int64, n_rescored)``: ``n_rescored`` the atoms scored in fp32 (all of them on the
        fallback).
    """
    return bounded_best_blocks(z, offset, atoms, [(0, int(z.shape[0]), scale)], chosen)


def bounded_best_blocks(z: Float[torch.Tensor, "m d"], offset: Float[torch.Tensor, " m"] | None, atoms: Bf16Atoms,
                        blocks: Sequence[tuple[int, int, Float[torch.Tensor, " n_atoms"] | None]],
                        chosen: Int[torch.Tensor, "m s"]) -> tuple[Float[torch.Tensor, " m"], Int[torch.Tensor, " m"], int]:
    """:func:`bounded_best` for row blocks with a scale each (rows ``a:b`` scored with ``scale``, for
    ``(a, b, scale)`` in ``blocks``, which cover the rows in order): one low-precision product for every row (a
    larger, faster matrix product: several J-space layers share the head), then each block's bound and re-scoring
    as :func:`bounded_best` makes them. Returns the same, ``n_rescored`` summed over the blocks."""
    m, d = z.shape
    low = atoms.weight_low.dtype
    z = z.float()
    off = offset.float() if offset is not None else torch.zeros(m)
    x = torch.cat([z, off[:, None]], dim=1)
    x_scale = 1.0
    if low == torch.float16:
        largest = float(x.norm(dim=-1).max())
        if not math.isfinite(largest):
            raise ValueError("A target row is not finite: nothing can be selected for it.")
        x_scale = _power_of_two_at_most(FP16_NORM / largest) if largest > 0 else 1.0
    x_low = (x * x_scale).to(low) if x_scale != 1.0 else x.to(low)
    n_atoms = int(atoms.weight_low.shape[0])
    product = torch.mm(x_low, atoms.weight_low.T, out=_scratch("product", (m, n_atoms), low))  # [m, n_atoms]
    approx = _scratch("approx", (m, n_atoms), torch.float32).copy_(product)
    unscale = x_scale * atoms.low_scale
    if unscale != 1.0:
        approx.div_(unscale)  # a power of two: exact
    back = x_low.float() / x_scale if x_scale != 1.0 else x_low.float()
    g = _gamma(d + 1)
    row_a = back.norm(dim=-1)
    row_b = (x - back).norm(dim=-1) + g * x.norm(dim=-1)
    unit = FP16_UNIT if low == torch.float16 else BF16_UNIT
    rel = BOUND_SAFETY * (unit / (1 - unit) + 4 * FP32_UNIT)
    # fp32 sums that flush to zero; for fp16 also an output below 2^-14 (subnormal: an absolute, not a relative error)
    tiny = (d + 1) * 2.0 ** -126 + (FP16_SUBNORMAL / unscale if low == torch.float16 else 0.0)
    best, pick, rescored = torch.empty(m), torch.empty(m, dtype=torch.long), 0
    for a, b, scale in blocks:
        if b <= a:
            continue
        part = _block_best(approx[a:b], z[a:b], off[a:b], row_a[a:b], row_b[a:b], atoms, scale,
                           chosen[a:b], rel, tiny)
        best[a:b], pick[a:b] = part[0], part[1]
        rescored += part[2]
    return best, pick, rescored


def _block_best(approx: torch.Tensor, z: torch.Tensor, off: torch.Tensor, row_a: torch.Tensor, row_b: torch.Tensor,
                atoms: Bf16Atoms, scale: torch.Tensor | None, chosen: torch.Tensor, rel: float, tiny: float,
                ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Steps 2-3 of :func:`bounded_best` for one block of rows: ``approx`` their unscaled low-precision scores
    (a view, scaled and masked in place)."""
    m = approx.shape[0]
    n_atoms = approx.shape[1]
    if scale is not None:
        approx.mul_(scale)  # in place on fp32: ~20x faster than torch.mul(bf16, fp32), which promotes element-wise
    if chosen.numel():
        approx.scatter_(1, chosen, -math.inf)
    top, at = _row_best(approx)
    col_a = atoms.alpha if scale is None else atoms.alpha * scale
    col_b = atoms.beta if scale is None else atoms.beta * scale
    flush = tiny * (1.0 if scale is None else float(scale.max()))
    eps_top = BOUND_SAFETY * (row_a * col_a[at] + row_b * col_b[at] + flush) + rel * top.abs()
    floor = top - eps_top
    margin = BOUND_SAFETY * (row_a * float(col_a.max()) + row_b * float(col_b.max()) + flush)
    gap = floor - margin
    threshold = torch.where(gap > 0, gap / (1 + rel), gap / (1 - rel))
    # approx >= threshold, as a max over rows of the difference (the sign of a float difference is exact; -0 only
    # adds a column): ~2x faster than a boolean any over the rows
    union = torch.sub(approx, threshold[:, None], out=_scratch("difference", tuple(approx.shape), torch.float32)
                      ).amax(dim=0) >= 0
    n = int(union.sum())
    if n > MAX_RESCORE_FRACTION * n_atoms:
        columns = torch.arange(n_atoms)
        rows = atoms.weight
    else:
        # the same test atom by atom (its own eps_t) on those columns only: fewer fp32 rows to gather and score
        wide = union.nonzero()[:, 0]
        sub = approx.index_select(1, wide)
        eps = (BOUND_SAFETY * (row_a[:, None] * col_a[wide] + row_b[:, None] * col_b[wide] + flush)
               + rel * sub.abs())
        keep = (torch.isfinite(sub) & (sub + eps >= floor[:, None])).any(dim=0)
        columns = wide[keep]
        rows = _rows(atoms.weight, columns)
    exact = torch.addmm(off[:, None], z, rows.T)
    if scale is not None:
        exact.mul_(scale[columns])
    if chosen.numel():  # a chosen atom's column among the re-scored ones (its low-precision score was -inf) is masked
        where = torch.full((n_atoms,), int(columns.numel()), dtype=torch.long)
        where[columns] = torch.arange(int(columns.numel()))
        mask = torch.zeros(m, int(columns.numel()) + 1, dtype=torch.bool).scatter_(1, where[chosen], True)
        exact.masked_fill_(mask[:, :-1], -math.inf)
    best, j = exact.max(-1)
    return best, columns[j], int(columns.numel())


_SCRATCH = threading.local()


def _scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A buffer of ``shape`` kept per thread and reused: the selection's ``[rows, n_atoms]`` temporaries run to
    tens of MB, and a fresh one each greedy step costs its page faults (about a third of a stacked step's time,
    measured at 252 rows over a 49k vocabulary). Its contents are garbage until written."""
    store = getattr(_SCRATCH, "buffers", None)
    if store is None:
        store = _SCRATCH.buffers = {}
    size = math.prod(shape)
    buffer = store.get((name, dtype))
    if buffer is None or buffer.numel() < size:
        buffer = store[(name, dtype)] = torch.empty(size, dtype=dtype)
    return buffer[:size].view(shape)


def _row_best(a: Float[torch.Tensor, "m n"], width: int = 1024) -> tuple[Float[torch.Tensor, " m"], Int[torch.Tensor, " m"]]:
    """The largest value of each row of ``a`` and an index where it sits (any one, when several tie).

    ``Tensor.max(dim)`` walks a wide matrix one row at a time with its index; this takes the block maxima
    (``amax``, vectorised), then the best block of each row only: ~10x faster at ``[64, 49152]``.
    """
    n = a.shape[1]
    full = n - n % width
    if full < 4 * width:
        return a.max(-1)
    block_max = a[:, :full].unflatten(1, (full // width, width)).amax(-1)  # a view: no copy
    if full < n:
        block_max = torch.cat([block_max, a[:, full:].amax(-1, keepdim=True)], dim=1)
    start = block_max.argmax(-1) * width
    index = (start[:, None] + torch.arange(width)).clamp_max(n - 1)  # the tail block repeats its last column
    values = a.gather(1, index)
    inner = values.argmax(-1)
    return values.gather(1, inner[:, None])[:, 0], index.gather(1, inner[:, None])[:, 0]


def _rows(weight: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``weight[index]`` gathered along the contiguous side (a transposed view gathers columns of its base)."""
    if not weight.is_contiguous() and weight.T.is_contiguous():
        return weight.T.index_select(1, index).T
    return weight.index_select(0, index)


def greedy_pursuit(x: Float[torch.Tensor, "n d"], k: int, *,
                   correlate: Callable[[torch.Tensor], torch.Tensor],
                   fetch: Callable[[torch.Tensor], torch.Tensor],
                   method: str = "gradient_pursuit", select: Select | None = None,
                   groups: Int[torch.Tensor, " n"] | None = None) -> Pursuit:
    """The pursuit of the module docstring for rows ``x [n, d]``, with the dictionary given by two functions.

    Args:
        x: targets ``[n, d]`` (any float dtype; the fit runs in float64).
        k: greedy steps (atoms selected at most), ``>= 1``.
        correlate: fp32 residuals ``[n, d]`` -> their correlations ``[n, n_atoms]`` with the *unit* atoms.
        fetch: atom indices ``LongTensor[m]`` -> those unit atoms ``[m, d]``.
        method: ``"gradient_pursuit"`` or ``"nnls"``.
        select: optional fp32 residuals ``[m, d]`` and the atoms each row has chosen ``int64[m, s]`` -> the best
            correlation and its atom per row (``[m]``, ``[m]``), for a faster exact selection
            (:func:`bounded_best`); ``correlate`` is used otherwise.
        groups: optional ``int64[n]``, nondecreasing: each row's dictionary, for rows of several dictionaries in one
            pursuit (J-space layers sharing one head). ``select`` and ``fetch`` then also take the groups of the rows
            they are given (a third and a second argument), in the same nondecreasing order.
    """
    check_method(method)
    if groups is not None and select is None:
        raise ValueError("Rows of several dictionaries (groups) need a select that takes their groups.")
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
            if select is not None:
                best, pick = (select(r[alive].float(), idx[alive, :step]) if groups is None else
                              select(r[alive].float(), idx[alive, :step], groups[alive]))  # type: ignore[call-arg]
            else:
                corr = correlate(r[alive].float())  # [m, n_atoms]
                if step:
                    corr = corr.scatter_(1, idx[alive, :step], -torch.inf)
                best, pick = corr.max(-1)
            ok = best.double() > POSITIVE_TOL * xnorm[alive]
            live_rows = rows[alive]
            alive[live_rows[~ok]] = False
            live_rows, pick = live_rows[ok], pick[ok]
        else:
            live_rows = rows[:0]
        if live_rows.numel():
            new = (fetch(pick) if groups is None else fetch(pick, groups[live_rows])).double()  # type: ignore[call-arg]
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


__all__ = ["METHODS", "Bf16Atoms", "Pursuit", "bounded_best", "bounded_best_blocks", "fp16_selection_available", "greedy_pursuit",
           "kkt_violation", "nnls_gram", "pursuit"]
