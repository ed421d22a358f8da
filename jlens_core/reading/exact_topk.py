"""The head's top k and ranks from bf16 logits, exact: bit-identical to the fp32 product ``x @ W.T``.

A reading's main cost is the head, ``[rows, d] @ [d, vocab]``, and bf16 matmuls run 2-4x faster than fp32 on
CPUs with AVX512-BF16 or AMX-BF16 (:mod:`jlens_core.models.cpu_features`). bf16 logits alone would change
which tokens a reading reports; this module ranks with them and stays exact:

1. ``z~ = bf16(x) @ bf16(W).T``, accumulated in fp32 and rounded to bf16 (torch's CPU bf16 matmul).
2. A bound ``eps`` per row with ``|z~_v - z_v| <= eps`` for every token ``v``, where ``z = x @ W.T`` is the fp32
   product (below).
3. The **candidates** of a row: every token with ``z~_v >= z~_(k) - 2 eps`` (``z~_(k)`` the row's k-th largest bf16
   logit). A token outside has ``z_v < z~_(k) - eps``, below at least k tokens' ``z``: it cannot be in the top k,
   nor tie with its last member. For the rank of a token ``t``: every token with ``|z~_v - z~_t| <= 2 eps``;
   the others lie above or below ``z_t`` for sure and are counted from the bf16 logits alone.
4. The candidates' columns, the union over all rows, are re-scored in fp32 as ``x @ W[union].T`` with the
   **same rows** ``x``: a GEMM's column is computed the same way whichever other columns it has (measured on
   MKL for at least :data:`MIN_RESCORE_COLUMNS` columns; a GEMM of other rows, or of one column, rounds
   differently), so the re-scored logits are the fp32 product's bits, for every row. Where the union exceeds
   :data:`MAX_RESCORE_FRACTION` of the vocabulary, the full fp32 product is computed instead (the fallback).

The bound, with ``x~ = bf16(x)``, ``r = x - x~``, ``W~ = bf16(W)``, ``R = W - W~`` (all exact in fp32), ``u = 2^-8``
(bf16's unit roundoff) and ``g = d u32 / (1 - d u32)``, ``u32 = 2^-24``: ``x.w = x~.w~ + x~.R_v + r.w``, so
``|x.w - x~.w~| <= ||x~|| max||R_v|| + ||r|| max||W_v||``; the bf16 products are exact in fp32 and summed
there, within ``g ||x~|| max||W~_v||``, then rounded to bf16, within ``u |z~| / (1 - u)``; the fp32 product is within
``g ||x|| max||W_v||`` of the exact one. Plus 16 fp32 ulps of the row's largest logit, so that a token left out
stays below the k-th value also once a caller centres the row (``fl(z - max)`` can make near-ties equal, never
reverse them). Each term holds for any order of summation, so for any blocking a library does; :data:`SAFETY`
(1) scales the sum, a knob for a kernel that would not accumulate bf16 products in fp32.

Probabilities, entropy, KL and cross-entropy need the fp32 log-normaliser over the whole vocabulary, i.e. every
fp32 logit: they cannot be made exact this way (a bf16 normaliser is within ``max eps`` nats, not bit-identical),
so readings that report them keep the fp32 head; what ranks only (pass@k, a study's onsets, the say search's
ranking) can take this path (``bench/bf16_readout.py`` measures both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BF16_UNIT = 2.0 ** -8
FP32_UNIT = 2.0 ** -24
SAFETY = 1.0
# A re-score GEMM narrower than this may take another kernel (a GEMV for one column), which rounds otherwise.
MIN_RESCORE_COLUMNS = 256
# Past this share of the vocabulary, re-scoring costs about what the full fp32 product does: compute that.
MAX_RESCORE_FRACTION = 0.5


@dataclass(frozen=True)
class ExactTopK:
    """The top k of ``x @ W.T`` per row, and ranks, as the fp32 product gives them.

    Attributes:
        ids: ``int64[rows, k]``, largest logit first (``torch.topk``'s order over the full row).
        logits: ``float32[rows, k]``, bit-identical to the fp32 product's entries.
        ranks: ``int64[rows]``, 1-based rank of the asked token of each row (``1 + #{v : z_v > z_t}``), or
            ``None`` when no token was asked for.
        n_rescored: columns re-scored in fp32 (the union of candidates, padded), or the vocabulary size when
            the full fp32 product was computed (:attr:`fallback`).
        fallback: whether the full fp32 product was computed.
    """

    ids: torch.Tensor
    logits: torch.Tensor
    ranks: torch.Tensor | None
    n_rescored: int
    fallback: bool


def head_norms(weight: torch.Tensor, weight_bf16: torch.Tensor) -> tuple[float, float, float]:
    """``(max ||W_v||, max ||bf16(W)_v||, max ||W_v - bf16(W)_v||)`` over the head's rows, the bound's weight terms."""
    w = weight.float()
    w16 = weight_bf16.float()
    return (float(w.norm(dim=-1).max()), float(w16.norm(dim=-1).max()), float((w - w16).norm(dim=-1).max()))


def bf16_row_bound(x: torch.Tensor, x_bf16: torch.Tensor, norms: tuple[float, float, float],
                   abs_max: torch.Tensor) -> torch.Tensor:
    """``eps [rows, 1]``: ``|z~_v - (x @ W.T)_v| <= eps`` for every token ``v`` of the row (the module's bound),
    with its centring margin.

    Args:
        x: ``[rows, d]`` the head's input (fp32); ``x_bf16`` the same in bf16 (what the bf16 product used).
        norms: :func:`head_norms` of the head.
        abs_max: ``[rows]`` the largest ``|z~_v|`` of each row (fp32).
    """
    d = x.shape[-1]
    w_max, w16_max, r_w_max = norms
    u, g = BF16_UNIT, d * FP32_UNIT / (1 - d * FP32_UNIT)
    xb = x_bf16.float()
    n_x, n_xb, n_r = x.norm(dim=-1), xb.norm(dim=-1), (x - xb).norm(dim=-1)
    eps = n_xb * r_w_max + n_r * w_max + g * (n_xb * w16_max + n_x * w_max)
    eps = eps + abs_max * (u / (1 - u) + 16 * FP32_UNIT) + d * 2.0 ** -126  # output rounding, centring, flushes
    return (SAFETY * eps)[:, None]


def exact_top_k(x: torch.Tensor, weight: torch.Tensor, k: int, *, weight_bf16: torch.Tensor | None = None,
                norms: tuple[float, float, float] | None = None, rank_ids: torch.Tensor | None = None,
                centred: bool = False) -> ExactTopK:
    """The top ``k`` tokens of ``x @ weight.T`` (and the rank of ``rank_ids``) from bf16 logits, exact.

    Args:
        x: ``[rows, d]`` the head's input, fp32 (after the final norm).
        weight: ``[vocab, d]`` the head's fp32 weight.
        k: tokens per row (1 <= k <= vocab).
        weight_bf16 / norms: ``weight`` in bf16 and its :func:`head_norms`, when the caller keeps them (made
            here otherwise; a caller reading many chunks keeps them once, :func:`head_parts`).
        rank_ids: ``int64[rows]``, one token per row whose rank to give exactly.
        centred: give the logits, top k and ranks of ``z - max(z)`` per row as fp32 computes it (what the
            reading's statistics kernels rank, :func:`~jlens_core.reading.logit_stats.centred_logit_stats`).

    Returns:
        :class:`ExactTopK`: ids and logits equal (bits included) to ``torch.topk(x @ weight.T, k)`` for the same
        ``x``, ranks equal to counting on the fp32 product.

    Raises:
        ValueError: ``k`` out of range, or shapes that do not match (one sentence naming them).
    """
    d = x.shape[1]
    vocab = weight.shape[0]
    if weight.shape[1] != d:
        raise ValueError(f"x has width {d} but weight is {tuple(weight.shape)}: give the head's [vocab, d] weight.")
    if not 1 <= k <= vocab:
        raise ValueError(f"k={k} must be between 1 and the vocabulary size {vocab}.")
    x = x.float()
    wb = weight_bf16 if weight_bf16 is not None else weight.to(torch.bfloat16)
    norms = norms if norms is not None else head_norms(weight, wb)
    xb = x.to(torch.bfloat16)
    approx = (xb @ wb.t()).float()  # [rows, vocab]
    low, high = torch.aminmax(approx, dim=-1)
    eps2 = 2 * bf16_row_bound(x, xb, norms, torch.maximum(low.abs(), high.abs()))  # [rows, 1]
    kth = approx.topk(k, dim=-1).values[:, -1:]
    union = (approx >= kth - eps2).any(dim=0)  # [vocab]
    if rank_ids is not None:
        at = approx.gather(-1, rank_ids[:, None])
        union |= ((approx - at).abs_() <= eps2).any(dim=0)
        union[rank_ids] = True
    n = int(union.sum())
    if n > MAX_RESCORE_FRACTION * vocab:
        full = x @ weight.float().t()
        if centred:
            full.sub_(full.amax(dim=-1, keepdim=True))
        values, ids = full.topk(k, dim=-1)
        ranks = None
        if rank_ids is not None:
            ranks = (full > full.gather(-1, rank_ids[:, None])).sum(dim=-1) + 1
        return ExactTopK(ids, values, ranks, vocab, True)
    columns = _padded(union.nonzero()[:, 0], vocab)  # ascending: ties keep the full row's index order
    exact = x @ weight.float()[columns].t()  # [rows, n]: the fp32 product's bits (same x), every row
    sure = None
    if rank_ids is not None:  # above z_t for sure: outside the union, and 2 eps above the bf16 z~_t
        outside = torch.ones(vocab, dtype=torch.bool)
        outside[columns] = False
        sure = ((approx > at + eps2) & outside).sum(dim=-1)
    if centred:  # the row's maximum is in the union (the top 1 is): fl(z - max) as on the full row
        exact.sub_(exact.amax(dim=-1, keepdim=True))
    values, idx = exact.topk(k, dim=-1)
    ranks = None
    if rank_ids is not None and sure is not None:
        where = torch.searchsorted(columns, rank_ids.contiguous())  # rank_ids are in the union
        picked = exact.gather(-1, where[:, None])
        ranks = sure + (exact > picked).sum(dim=-1) + 1
    return ExactTopK(columns[idx], values, ranks, int(columns.numel()), False)


def _padded(columns: torch.Tensor, vocab: int) -> torch.Tensor:
    """``columns`` with the lowest other columns added up to :data:`MIN_RESCORE_COLUMNS` (or the vocabulary)."""
    want = min(vocab, MIN_RESCORE_COLUMNS)
    if columns.numel() >= want:
        return columns
    taken = torch.zeros(vocab, dtype=torch.bool)
    taken[columns] = True
    extra = (~taken).nonzero()[:, 0][: want - columns.numel()]
    return torch.cat([columns, extra]).sort().values


def head_parts(model) -> tuple[torch.Tensor, torch.Tensor, tuple[float, float, float]] | None:
    """``(weight, weight_bf16, head_norms)`` of ``model``'s head when its logits are ``norm(h) @ W.T`` alone
    (a bias-free linear head, no readout module, logit scale or soft-cap, vocabulary unpadded), so
    :func:`exact_top_k` applies to it; ``None`` otherwise (read those with the fp32 head).

    The hook readings use for the head (``lens.logits(model, h, layer)`` can route through it): the parts
    are kept on the model for the next call.
    """
    from torch import nn

    head = getattr(model, "head", None)
    if (not isinstance(head, nn.Linear) or head.bias is not None or getattr(model, "readout", None) is not None
            or getattr(model, "pre_head", None) or getattr(model, "softcap", None)
            or getattr(model, "logit_scale", 1.0) != 1.0 or head.weight.shape[0] != getattr(model, "vocab_size", -1)
            or head.weight.device.type != "cpu"):
        return None
    cached = getattr(model, "_jlens_exact_head", None)
    if cached is not None and cached[0] is head.weight:
        return cached[1]
    weight = head.weight.detach().float()
    weight_bf16 = weight.to(torch.bfloat16)
    parts = (weight, weight_bf16, head_norms(weight, weight_bf16))
    try:
        model._jlens_exact_head = (head.weight, parts)
    except AttributeError:
        pass
    return parts


def model_top_k(model, h: torch.Tensor, k: int, *, rank_ids: torch.Tensor | None = None) -> ExactTopK:
    """:func:`exact_top_k` of ``model``'s head on residuals ``h`` ``[rows, d]`` (pre-final-norm): the final norm in
    fp32, then the bf16 ranking. A model whose head is more than one matrix (:func:`head_parts` is ``None``)
    is read with its fp32 ``unembed`` (``fallback`` set).

    Raises:
        ValueError: ``k`` out of range.
    """
    parts = head_parts(model)
    if parts is None:
        full = model.unembed(h.float()).float()
        values, ids = full.topk(k, dim=-1)
        ranks = None
        if rank_ids is not None:
            ranks = (full > full.gather(-1, rank_ids[:, None])).sum(dim=-1) + 1
        return ExactTopK(ids, values, ranks, int(full.shape[-1]), True)
    x = h.to(model.dtype)
    if getattr(model, "final_norm", None) is not None:
        x = model.final_norm(x)
    weight, weight_bf16, norms = parts
    return exact_top_k(x.float(), weight, k, weight_bf16=weight_bf16, norms=norms, rank_ids=rank_ids)


__all__ = ["BF16_UNIT", "MAX_RESCORE_FRACTION", "MIN_RESCORE_COLUMNS", "SAFETY", "ExactTopK", "bf16_row_bound",
           "exact_top_k", "head_norms", "head_parts", "model_top_k"]
