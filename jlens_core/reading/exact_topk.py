"""The head's top k and ranks from bf16 logits, exact: bit-identical to the fp32 product ``x @ W.T``.

A reading's main cost is the head, ``[rows, d] @ [d, vocab]``, and bf16 matmuls run 2-4x faster than fp32 on
CPUs with AVX512-BF16 or AMX-BF16 (:mod:`jlens_core.models.cpu_features`). bf16 logits alone would change
which tokens a reading reports; this module ranks with them and stays exact:

1. ``z~ = bf16(x) @ bf16(W).T``, accumulated in fp32 and rounded to bf16 (torch's CPU bf16 matmul).
2. A bound ``|z~_v - z_v| <= eps_v`` for every token ``v``, where ``z = x @ W.T`` is the fp32 product (below).
3. The **candidates** of a row: every token whose upper bound ``z~_v + eps_v`` reaches the k-th largest lower
   bound ``z~ - eps`` of the row. A token outside has ``z_v`` below at least k tokens' ``z``: it cannot be in
   the top k, nor tie with its last member. For the rank of a token ``t``: every token whose interval
   ``[z~_v - eps_v, z~_v + eps_v]`` contains ``z_t`` is a candidate; the others are counted from the bound alone.
4. The candidates' columns, the union over all rows, are re-scored in fp32 as ``x @ W[union].T`` with the
   **same rows** ``x``: a GEMM's column is computed the same way whichever other columns it has (measured on
   MKL for at least :data:`MIN_RESCORE_COLUMNS` columns; a GEMM of other rows, or of one column, rounds
   differently), so the re-scored logits are the fp32 product's bits. Where the union exceeds
   :data:`MAX_RESCORE_FRACTION` of the vocabulary, the full fp32 product is computed instead (the fallback).

The bound (Higham's for dot products; ``u = 2^-8`` bf16's unit roundoff, ``g = d u32 / (1 - d u32)`` with
``u32 = 2^-24``, ``A_v = sum_i |x_i W_vi| <= ||x|| ||W_v||``): the fp32 product is within ``g A`` of the exact
dot product; the bf16 one within ``(2u + u^2 + g (1 + u)^2) A`` before its output rounding and
``u |z~| / (1 - u)`` after it. :data:`SAFETY` doubles the sum, for a library that blocks its sums otherwise.

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
SAFETY = 2.0
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


def bf16_logit_bound(x: torch.Tensor, weight_norms: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    """``eps [rows, vocab]`` with ``|approx - x @ W.T| <= eps`` entrywise (the module's bound), fp32.

    Args:
        x: ``[rows, d]`` the head's input (fp32).
        weight_norms: ``[vocab]`` the L2 norms of ``W``'s rows (fp32).
        approx: ``[rows, vocab]`` the bf16 product as fp32 (not modified).

    Besides the error bound it holds a margin of 16 fp32 ulps of the row's largest logit (see the comment).
    """
    d = x.shape[-1]
    u, g = BF16_UNIT, d * FP32_UNIT / (1 - d * FP32_UNIT)
    per_a = SAFETY * (2 * u + u * u + g * (1 + u) ** 2 + g)
    per_z = SAFETY * u / (1 - u)
    x_norm = x.float().norm(dim=-1, keepdim=True) * per_a  # [rows, 1]
    eps = torch.mul(x_norm, weight_norms.float()[None, :])  # [rows, vocab]
    # tiny products flushed to zero (bf16 FMA units flush denormals): an absolute term far below any gap; and a
    # row's margin of 16 fp32 ulps of its largest logit, so a token left out stays below the k-th value also
    # once a caller centres the row (fl(z - max) can make near-ties equal, never reverse an order)
    margin = approx.abs().amax(dim=-1, keepdim=True).mul_(16 * FP32_UNIT).add_(d * 2.0 ** -126)
    return eps.add_(approx.abs(), alpha=per_z).add_(margin)


def exact_top_k(x: torch.Tensor, weight: torch.Tensor, k: int, *, weight_bf16: torch.Tensor | None = None,
                weight_norms: torch.Tensor | None = None, rank_ids: torch.Tensor | None = None,
                centred: bool = False) -> ExactTopK:
    """The top ``k`` tokens of ``x @ weight.T`` (and the rank of ``rank_ids``) from bf16 logits, exact.

    Args:
        x: ``[rows, d]`` the head's input, fp32 (after the final norm).
        weight: ``[vocab, d]`` the head's fp32 weight.
        k: tokens per row (1 <= k <= vocab).
        weight_bf16 / weight_norms: ``weight`` in bf16 and its rows' L2 norms, when the caller keeps them
            (made here otherwise; a caller reading many chunks keeps them once).
        rank_ids: ``int64[rows]``, one token per row whose rank to give exactly.
        centred: give the logits, top k and ranks of ``z - max(z)`` per row as fp32 computes it (what the
            reading's statistics kernels rank, :func:`~jlens_core.reading.logit_stats.centred_logit_stats`).

    Returns:
        :class:`ExactTopK`: ids and logits equal (bits included) to ``torch.topk(x @ weight.T, k)`` for the same
        ``x``, ranks equal to counting on the fp32 product.

    Raises:
        ValueError: ``k`` out of range, or shapes that do not match (one sentence naming them).
    """
    rows, d = x.shape
    vocab = weight.shape[0]
    if weight.shape[1] != d:
        raise ValueError(f"x has width {d} but weight is {tuple(weight.shape)}: give the head's [vocab, d] weight.")
    if not 1 <= k <= vocab:
        raise ValueError(f"k={k} must be between 1 and the vocabulary size {vocab}.")
    x = x.float()
    wb = weight_bf16 if weight_bf16 is not None else weight.to(torch.bfloat16)
    norms = weight_norms if weight_norms is not None else weight.float().norm(dim=-1)
    approx = (x.to(torch.bfloat16) @ wb.t()).float()  # [rows, vocab]
    eps = bf16_logit_bound(x, norms, approx)
    upper = torch.add(approx, eps)
    lower = approx.sub_(eps)  # approx is not needed past here
    del eps
    kth_lower = lower.topk(k, dim=-1).values[:, -1:]  # [rows, 1]
    candidate = upper >= kth_lower  # [rows, vocab]
    if rank_ids is not None:
        # z_t is unknown until re-scored: its own interval bounds it, and every interval meeting that one is a
        # candidate (the others lie wholly above or below z_t)
        t_low = lower.gather(-1, rank_ids[:, None])
        t_high = upper.gather(-1, rank_ids[:, None])
        candidate |= (upper >= t_low) & (lower <= t_high)
        candidate.scatter_(-1, rank_ids[:, None], True)
    columns = candidate.any(dim=0).nonzero()[:, 0]  # [n] union over rows, ascending
    if columns.numel() > MAX_RESCORE_FRACTION * vocab:
        full = x @ weight.float().t()
        if centred:
            full.sub_(full.amax(dim=-1, keepdim=True))
        values, ids = full.topk(k, dim=-1)
        ranks = None
        if rank_ids is not None:
            picked = full.gather(-1, rank_ids[:, None])
            ranks = (full > picked).sum(dim=-1) + 1
        return ExactTopK(ids, values, ranks, vocab, True)
    columns = _padded(columns, vocab)
    rescored = x @ weight.float()[columns].t()  # [rows, n]: the fp32 product's bits (same x)
    row = torch.full((rows, vocab), float("-inf"))
    # a row's non-candidates stay -inf: strictly below its k-th value, so topk picks what it picks on the full row
    row.scatter_(-1, columns[None, :].expand(rows, -1), rescored)
    row.masked_fill_(~candidate, float("-inf"))
    sure = None
    if rank_ids is not None:  # above z_t for sure: a non-candidate's lower bound past it (by the margin)
        sure = ((lower > row.gather(-1, rank_ids[:, None])) & ~candidate).sum(dim=-1)
    if centred:  # the row's maximum is a candidate (the top 1 is): fl(z - max) as on the full row
        row.sub_(row.amax(dim=-1, keepdim=True))
    values, ids = row.topk(k, dim=-1)
    ranks = None
    if rank_ids is not None and sure is not None:
        picked = row.gather(-1, rank_ids[:, None])  # [rows, 1] exact
        ranks = sure + (row > picked).sum(dim=-1) + 1  # the candidates counted on their exact logits
    return ExactTopK(ids, values, ranks, int(columns.numel()), False)


def _padded(columns: torch.Tensor, vocab: int) -> torch.Tensor:
    """``columns`` with the lowest other columns added up to :data:`MIN_RESCORE_COLUMNS` (or the vocabulary)."""
    want = min(vocab, MIN_RESCORE_COLUMNS)
    if columns.numel() >= want:
        return columns
    taken = torch.zeros(vocab, dtype=torch.bool)
    taken[columns] = True
    extra = (~taken).nonzero()[:, 0][: want - columns.numel()]
    return torch.cat([columns, extra]).sort().values


def head_parts(model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(weight, weight_bf16, weight_norms)`` of ``model``'s head when its logits are ``norm(h) @ W.T`` alone
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
    parts = (weight, weight.to(torch.bfloat16), weight.norm(dim=-1))
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
    return exact_top_k(x.float(), weight, k, weight_bf16=weight_bf16, weight_norms=norms, rank_ids=rank_ids)


__all__ = ["BF16_UNIT", "MAX_RESCORE_FRACTION", "MIN_RESCORE_COLUMNS", "SAFETY", "ExactTopK", "bf16_logit_bound",
           "exact_top_k", "head_parts", "model_top_k"]
