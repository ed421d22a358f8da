"""Expert lenses (issue #32 §1-2, docs/method.md §9.1 experts): clustering, the lens object, its file."""

from __future__ import annotations

import math

import pytest
import torch

from jlens_core import ExpertLens, JacobianLens, LensFileError
from jlens_core.fitting.expert_clusters import _kmeans_pp, fit_clustering, kmeans
from jlens_core.lenses.experts import Clustering


def _blobs(seed: int = 0, n_per: int = 40, d: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Three well-separated groups of directions: ``[3 n_per, d]`` residuals and their group labels."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.eye(d)[:3] * 5 + 1.0
    labels = torch.arange(3).repeat_interleave(n_per)
    x = centres[labels] + 0.2 * torch.randn(3 * n_per, d, generator=gen)
    return x * (1 + torch.rand(3 * n_per, 1, generator=gen) * 10), labels  # norms vary: scaling removes it


def _lloyd_reference(z: torch.Tensor, start: torch.Tensor, iters: int = 100) -> torch.Tensor:
    """Plain Lloyd iterations written out point by point (no empty clusters in the examples)."""
    cents = start.clone().double()
    for _ in range(iters):
        labels = [min(range(len(cents)), key=lambda e: float(((p - cents[e]) ** 2).sum())) for p in z.double()]
        new = torch.stack([z.double()[[i for i, lab in enumerate(labels) if lab == e]].mean(0) for e in range(len(cents))])
        if torch.allclose(new, cents, atol=0, rtol=0):
            break
        cents = new
    return cents


def test_kmeans_on_a_tiny_example_matches_hand_lloyd() -> None:
    z = torch.tensor([[0.0, 0.0], [0.1, 0.0], [0.0, 0.2], [5.0, 5.0], [5.1, 4.9], [4.8, 5.2], [9.0, 0.0], [9.2, 0.1]], dtype=torch.float64)
    got = kmeans(z, 3, seed=1)
    want = torch.tensor([[0.1 / 3, 0.2 / 3], [14.9 / 3, 15.1 / 3], [9.1, 0.05]], dtype=torch.float64)
    order = got[:, 0].argsort()
    torch.testing.assert_close(got[order], want, rtol=0, atol=1e-12)
    # from the same seeded k-means++ start, plain Lloyd iterations written out point by point agree
    for seed in range(5):
        ref = _lloyd_reference(z, _kmeans_pp(z, 3, torch.Generator().manual_seed(seed)))
        torch.testing.assert_close(kmeans(z, 3, seed=seed), ref, rtol=0, atol=1e-12)


def test_kmeans_reseeds_an_empty_cluster_at_the_farthest_point() -> None:
    # 4 points, 3 clusters, two of them identical: an empty cluster must take a point, none stays empty
    z = torch.tensor([[0.0], [0.0], [0.0], [10.0]])
    cents = kmeans(z, 3, seed=0)
    assert torch.isfinite(cents).all()
    labels = ((z[:, None, :].double() - cents[None]) ** 2).sum(-1).argmin(-1)
    assert 10.0 in cents.flatten().tolist()
    assert set(labels.tolist()) >= {int(((cents - 10.0) ** 2).sum(-1).argmin())}


def test_fit_clustering_recovers_the_groups_and_assign_repeats_the_steps() -> None:
    x, labels = _blobs()
    clus = fit_clustering(x, experts=3, components=4, seed=0)
    assert tuple(clus.components.shape) == (4, 6) and tuple(clus.centroids.shape) == (3, 4)
    torch.testing.assert_close(clus.components @ clus.components.T, torch.eye(4), atol=1e-5, rtol=0)
    got = clus.assign(x)
    # the groups are recovered up to a relabelling
    mapping = {int(labels[i]): int(got[i]) for i in range(len(x))}
    assert len(set(mapping.values())) == 3
    assert all(int(got[i]) == mapping[int(labels[i])] for i in range(len(x)))
    # assign = unit scale, subtract mean, project, nearest centroid: computed here independently
    unit = x.double() / x.double().norm(dim=1, keepdim=True)
    z = (unit - clus.mean.double()) @ clus.components.double().T
    nearest = torch.cdist(z, clus.centroids.double()).argmin(1)
    assert torch.equal(got, nearest)
    # the mean is that of the unit residuals; scaling a residual changes nothing
    torch.testing.assert_close(clus.mean.double(), unit.mean(0), atol=1e-6, rtol=0)
    assert torch.equal(clus.assign(x * 7.5), got)
    assert tuple(clus.assign(x.view(2, -1, 6)).shape) == (2, len(x) // 2)
    # seeded: the same clustering again
    again = fit_clustering(x, experts=3, components=4, seed=0)
    assert again.same_as(clus)


def test_fit_clustering_refuses_more_experts_than_positions() -> None:
    with pytest.raises(ValueError, match=r"saw 5 positions, fewer than experts=8"):
        fit_clustering(torch.randn(5, 6), experts=8, layer=2)


def _expert_lens(d: int = 6, E: int = 3, layers=(0, 1), counts=(100, 20, 60), seed: int = 0, **kwargs) -> ExpertLens:
    gen = torch.Generator().manual_seed(seed)
    x, _ = _blobs(seed, d=d)
    clus = fit_clustering(x, experts=E, components=4, seed=seed)
    return ExpertLens({layer: torch.randn(d, d, generator=gen) for layer in layers},
                      {layer: torch.randn(E, d, d, generator=gen) for layer in layers},
                      {layer: torch.tensor(counts) for layer in layers}, {layer: clus for layer in layers},
                      n_prompts=4, d_model=d, target_layer=max(layers) + 1,
                      settings={"skip_first": 1, "max_seq_len": 16}, **kwargs)


def test_expert_lens_matrices_fallback_and_weights() -> None:
    lens = _expert_lens()
    assert lens.kind == "jacobian-experts" and lens.layers == [0, 1, 2] and lens.source_layers == [0, 1]
    mats = lens.expert_matrices(1)
    assert torch.equal(mats[0], lens.experts[1][0]) and torch.equal(mats[2], lens.experts[1][2])
    assert torch.equal(mats[1], lens.pooled[1])  # 20 < 50 positions: the pooled matrix
    uniform = (lens.experts[1][0] + lens.pooled[1] + lens.experts[1][2]) / math.sqrt(3)
    torch.testing.assert_close(lens.matrix(1), uniform)
    torch.testing.assert_close(lens.combined(1, torch.tensor([2.0, 0.0, -1.0])),
                               2 * lens.experts[1][0] - lens.experts[1][2])
    h = torch.randn(5, 6)
    torch.testing.assert_close(lens.transport(h, 1), h @ uniform.T)
    assert torch.equal(lens.transport(h, 2), h) and torch.equal(lens.matrix(2), torch.eye(6))
    with pytest.raises(KeyError):
        lens.matrix(5)

    weighted = lens.with_weights({0: torch.tensor([3.0, 0.0, 4.0]), 1: torch.tensor([0.0, -1.0, 0.0])}, ["a", "b"])
    assert weighted.kind == "jacobian++" and weighted.weight_items == ["a", "b"]
    torch.testing.assert_close(weighted.matrix(0), 0.6 * lens.experts[0][0] + 0.8 * lens.experts[0][2])
    torch.testing.assert_close(weighted.matrix(1), -lens.pooled[1])
    assert lens.weights is None  # a copy
    with pytest.raises(ValueError, match="shape"):
        lens.with_weights({0: torch.ones(2), 1: torch.ones(3)}, ["a"])
    with pytest.raises(ValueError, match="L2 norm 0"):
        lens.with_weights({0: torch.zeros(3), 1: torch.ones(3)}, ["a"])
    assert _expert_lens(rules="relevance").with_weights({0: torch.ones(3), 1: torch.ones(3)}).kind == "relevance++"

    plain = weighted.to_jacobian_lens()
    assert isinstance(plain, JacobianLens) and plain.kind == "jacobian"
    assert torch.equal(plain.matrix(0), weighted.matrix(0))
    origin = plain.record.combined_from
    assert plain.fit_settings.experts == 3 and origin.kind == "jacobian++"
    assert origin.weight_items == ("a", "b") and origin.weights["1"] == [0.0, -1.0, 0.0]
    settings = plain.settings_dict()  # what its file records
    assert settings["experts"] == 3 and settings["expert_kind"] == "jacobian++" and settings["weight_items"] == ["a", "b"]


def test_expert_lens_file_roundtrip_and_errors(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    lens = _expert_lens(rules="relevance").with_weights({0: torch.tensor([1.0, 2.0, 2.0]),
                                                         1: torch.tensor([1.0, 0.0, 0.0])}, ["x"])
    path = lens.save(tmp_path / "e.safetensors")
    back = ExpertLens.load(path)
    assert back.kind == "relevance++" and back.weight_items == ["x"] and back.n_experts == 3
    for layer in (0, 1):
        assert torch.equal(back.matrix(layer), lens.matrix(layer))
        assert torch.equal(back.counts[layer], lens.counts[layer])
        assert back.clustering[layer].same_as(lens.clustering[layer])
    unweighted = ExpertLens.load(lens.with_weights(None).save(tmp_path / "u.safetensors"))
    assert unweighted.weights is None and unweighted.kind == "relevance-experts"
    half = ExpertLens.load(lens.save(tmp_path / "h.safetensors", dtype="float16"))
    torch.testing.assert_close(half.experts[0], lens.experts[0], rtol=1e-3, atol=1e-3)

    tensors = load_file(str(path))
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    save_file({k: v for k, v in tensors.items() if not k.startswith("clustering.")}, str(tmp_path / "bad.safetensors"),
              metadata=meta)
    with pytest.raises(LensFileError, match="no clustering for layer 0"):
        ExpertLens.load(tmp_path / "bad.safetensors")
    with pytest.raises(LensFileError, match="not an expert lens file"):
        ExpertLens.load(JacobianLens({0: torch.eye(6)}, 1, 6).save(tmp_path / "j.safetensors"))


def test_expert_lens_merge_adds_sums_and_counts() -> None:
    a = _expert_lens(counts=(100, 0, 60), seed=0)
    b = _expert_lens(counts=(30, 70, 10), seed=0)
    b = b.replace(experts={k: v + 1.0 for k, v in b.experts.items()}, n_prompts=2)
    merged = ExpertLens.merge([a, b])
    assert merged.n_prompts == 6 and merged.counts[0].tolist() == [130, 70, 70]
    want = (a.experts[0][0].double() * 100 + b.experts[0][0].double() * 30) / 130
    torch.testing.assert_close(merged.experts[0][0], want.float())
    torch.testing.assert_close(merged.experts[0][1], b.experts[0][1])  # a had no position there
    torch.testing.assert_close(merged.pooled[1], ((a.pooled[1] * 4 + b.pooled[1] * 2) / 6))
    other = _expert_lens(seed=1)
    with pytest.raises(ValueError, match="different clusterings"):
        ExpertLens.merge([a, other])
    with pytest.raises(ValueError, match="learned weights"):
        ExpertLens.merge([a.with_weights({0: torch.ones(3), 1: torch.ones(3)}), b])


def test_clustering_shape_errors() -> None:
    with pytest.raises(ValueError, match="centroids"):
        Clustering(torch.zeros(4), torch.zeros(2, 4), torch.zeros(3, 5))
