"""Statistic kernels over lens logits: entropy, KL, next-token CE and ranks, in bits (docs/method.md §6).

**Ranks** are 1-based over the full vocabulary: ``rank = 1 + #{v : logit_v > logit_t}``, so the
top-1 token has rank 1 and ``rank <= k`` means "in the top k". Ties share the best rank. Ranks are
computed from fp32 logits (cast from the model's dtype).

Memory: a reading computes logits for a chunk of positions and a group of layers at a time (at most
``CHUNK_ELEMENTS`` logits per array); the statistics then pass over ``STATS_BLOCK_ELEMENTS`` of them
at a time, a block that stays in the CPU's cache. Used by readings, :mod:`~jlens_core.evaluation.by_layer`
and :mod:`~jlens_core.evaluation.passk`.
"""

from __future__ import annotations

import math

import torch

LN2 = math.log(2.0)
# Logits held per array while reading (positions per chunk = CHUNK_ELEMENTS // vocab, at least 1).
CHUNK_ELEMENTS = 1 << 24
# Logits the statistics pass over at a time (about 8 MB of fp32): a block and its scratch stay in the
# CPU's cache across the dozen passes, instead of streaming a CHUNK_ELEMENTS array from memory each time.
STATS_BLOCK_ELEMENTS = 1 << 21


def rank_of(logits: torch.Tensor, ids: torch.Tensor, scratch: torch.Tensor | None = None,
            kept: torch.Tensor | None = None) -> torch.Tensor:
    """1-based rank of ``ids`` among ``logits``: ``1 + #{v : logits[..., v] > logits[..., id]}``.

    The count runs as a matrix product (:func:`row_sums`), several times faster on the CPU than
    summing a bool array.

    Args:
        logits: ``[..., vocab]`` floats.
        ids: ``LongTensor[...]``, one id per row.
        scratch: overwritten if given (same shape and dtype as ``logits``), saving an array (and its
            page faults) per call.
        kept: ``[vocab]`` 0/1 in ``logits``' dtype: only ids with a 1 are counted above (the
            word-token readout, docs/method.md §9.1); the id itself need not be kept.

    Returns:
        ``LongTensor[...]``.
    """
    value = logits.gather(-1, ids.unsqueeze(-1))  # [..., 1]
    above = torch.gt(logits, value, out=scratch) if scratch is not None else (logits > value).to(logits.dtype)
    return row_sums(above, kept).long() + 1


