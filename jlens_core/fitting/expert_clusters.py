"""The clustering pass of an expert fit (docs/method.md §9.1, experts; issue #32 §1).

Before its backward passes, a fit with ``experts=E`` runs the first ``cluster_prompts`` prompts
forward (no gradients), collects every source layer's residuals at the kept positions
``[skip_first, seq_len - 1)``, and clusters them per layer
(:func:`~jlens_core.lenses.experts.fit_clustering`). The clustering is then fixed for the whole fit,
stored in its checkpoint (so a resumed fit routes exactly as before) and in the lens file.

Memory: the collected residuals, ``positions x d x |source layers|`` fp32 on the CPU (64 prompts of
128 tokens on a 576-wide, 29-layer model: ~0.5 GB), freed once the clustering is made.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from ..lenses.experts import Clustering, fit_clustering
from ..models.model import LensModel
from ..models.recorder import ActivationRecorder
from .estimator import prompt_ids

log = logging.getLogger(__name__)

# docs/method.md §9.1: top-64 principal components, seeded k-means++, 100 iterations, tolerance 1e-6
COMPONENTS, SEED, MAX_ITER, TOL = 64, 0, 100, 1e-6


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


__all__ = ["cluster_source_layers", "clustering_from_payload", "clustering_payload", "collect_residuals"]
