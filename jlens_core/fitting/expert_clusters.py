"""The clustering pass of an expert fit (docs/method.md §9.1, experts; issue #32 §1).

Before its backward passes, a fit with ``experts=E`` runs the first ``cluster_prompts`` prompts
forward (no gradients), collects every source layer's residuals at the kept positions
``[skip_first, seq_len - 1)``, and clusters them per layer
(:func:`fit_clustering`: unit-scaled, PCA, seeded k-means). The clustering is then fixed for the whole fit,
stored in its checkpoint (so a resumed fit routes exactly as before) and in the lens file.

Memory: the collected residuals, ``positions x d x |source layers|`` fp32 on the CPU (64 prompts of
128 tokens on a 576-wide, 29-layer model: ~0.5 GB), freed once the clustering is made.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from ..lenses.experts import UNIT_EPS, Clustering
from ..models.model import LensModel
from ..models.recorder import ActivationRecorder
from ..seeds import generator
from .estimator import prompt_ids

log = logging.getLogger(__name__)

# docs/method.md §9.1: top-64 principal components, seeded k-means++, 100 iterations, tolerance 1e-6
COMPONENTS, SEED, MAX_ITER, TOL = 64, 0, 100, 1e-6


def _kmeans_pp(z: torch.Tensor, experts: int, gen: torch.Generator) -> torch.Tensor:
    """k-means++ seeding of ``z`` [n, k] (fp64): ``[E, k]`` centroids drawn from the points."""
    n = z.shape[0]
    first = int(torch.randint(n, (1,), generator=gen))
    centroids = [z[first]]
    closest = (z - z[first]).pow(2).sum(-1)  # [n] squared distance to the nearest chosen centroid
    for _ in range(1, experts):
        total = float(closest.sum())
        if total > 0:
            pick = int(torch.multinomial(closest / total, 1, generator=gen))
        else:  # every point sits on a chosen centroid: any point will do
            pick = int(torch.randint(n, (1,), generator=gen))
        centroids.append(z[pick])
        closest = torch.minimum(closest, (z - z[pick]).pow(2).sum(-1))
    return torch.stack(centroids)


def _squared_distances(z: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """``[n, E]`` squared distances of points ``z`` [n, k] to ``centroids`` [E, k]."""
    return (z.pow(2).sum(-1, keepdim=True) - 2 * z @ centroids.T + centroids.pow(2).sum(-1)).clamp_min(0)


def kmeans(z: torch.Tensor, experts: int, *, seed: int = 0, max_iter: int = 100, tol: float = 1e-6) -> torch.Tensor:
    """Lloyd's k-means on ``z`` [n, k] from a seeded k-means++ start: ``[E, k]`` centroids (fp64).

    Each iteration assigns every point to its nearest centroid and moves each centroid to the mean of
    its points; a cluster left empty is re-seeded at the point farthest from its own centroid (that
    point then leaves its cluster). Stops after ``max_iter`` iterations or once no centroid moved by
    more than ``tol`` (Euclidean, in ``z``'s units).
    """
    z = z.double()
    gen = generator(seed)
    centroids = _kmeans_pp(z, experts, gen)
    for _ in range(max_iter):
        dist = _squared_distances(z, centroids)  # [n, E]
        labels = dist.argmin(-1)
        counts = torch.bincount(labels, minlength=experts)
        for e in torch.nonzero(counts == 0).flatten().tolist():  # re-seed an empty cluster at the farthest point
            own = dist.gather(1, labels[:, None])[:, 0]
            far = int(own.argmax())
            labels[far] = e
            dist[far] = 0.0  # taken: the next empty cluster gets another point
            counts = torch.bincount(labels, minlength=experts)
        new = torch.zeros_like(centroids).index_add_(0, labels, z) / counts[:, None].clamp_min(1).to(z.dtype)
        shift = float((new - centroids).norm(dim=-1).max())
        centroids = new
        if shift <= tol:
            break
    return centroids


def fit_clustering(residuals: torch.Tensor, experts: int = 8, components: int = 64, *, seed: int = 0,
                   max_iter: int = 100, tol: float = 1e-6, layer: int | None = None) -> Clustering:
    """Cluster one source layer's residuals (docs/method.md §9.1, experts).

    Each residual is scaled to unit length; the mean of those is subtracted; the result is projected
    onto its top ``min(components, d, n)`` principal components (SVD, fp64; each component's sign
    makes its largest-magnitude entry positive); :func:`kmeans` then finds ``experts`` centroids there.

    Args:
        residuals: ``[n, d]``, one row per kept position (any float dtype, any device).
        experts: ``E``, the number of clusters (>= 1).
        components: ``k``, the principal components kept (>= 1).
        seed: seeds the k-means++ start.
        max_iter, tol: k-means stopping rules (:func:`kmeans`).
        layer: the source layer, named in errors.

    Raises:
        ValueError: fewer positions than ``experts``, ``experts < 1``, ``components < 1`` or a
            residual array that is not ``[n, d]``.
    """
    where = "" if layer is None else f" of layer {layer}"
    if experts < 1:
        raise ValueError(f"experts={experts} must be >= 1.")
    if components < 1:
        raise ValueError(f"components={components} must be >= 1.")
    if residuals.dim() != 2:
        raise ValueError(f"The residuals{where} must be [n, d], got shape {tuple(residuals.shape)}.")
    n, d = residuals.shape
    if n < experts:
        raise ValueError(f"The clustering{where} saw {n} positions, fewer than experts={experts}: give more "
                         "cluster prompts (cluster_prompts, --cluster-prompts) or ask for fewer experts.")
    x = residuals.detach().double().cpu()
    x = x / x.norm(dim=-1, keepdim=True).clamp_min(UNIT_EPS)
    mean = x.mean(0)
    centred = x - mean
    _u, _s, vh = torch.linalg.svd(centred, full_matrices=False)  # vh: [min(n, d), d]
    k = min(components, d, n)
    comps = vh[:k]
    signs = torch.sign(comps.gather(1, comps.abs().argmax(1, keepdim=True)))  # [k, 1]
    comps = comps * torch.where(signs == 0, torch.ones_like(signs), signs)
    centroids = kmeans(centred @ comps.T, experts, seed=seed, max_iter=max_iter, tol=tol)
    return Clustering(mean=mean.float(), components=comps.float(), centroids=centroids.float())


def collect_residuals(model: LensModel, prompts: Sequence, sources: list[int], *, skip_first: int,
                      max_seq_len: int) -> dict[int, torch.Tensor]:
    """``{layer: Tensor[positions, d]}`` fp32 CPU: the residuals at every prompt's kept positions.

    A prompt with no kept position (too short for ``skip_first``) adds nothing.
    """
    parts: dict[int, list[torch.Tensor]] = {layer: [] for layer in sources}
    for prompt in prompts:
        ids = prompt_ids(model, prompt, max_seq_len)
        seq_len = ids.shape[1]
        if seq_len - 1 - skip_first <= 0:
            continue
        with torch.no_grad(), ActivationRecorder(model.layers, sources, stop_after=max(sources)) as rec:
            model.run_with_cache(ids)
        for layer in sources:
            parts[layer].append(rec.activations[layer][0, skip_first: seq_len - 1].float().cpu())
    d = model.d_model
    return {layer: torch.cat(chunks) if chunks else torch.zeros(0, d) for layer, chunks in parts.items()}


def cluster_source_layers(model: LensModel, prompts: Sequence, sources: list[int], *, experts: int,
                          cluster_prompts: int, skip_first: int, max_seq_len: int,
                          on_layer: Callable[[int], None] | None = None) -> dict[int, Clustering]:
    """``{layer: Clustering}`` from the first ``cluster_prompts`` prompts' kept positions.

    Args:
        on_layer: called with each layer once it is clustered (progress).

    Raises:
        ValueError: fewer kept positions than ``experts`` (names the layer, the count and what to change).
    """
    residuals = collect_residuals(model, prompts[:cluster_prompts], sources, skip_first=skip_first,
                                  max_seq_len=max_seq_len)
    n = residuals[sources[0]].shape[0]
    log.info("Clustering %d positions of %d prompts into %d experts per layer.", n,
             min(cluster_prompts, len(prompts)), experts)
    out = {}
    for layer in sources:
        out[layer] = fit_clustering(residuals.pop(layer), experts=experts, components=COMPONENTS, seed=SEED,
                                    max_iter=MAX_ITER, tol=TOL, layer=layer)
        if on_layer is not None:
            on_layer(layer)
    return out


def clustering_payload(clustering: dict[int, Clustering]) -> dict[str, dict[str, torch.Tensor]]:
    """The clustering as plain tensors for a checkpoint (``torch.load(weights_only=True)`` reads it)."""
    return {str(layer): {"mean": c.mean, "components": c.components, "centroids": c.centroids}
            for layer, c in clustering.items()}


def clustering_from_payload(payload: dict[str, dict[str, torch.Tensor]]) -> dict[int, Clustering]:
    """The inverse of :func:`clustering_payload`."""
    return {int(layer): Clustering(part["mean"], part["components"], part["centroids"])
            for layer, part in payload.items()}


__all__ = ["cluster_source_layers", "clustering_from_payload", "clustering_payload", "collect_residuals", "fit_clustering",
           "kmeans"]
