"""The exact bf16 top k (jlens_core.reading.exact_topk): the same tokens, logits (bits) and ranks as fp32."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny

from jlens_core.reading import exact_topk
from jlens_core.reading.exact_topk import bf16_row_bound, exact_top_k, head_norms, head_parts, model_top_k


def _head(rows: int = 48, d: int = 64, vocab: int = 3000, seed: int = 0, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=g) * scale
    w = torch.randn(vocab, d, generator=g) / d ** 0.5
    return x, w


def _check_same(x, w, k, rank_ids=None, centred=False):
    full = x @ w.t()
    if centred:
        full = full - full.amax(dim=-1, keepdim=True)
    got = exact_top_k(x, w, k, rank_ids=rank_ids, centred=centred)
    values, ids = full.topk(k, dim=-1)
    assert torch.equal(got.ids, ids)
    assert torch.equal(got.logits, values)  # bits
    if rank_ids is not None:
        want = (full > full.gather(-1, rank_ids[:, None])).sum(-1) + 1
        assert torch.equal(got.ranks, want)
    return got


@pytest.mark.parametrize("centred", [False, True])
def test_same_tokens_logits_and_ranks_as_fp32(centred):
    x, w = _head(scale=3.0)
    near_top = (x @ w.t()).topk(20, dim=-1)[1][:, -1]  # each row's 20th token: a rank near the top
    got = _check_same(x, w, 10, near_top, centred)
    assert not got.fallback
    assert got.n_rescored < w.shape[0] / 2  # the point: far fewer fp32 columns than the vocabulary
    # a token in the bulk of the distribution: its interval meets most others', so most columns are re-scored
    # (or all, the fallback), and the rank is still exact
    bulk = torch.randint(0, w.shape[0], (x.shape[0],), generator=torch.Generator().manual_seed(1))
    _check_same(x, w, 10, bulk, centred)


def test_the_bound_holds():
    for seed, scale in ((0, 1.0), (1, 30.0), (2, 1e-3)):
        x, w = _head(seed=seed, scale=scale)
        xb, wb = x.bfloat16(), w.bfloat16()
        approx = (xb @ wb.t()).float()
        err = (approx - x @ w.t()).abs()
        eps = bf16_row_bound(x, xb, head_norms(w, wb), approx.abs().amax(-1))
        assert bool((err <= eps).all())
        assert float(err.max()) > 0  # bf16 does differ: the test can fail
        assert float((err.amax(-1, keepdim=True) / eps).max()) > 0.01  # and the bound is not vacuous


def test_near_ties_built_on_purpose():
    """Rows of W one fp32 ulp apart (and exact duplicates): the logits tie or nearly tie, far inside the bf16
    error, so only the fp32 re-score can order them; the top k and ranks still match fp32."""
    x, w = _head(rows=32, vocab=2000, seed=3)
    best = (x @ w.t()).argmax(-1)
    for j, b in enumerate(best.tolist()[:8]):
        w[100 + j] = w[b]  # an exact copy: a tie
        w[200 + j] = torch.nextafter(w[b], w[b] + 1)  # one ulp up in every entry: a near-tie
        w[300 + j] = torch.nextafter(w[b], w[b] - 1)  # one ulp down
    rank_ids = torch.cat([best[:8] + 0, torch.arange(200, 224)])
    for centred in (False, True):
        _check_same(x, w, 5, rank_ids, centred)
    approx = (x.bfloat16() @ w.bfloat16().t()).float()
    assert bool((approx[:8, 200:208].diagonal() == approx[:8, 300:308].diagonal()).any())  # bf16 can't tell


def test_fallback_is_the_fp32_product(monkeypatch):
    x, w = _head(seed=4)
    monkeypatch.setattr(exact_topk, "MAX_RESCORE_FRACTION", 0.0)
    got = _check_same(x, w, 7, torch.zeros(x.shape[0], dtype=torch.long))
    assert got.fallback and got.n_rescored == w.shape[0]


def test_bad_k_and_shapes():
    x, w = _head()
    with pytest.raises(ValueError, match="k=0"):
        exact_top_k(x, w, 0)
    with pytest.raises(ValueError, match="width"):
        exact_top_k(x[:, :10], w, 3)


def test_model_top_k_matches_the_reading_head():
    """On a tiny model's residuals: the same tokens and logits as its own fp32 unembed."""
    model = tiny("llama")
    assert head_parts(model) is not None
    ids = model.encode("The capital of France is Paris. Water boils at one hundred degrees.")
    with torch.no_grad():
        hs = model.hf_model(input_ids=ids, output_hidden_states=True).hidden_states
    h = torch.cat([hs[i][0] for i in range(1, model.n_layers)])  # every layer's residuals, one matrix
    full = model.unembed(h).float()
    got = model_top_k(model, h, 5, rank_ids=ids[0, : 1].expand(h.shape[0]))
    values, want = full.topk(5, dim=-1)
    assert torch.equal(got.ids, want) and torch.equal(got.logits, values)
    picked = full.gather(-1, ids[0, :1].expand(h.shape[0])[:, None])
    assert torch.equal(got.ranks, (full > picked).sum(-1) + 1)


def test_a_capped_head_reads_in_fp32():
    model = tiny("gemma2")  # a soft-capped head: more than one matrix
    assert head_parts(model) is None
    h = torch.randn(4, model.d_model)
    got = model_top_k(model, h, 3)
    assert got.fallback and torch.equal(got.ids, model.unembed(h).float().topk(3, dim=-1)[1])
