"""Routing source positions to experts inside the backward passes (docs/method.md §9.1, experts).

Every backward pass of the estimator yields, for each source position ``p``, the row block ``G_p``
(the gradient at ``h_l[p]`` of the summed target rows) before it is summed over ``p``. An expert lens
also sums those blocks per cluster: ``S_{l,e} = sum_{p in e} G_p``. This module holds the two steps
both estimator paths (autograd and fused) share: the one-hot routing matrix of a prompt, and the
per-expert sum of a chunk of rows. Neither adds a backward pass.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..lenses.experts import Clustering


def routes_for(clustering: Mapping[int, Clustering], residuals: Mapping[int, torch.Tensor],
               sources: list[int]) -> dict[int, torch.Tensor]:
    """``{layer: LongTensor[n_valid]}``: each valid position's expert, from its own layer residual.

    Args:
        clustering: ``{layer: Clustering}`` for every source layer.
        residuals: ``{layer: Tensor[n_valid, d]}``, the residuals at the valid positions.

    Raises:
        ValueError: a source layer without a clustering.
    """
    missing = [layer for layer in sources if layer not in clustering]
    if missing:
        raise ValueError(f"The expert clustering has no layers {missing}: cluster every source layer.")
    return {layer: clustering[layer].assign(residuals[layer].detach()) for layer in sources}


def one_hot_routes(route: torch.Tensor, experts: int, like: torch.Tensor) -> torch.Tensor:
    """``[E, n_valid]`` in ``like``'s dtype and device: 1 where position ``p`` goes to expert ``e``."""
    onehot = torch.zeros(experts, route.shape[0], dtype=like.dtype, device=like.device)
    onehot[route.to(like.device), torch.arange(route.shape[0], device=like.device)] = 1
    return onehot


def routed_sums(onehot: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """``[E, k, d]`` fp32: ``sum_{p in e} G_p`` for a chunk of ``k`` rows.

    Args:
        onehot: ``[E, n_valid]`` from :func:`one_hot_routes`.
        grads: ``[k, n_valid, d]``, row ``r``'s gradient at each valid source position.
    """
    return torch.einsum("en,knd->ekd", onehot.float(), grads.float())


def expert_counts(route: torch.Tensor, experts: int) -> torch.Tensor:
    """``LongTensor[E]`` (CPU): positions routed to each expert."""
    return torch.bincount(route.cpu(), minlength=experts)


__all__ = ["expert_counts", "one_hot_routes", "routed_sums", "routes_for"]