def final_distribution(final_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's final distribution, as :func:`centred_logit_stats` needs it.

    Computed like the lens statistics, from centred fp32 logits ``z`` (row maximum 0): with
    ``S = sum exp(z)``, ``p = exp(z) / S`` and ``sum p log p = sum p z - log S``, so no float64 pass
    over the vocabulary is needed; the sums accumulate in float64.

    Args:
        final_logits: ``[c, vocab]``, any float dtype (not modified).

    Returns:
        ``(final_p [c, vocab] fp32, final_neg_entropy [c] float64)``: probabilities and
        ``sum p log p`` in nats.
    """
    z = final_logits.float()
    z = z - z.amax(dim=-1, keepdim=True)  # [c, vocab] max 0 per row
    z.clamp_min_(-1e30)  # a ruled-out (-inf) token: p = 0 and p * z = 0, not NaN
    p = z.exp()  # [c, vocab] unnormalised
    # float64 accumulators: sum p log p is the large term KL cancels against (~1e-9 nats, not ~1e-6)
    total = p.sum(dim=-1, dtype=torch.float64)  # [c] >= 1
    neg_entropy = torch.mul(p, z).sum(dim=-1, dtype=torch.float64) / total - total.log()  # [c]
    return p.div_(total.float()[:, None]), neg_entropy


def row_sums(x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``x.sum(-1)`` of 0/1 values as a matrix-vector product: ``[..., vocab] -> [...]``.

    Several times faster on the CPU than a reduction over a bool array, and exact for counts below
    2**24; not for general floats (a BLAS sum accumulates in sequence). ``weights`` (``[vocab]`` 0/1,
    ``x``'s dtype) counts only the columns it marks, at the same cost.
    """
    if weights is None:
        weights = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    return (x.reshape(-1, x.shape[-1]) @ weights.reshape(-1, 1)).view(x.shape[:-1])


def centred_logit_stats(z: torch.Tensor, final_p: torch.Tensor, final_neg_entropy: torch.Tensor,
                        next_ids: torch.Tensor, scratch: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entropy, KL(final || lens) and next-token CE from lens logits, in bits, centring ``z`` in place.

    Each row of ``z`` has its maximum subtracted (ranks and top-k are unchanged by it). With
    ``s = log sum exp(z)`` of the centred logits and ``p`` the lens distribution: ``H = s - sum p z``,
    ``KL = sum q log q - sum q z + s`` (``q`` the final distribution), ``CE = s - z[next]``. Centring
    keeps the cancelling terms small, so fp32 holds them to ~1e-5 bits. A few passes over the logits
    instead of materialising ``log_softmax``.

    Args:
        z: ``[..., c, vocab]`` lens logits, fp32; centred in place (``-inf`` becomes ``-1e30``).
        final_p / final_neg_entropy: from :func:`final_distribution`, ``[c, vocab]`` / ``[c]``.
        next_ids: ``LongTensor[c]``; a negative id means "no next token" (CE is NaN there).
        scratch: overwritten; same shape and dtype as ``z``. Reusing one buffer across calls saves
            the page faults of a fresh array per call, which on the CPU cost more than the arithmetic.

    Returns:
        ``(log_norm [..., c], entropy_bits, kl_bits, ce_bits)``, each ``[..., c]``; ``log_norm`` is
        ``s``, so ``log p_v = z_v - log_norm``. KL and entropy are clamped at 0 (rounding).
    """
    if scratch is None:
        scratch = torch.empty_like(z)
    z.sub_(z.amax(dim=-1, keepdim=True)).clamp_min_(-1e30)  # max 0 per row; no -inf left to make 0 * inf
    # The float sums use torch's own reductions (pairwise, ~1e-7 relative over a 50k vocabulary): a
    # BLAS dot product or matrix-vector sum is faster but accumulates in sequence (1e-5..1e-4 here).
    p = torch.exp(z, out=scratch)  # [..., c, vocab] unnormalised, <= 1
    total = p.sum(dim=-1)  # [..., c] >= 1
    p_z = p.mul_(z).sum(dim=-1) / total  # sum p z, p normalised
    log_norm = total.log()
    entropy = (log_norm - p_z).clamp_min(0.0) / LN2
    q_z = torch.mul(z, final_p, out=scratch).sum(dim=-1)  # [..., c]
    kl = (final_neg_entropy.to(z.dtype) - q_z + log_norm).clamp_min(0.0) / LN2
    kl = torch.where(kl < 1e20, kl, torch.full_like(kl, float("inf")))  # final mass on a ruled-out (-inf) token
    picked = z.gather(-1, next_ids.clamp_min(0).expand(total.shape).unsqueeze(-1))[..., 0]
    picked = torch.where(picked > -1e30, picked, torch.full_like(picked, float("-inf")))  # a ruled-out token
    ce = torch.where(next_ids >= 0, (log_norm - picked) / LN2, torch.full_like(log_norm, float("nan")))
    return log_norm, entropy, kl, ce


def chunk_size(vocab_size: int) -> int:
    """Rows (positions, or layer x position pairs) per ``[rows, vocab]`` array of at most ``CHUNK_ELEMENTS``."""
    return max(1, CHUNK_ELEMENTS // max(1, int(vocab_size)))


__all__ = ["CHUNK_ELEMENTS", "LN2", "STATS_BLOCK_ELEMENTS", "centred_logit_stats", "chunk_size", "final_distribution",
           "rank_of", "row_sums"]
