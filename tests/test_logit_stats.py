"""reading/logit_stats: the statistic kernels (final distribution, entropy / KL / CE of centred logits, ranks)
against float64 computations."""

from __future__ import annotations

import math

import numpy as np
import torch

from jlens_core.reading.logit_stats import centred_logit_stats, final_distribution, rank_of


def test_final_distribution_matches_float64():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 40000, generator=gen) * 8 + 60
    logits[1, 11] = float("-inf")  # a token the model rules out
    before = logits.clone()
    p, neg_entropy = final_distribution(logits)
    logp = logits.double().log_softmax(-1)
    exact = torch.where(logp.exp() > 0, logp.exp() * logp, 0).sum(-1)
    torch.testing.assert_close(p.double(), logp.exp(), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(neg_entropy, exact, rtol=0, atol=1e-7)
    assert p.dtype == torch.float32 and neg_entropy.dtype == torch.float64 and p[1, 11] == 0
    assert torch.equal(logits, before)


def test_centred_logit_stats_match_float64_on_large_logits():
    torch.manual_seed(0)
    z = torch.randn(3, 4, 500) * 30 + 100  # large logits: the cancelling terms are ~1e3 nats
    z[0, 1, 7] = float("-inf")  # a token the lens rules out
    final = torch.randn(4, 500) * 5
    nxt = torch.tensor([3, 7, -1, 499])
    exact_lp = z.double().log_softmax(-1)
    q = final.double().log_softmax(-1)
    entropy = -torch.where(exact_lp.exp() > 0, exact_lp.exp() * exact_lp, 0).sum(-1) / math.log(2)
    kl = (q.exp() * (q - exact_lp)).sum(-1) / math.log(2)
    ce = -exact_lp.gather(-1, nxt.clamp_min(0).expand(3, 4)[..., None])[..., 0] / math.log(2)
    ranks = (z[..., None, :] > z.gather(-1, nxt.clamp_min(0).expand(3, 4)[..., None])[..., None]).sum(-1)[..., 0] + 1
    final_p, final_neg_entropy = final_distribution(final)
    centred = z.clone()
    _, got_entropy, got_kl, got_ce = centred_logit_stats(centred, final_p, final_neg_entropy, nxt)
    np.testing.assert_allclose(got_entropy.numpy(), entropy.numpy(), atol=1e-4)
    np.testing.assert_allclose(got_kl.numpy(), kl.numpy(), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got_ce[..., :2].numpy(), ce[..., :2].numpy(), rtol=1e-5)
    assert torch.isnan(got_ce[..., 2]).all() and torch.isinf(kl[0, 1]) == torch.isinf(got_kl[0, 1])
    assert torch.equal(rank_of(centred, nxt.clamp_min(0).expand(3, 4)), ranks)


def test_centred_logit_stats_hold_float64_precision_over_a_large_vocabulary():
    # a 50k vocabulary and logits spread like an early layer's: sums accumulated in sequence (a BLAS dot
    # product) drift by ~1e-3 bits here; the pairwise reductions stay within 1e-4
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(2, 6, 50000, generator=gen) * 6 + 40
    final = torch.randn(6, 50000, generator=gen) * 6
    nxt = torch.arange(6) * 7
    lp, q = z.double().log_softmax(-1), final.double().log_softmax(-1)
    kl = (q.exp() * (q - lp)).sum(-1) / math.log(2)
    entropy = -(lp.exp() * lp).sum(-1) / math.log(2)
    final_p, final_neg_entropy = final_distribution(final)
    _, got_entropy, got_kl, _ = centred_logit_stats(z.clone(), final_p, final_neg_entropy, nxt)
    np.testing.assert_allclose(got_kl.numpy(), kl.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(got_entropy.numpy(), entropy.numpy(), atol=1e-4, rtol=0)

