"""The arms that need the J-space (issue 49, :mod:`jlens_core.jspace` and
:mod:`jlens_core.interventions.jspace_edits`): swaps along a probe's or a concept vector's full vector, J part and
non-J part, the clamp of named tokens' J coordinates, and the norm-matched random vector.

Each vector is split once per layer (:func:`~jlens_core.jspace.decompose.split`, k = 25, centred gauge) and the
swaps along a part are ``VectorSwap`` edits of the part vectors, the same difference ``VectorSwap(part=...)`` adds
(its norm-matched form rescaled to the full difference's norm), without splitting again for every pair.

Imported lazily: a build without the J-space runs every other arm and notes the ones it skipped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..lenses.protocol import Lens
from ..models.model import LensModel
from ..reading.inputs import record_residuals

PROBE_ARMS = ("probe full", "probe J part", "probe non-J part", "probe non-J + J clamp", "probe random")
CONCEPT_ARMS = ("concept full", "concept J part", "concept non-J part", "concept random")


def last_activations(model: LensModel, ids: torch.Tensor, layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """``{layer: [d_model]}`` fp32: the clean residual at the last position of ``ids`` (one forward)."""
    recorded = record_residuals(model, ids, layers)
    return {int(layer): recorded[int(layer)][-1].float().cpu() for layer in layers}


def mean_difference_vectors(groups: Mapping[str, Sequence[dict[int, torch.Tensor]]], layers: Sequence[int], *,
                            leave_out_self: bool = False) -> dict[str, dict[int, torch.Tensor]]:
    """``{name: {layer: mean(group) - mean over the groups' means}}``: a probe (or concept vector) per group; with
    ``leave_out_self`` the baseline is the mean over the *other* groups' means (the paper's concept vectors)."""
    means = {name: {layer: torch.stack([a[layer] for a in acts]).mean(0) for layer in layers}
             for name, acts in groups.items() if acts}
    n = len(means)
    total = {layer: torch.stack([m[layer] for m in means.values()]).sum(0) for layer in layers}
    out = {}
    for name, m in means.items():
        if leave_out_self and n > 1:
            out[name] = {layer: m[layer] - (total[layer] - m[layer]) / (n - 1) for layer in layers}
        else:
            out[name] = {layer: m[layer] - total[layer] / n for layer in layers}
    return out


@dataclass
class SplitArms:
    """Vectors per concept and the edits that swap along them (built by :func:`probe_arms` / :func:`concept_arms`)."""

    model: LensModel
    lens: Lens
    vectors: dict[str, dict[int, torch.Tensor]]
    layers: list[int]
    seed: int
    prefix: str  # "probe" or "concept"
    magnitude: str = "natural"
    clamp: bool = True
    _split_cache: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def _parts(self, name: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(J part, non-J part)`` of ``name``'s vector at ``layer``, split once (every swap from or to it reuses it)."""
        from ..jspace.decompose import split

        key = (name, int(layer))
        if key not in self._split_cache:
            found = split(self.model, self.lens, self.vectors[name][layer], int(layer), controls=False)
            self._split_cache[key] = (found.j_part.float(), found.non_j_part.float())
        return self._split_cache[key]

    def _part_vectors(self, source: str, replacement: str, part: str) -> tuple[dict, dict]:
        """``(source', replacement')`` whose difference is the ``part`` difference (rescaled to the full difference's
        norm when ``magnitude="norm_matched"``): what ``VectorSwap(part="j" | "non_j")`` adds, from cached splits."""
        index = 0 if part == "j" else 1
        src, rep = {}, {}
        for layer in self.layers:
            a, b = self._parts(source, layer)[index], self._parts(replacement, layer)[index]
            delta = b - a
            if self.magnitude == "norm_matched" and float(delta.norm()) > 0:
                delta = delta * (float((self.vectors[replacement][layer] - self.vectors[source][layer]).norm())
                                 / float(delta.norm()))
            src[layer], rep[layer] = self.vectors[source][layer], self.vectors[source][layer] + delta
        return src, rep

    def arms_for(self, source: str, replacement: str, source_token: str | int | None = None) -> dict[str, list[Any]]:
        """``{arm: edits}`` for a swap ``source -> replacement`` (empty when either has no vector)."""
        from ..interventions.jspace_edits import ClampJ, VectorSwap

        if source not in self.vectors or replacement not in self.vectors or source == replacement:
            return {}

        def swap(part: str, random: bool = False) -> Any:
            src, rep = ((self.vectors[source], self.vectors[replacement]) if part == "full"
                        else self._part_vectors(source, replacement, part))
            return VectorSwap(self.model, self.lens, src, rep, part="full", layers=self.layers, random=random,
                              seed=self.seed)

        p = self.prefix
        arms: dict[str, list[Any]] = {f"{p} full": [swap("full")], f"{p} J part": [swap("j")],
                                      f"{p} non-J part": [swap("non_j")]}
        if self.clamp and source_token is not None:
            arms[f"{p} non-J + J clamp"] = [swap("non_j"), ClampJ(self.model, self.lens, [source_token],
                                                                   layers=self.layers)]
        arms[f"{p} random"] = [swap("full", random=True)]
        return arms


def probe_arms(model: LensModel, lens: Lens, *, kept_prompts: Sequence[tuple[str, torch.Tensor]],
               layers: Sequence[int], seed: int = 0) -> SplitArms:
    """The probe of each intermediate (mean last-position activation over the prompts that imply it, minus the
    mean over all intermediates) at ``layers``, and the probe-split arms."""
    groups: dict[str, list[dict[int, torch.Tensor]]] = {}
    for name, ids in kept_prompts:
        groups.setdefault(name, []).append(last_activations(model, ids, layers))
    return SplitArms(model, lens, mean_difference_vectors(groups, layers), list(layers), seed, "probe")


def concept_arms(model: LensModel, lens: Lens, *, prompts: Mapping[str, torch.Tensor], layers: Sequence[int],
                 seed: int = 0) -> SplitArms:
    """Concept vectors (the last-position activation of each concept's prompt minus the mean over the other concepts)
    at ``layers``, and the norm-matched concept-split arms (no clamp)."""
    groups = {name: [last_activations(model, ids, layers)] for name, ids in prompts.items()}
    vectors = mean_difference_vectors(groups, layers, leave_out_self=True)
    return SplitArms(model, lens, vectors, list(layers), seed, "concept",
                     magnitude="norm_matched", clamp=False)


__all__ = ["CONCEPT_ARMS", "PROBE_ARMS", "SplitArms", "concept_arms", "mean_difference_vectors",
           "probe_arms"]
