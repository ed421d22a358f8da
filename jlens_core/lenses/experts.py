"""Expert lenses (J++ and R++): one Jacobian per cluster of source residuals (docs/method.md §9.1, experts).

Per source layer ``l`` the fit's kept positions are clustered by their layer-``l`` residual
(:class:`Clustering`, made by :func:`jlens_core.fitting.expert_clusters.fit_clustering`: unit length, centred,
top-``k`` principal components, k-means with ``E``
centroids); each source position's row block of the Jacobian is averaged into its own cluster's
matrix ``J_{l,e}``. :class:`ExpertLens` holds the pooled lens, the ``E`` expert matrices, their
position counts and the clustering, and reads with one matrix per layer,
``J_l = sum_e w_e J_{l,e}`` (``w`` signed, unit L2 norm; uniform ``1 / sqrt(E)`` until weights are
learned). :meth:`ExpertLens.to_jacobian_lens` turns it into a plain :class:`JacobianLens` of those
matrices, which reads at a J lens's cost.
"""

from __future__ import annotations

import functools
import logging
import math
import operator
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from jaxtyping import Float, Int

from .._keywords import checked_options
from ..models.model import LensModel
from .fit_settings import DEFAULT_CLUSTER_PROMPTS, ExpertOrigin, FitRecord, FitSettings
from .header import EXPERTS_FORMAT_NAME, LensFileError, half_prompts_of, header_or_none
from .kinds import PLAIN_RULES, expert_kind
from .lens import (
    HALF_NAMES,
    HALF_PREFIX,
    JacobianLens,
    MatrixTransportMixin,
    RecordKeywords,
    check_made_for,
    checked_rules,
    extra_tensors,
    fit_types,
    own_tensors,
    prompt_weighted_mean,
    read_lens_safetensors,
    record_types,
    write_lens_file,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

    from .protocol import FittedLens

log = logging.getLogger(__name__)

EXPERTS_FORMAT_VERSION = 1
# Below this many positions an expert's own mean is too noisy: it reads with the pooled matrix instead.
MIN_POSITIONS = 50
UNIT_EPS = 1e-12  # a residual of norm below this is scaled as if of this norm (avoids 0 / 0)


@dataclass
class Clustering:
    """The clustering of one source layer's residuals (docs/method.md §9.1, experts).

    Attributes:
        mean: ``[d]``, the mean of the unit-scaled residuals it was fitted on (fp32).
        components: ``[k, d]``, the top-``k`` principal directions of the centred unit residuals,
            orthonormal rows (fp32).
        centroids: ``[E, k]``, the k-means centroids in those coordinates (fp32).
    """

    mean: torch.Tensor
    components: torch.Tensor
    centroids: torch.Tensor

    def __post_init__(self) -> None:
        self.mean = torch.as_tensor(self.mean).float().cpu()
        self.components = torch.as_tensor(self.components).float().cpu()
        self.centroids = torch.as_tensor(self.centroids).float().cpu()
        d, k = self.mean.shape[-1], self.components.shape[0]
        if self.mean.dim() != 1 or tuple(self.components.shape) != (k, d) or self.centroids.dim() != 2 \
                or self.centroids.shape[1] != k:
            raise ValueError(f"A clustering needs mean [d], components [k, d] and centroids [E, k]; got "
                             f"{tuple(self.mean.shape)}, {tuple(self.components.shape)} and "
                             f"{tuple(self.centroids.shape)}.")

    @property
    def experts(self) -> int:
        """``E``, the number of clusters."""
        return int(self.centroids.shape[0])

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """``[..., d] -> [..., k]``: scaled to unit length, centred, projected (fp32, on ``h``'s device)."""
        x = h.float()
        x = x / x.norm(dim=-1, keepdim=True).clamp_min(UNIT_EPS)
        return (x - self.mean.to(x.device)) @ self.components.to(x.device).T

    def assign(self, h: torch.Tensor) -> torch.Tensor:
        """The nearest centroid of each residual: ``h [..., d] -> LongTensor[...]`` in ``0..E-1`` (``h``'s device).

        Raises:
            ValueError: the last axis of ``h`` is not the clustering's width.
        """
        if h.shape[-1] != self.mean.shape[0]:
            raise ValueError(f"h has width {h.shape[-1]}, this clustering is for width {self.mean.shape[0]}.")
        z = self.project(h)  # [..., k]
        centroids = self.centroids.to(z.device)
        dist = (z.unsqueeze(-2) - centroids).pow(2).sum(-1)  # [..., E]
        return dist.argmin(dim=-1)

    def same_as(self, other: Clustering) -> bool:
        """Whether both hold the same tensors (exactly)."""
        return all(a.shape == b.shape and torch.equal(a, b) for a, b in
                   ((self.mean, other.mean), (self.components, other.components), (self.centroids, other.centroids)))


def _unit(weights: torch.Tensor, what: str) -> torch.Tensor:
    w = torch.as_tensor(weights, dtype=torch.float32).flatten().cpu()
    norm = float(w.norm())
    if not math.isfinite(norm) or norm == 0.0:
        raise ValueError(f"The weights {what} have L2 norm {norm}: give finite weights, not all zero.")
    return w / norm


class ExpertOptions(TypedDict, total=False):
    """An expert lens's further parts, keyword by keyword (:class:`ExpertLens`'s Args): the learned weights and
    their items, the fallback threshold, the model's layer count and the split halves."""

    weights: Mapping[int, torch.Tensor] | None
    weight_items: Sequence[str] | None
    min_positions: int
    n_layers: int | None
    halves: tuple[ExpertLens, ExpertLens] | None


class ExpertLensOptions(ExpertOptions, RecordKeywords, total=False):
    """:class:`ExpertLens`'s keywords after ``rules``: its :class:`ExpertOptions` and what its fit recorded
    (:class:`~jlens_core.lenses.lens.RecordKeywords`)."""


class ExpertLens(MatrixTransportMixin):
    """An expert lens: per source layer ``E`` Jacobians, one per residual cluster (docs/method.md §9.1).

    Reads like a :class:`JacobianLens` with ``J_l = sum_e w_e J_{l,e}``; experts with fewer than
    ``min_positions`` positions read with the pooled matrix instead (the fallback).

    Args:
        pooled: ``{source_layer: Tensor[d, d]}``, the plain (per-prompt mean) lens of the same fit.
        experts: ``{source_layer: Tensor[E, d, d]}``, ``J_{l,e}`` = the position-weighted mean of the
            row blocks routed to expert ``e`` (zeros where no position was).
        counts: ``{source_layer: Tensor[E]}``, the positions averaged into each expert.
        clustering: ``{source_layer: Clustering}`` with ``E`` centroids.
        n_prompts: prompts averaged into the lens.
        d_model: residual width.
        target_layer: the layer it carries residuals to.
        rules: ``"jacobian"`` or ``"relevance"``: the backward rules of the fit.
        weights: learned ``{source_layer: Tensor[E]}`` (renormalised to unit L2 norm), or ``None``.
        weight_items: the labelled items the weights were learned on.
        min_positions: experts with fewer positions fall back to the pooled matrix.
        n_layers, settings, model_name, model_fingerprint, diagnostics, stop_reason: as in :class:`JacobianLens`.
        halves: the split halves ``(even, odd)`` (docs/method.md §3.3): two expert lenses of the same layers and
            clustering, without weights (:meth:`halves` reads them with this lens's weights), or ``None``.

    Raises:
        ValueError: a layer missing from one of the dicts, a shape that is not as above, different
            ``E`` across layers, unknown ``rules``, weights without their items, or halves that are not two
            expert lenses of these layers.
    """

    _FIELDS = ("pooled", "experts", "counts", "clustering", "d_model", "n_layers", "fit_settings", "record",
               "weights", "weight_items", "min_positions", "halves")
    pooled: dict[int, Float[torch.Tensor, "d_model d_model"]]
    experts: dict[int, Float[torch.Tensor, "experts d_model d_model"]]
    counts: dict[int, Int[torch.Tensor, " experts"]]
    clustering: dict[int, Clustering]
    n_experts: int
    weights: dict[int, Float[torch.Tensor, " experts"]] | None
    weight_items: list[str]
    min_positions: int

    def __init__(self, pooled: Mapping[int, Float[torch.Tensor, "d_model d_model"]],
                 experts: Mapping[int, Float[torch.Tensor, "experts d_model d_model"]],
                 counts: Mapping[int, Int[torch.Tensor, " experts"]], clustering: Mapping[int, Clustering],
                 n_prompts: int, d_model: int, *, target_layer: int, rules: str = PLAIN_RULES,
                 **options: Unpack[ExpertLensOptions]) -> None:
        keywords = checked_options("ExpertLens", options, ExpertLensOptions)
        if not pooled:
            raise ValueError("An ExpertLens needs at least one layer's matrices.")
        fit_settings, record = record_types(keywords, layers=sorted(int(layer) for layer in pooled),
                                            target_layer=target_layer, rules=rules, n_prompts=n_prompts)
        self._setup(pooled=pooled, experts=experts, counts=counts, clustering=clustering, d_model=d_model,
                    fit_settings=fit_settings, record=record,
                    **{name: keywords[name] for name in ExpertOptions.__optional_keys__ if name in keywords})

    @classmethod
    def from_fit(cls, pooled: Mapping[int, Float[torch.Tensor, "d_model d_model"]],
                 experts: Mapping[int, Float[torch.Tensor, "experts d_model d_model"]],
                 counts: Mapping[int, Int[torch.Tensor, " experts"]], clustering: Mapping[int, Clustering],
                 fit_settings: FitSettings, record: FitRecord, *, d_model: int,
                 **options: Unpack[ExpertOptions]) -> ExpertLens:
        """The expert lens of these tensors with its types: what shaped it (``fit_settings``) and what its fit
        recorded (``record``); the other arguments (:class:`ExpertOptions`) as the constructor's.

        Raises:
            ValueError: as the constructor.
            TypeError: a keyword that is not one of :class:`ExpertOptions`.
        """
        lens = object.__new__(cls)
        lens._setup(pooled=pooled, experts=experts, counts=counts, clustering=clustering, d_model=d_model,
                    fit_settings=fit_settings, record=record,
                    **checked_options("ExpertLens.from_fit", options, ExpertOptions))
        return lens

    def _setup(self, *, pooled: Mapping[int, torch.Tensor], experts: Mapping[int, torch.Tensor],
               counts: Mapping[int, torch.Tensor], clustering: Mapping[int, Clustering], d_model: int,
               fit_settings: FitSettings, record: FitRecord, n_layers: int | None = None,
               weights: Mapping[int, torch.Tensor] | None = None, weight_items: Sequence[str] | None = None,
               min_positions: int = MIN_POSITIONS, halves: Sequence[ExpertLens] | None = None) -> None:
        if not pooled:
            raise ValueError("An ExpertLens needs at least one layer's matrices.")
        self.d_model = d = int(d_model)
        layers = sorted(int(layer) for layer in pooled)
        for name, table in (("experts", experts), ("counts", counts), ("clustering", clustering)):
            missing = sorted(set(layers) - {int(k) for k in table})
            if missing:
                raise ValueError(f"The expert lens has no {name} for layers {missing}: every source layer needs "
                                 "its pooled matrix, experts, counts and clustering.")
        self.pooled = {layer: torch.as_tensor(pooled[layer]).float().cpu() for layer in layers}
        self.experts = {layer: torch.as_tensor(experts[layer]).float().cpu() for layer in layers}
        self.counts = {layer: torch.as_tensor(counts[layer]).to(torch.int64).cpu() for layer in layers}
        self.clustering = {layer: clustering[layer] for layer in layers}
        n_experts = self.experts[layers[0]].shape[0] if self.experts[layers[0]].dim() == 3 else -1
        for layer in layers:
            shapes = {"pooled": (tuple(self.pooled[layer].shape), (d, d)),
                      "experts": (tuple(self.experts[layer].shape), (n_experts, d, d)),
                      "counts": (tuple(self.counts[layer].shape), (n_experts,)),
                      "clustering centroids": ((self.clustering[layer].experts, self.clustering[layer].mean.shape[0]),
                                               (n_experts, d))}
            for name, (got, want) in shapes.items():
                if got != want:
                    raise ValueError(f"The {name} of layer {layer} have shape {got}, expected {want} "
                                     f"(E={n_experts}, d_model={d}).")
        self.n_experts = int(n_experts)
        checked = None
        if weights is not None:
            missing = sorted(set(layers) - {int(k) for k in weights})
            if missing:
                raise ValueError(f"The weights lack layers {missing}: give one [E] vector per source layer.")
            checked = {layer: self._checked_weights(weights[layer], layer) for layer in layers}
        self.weights = checked
        self.weight_items = list(weight_items or [])
        self.min_positions = int(min_positions)
        self._matrix_cache: dict[int, torch.Tensor] = {}
        self._weighted_halves: tuple[ExpertLens, ExpertLens] | None = None  # halves(), with this lens's weights
        self._set_fit(layers=layers, n_layers=n_layers, fit_settings=fit_settings, record=record, halves=halves)

    def _checked_weights(self, w: torch.Tensor, layer: int) -> torch.Tensor:
        w = torch.as_tensor(w, dtype=torch.float32).cpu()
        if tuple(w.shape) != (self.n_experts,):
            raise ValueError(f"The weights of layer {layer} have shape {tuple(w.shape)}, expected "
                             f"({self.n_experts},): one weight per expert.")
        return _unit(w, f"of layer {layer}")

    # -- what it is ----------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        """``"jacobian-experts"`` / ``"relevance-experts"`` (uniform weights), ``"jacobian++"`` / ``"relevance++"``
        (learned weights: the J++ and R++ lenses)."""
        return expert_kind(self.rules, weighted=self.weights is not None)

    @property
    def source_layers(self) -> list[int]:
        return sorted(self.pooled)

    def __repr__(self) -> str:
        return (f"ExpertLens(kind={self.kind!r}, model={self.model_name!r}, layers={self.source_layers[0]}.."
                f"{self.source_layers[-1]} ({len(self.source_layers)}), target={self.target_layer}, "
                f"d_model={self.d_model}, E={self.n_experts}, n_prompts={self.n_prompts})")

    # -- matrices ------------------------------------------------------------------------------
    def _check_layer(self, layer: int) -> None:
        if layer not in self.pooled:
            raise KeyError(f"This lens was fitted at layers {self.source_layers}, not at layer {layer}.")

    def expert_matrices(self, layer: int) -> Float[torch.Tensor, "experts d_model d_model"]:
        """``[E, d, d]`` fp32: ``J_{l,e}``, with the pooled matrix for each expert of < ``min_positions`` positions.

        Raises:
            KeyError: the lens was not fitted at ``layer``.
        """
        self._check_layer(layer)
        few = self.counts[layer] < self.min_positions  # [E]
        mats = self.experts[layer]
        if bool(few.any()):
            mats = torch.where(few[:, None, None], self.pooled[layer][None], mats)
        return mats

    def uniform_weights(self) -> Float[torch.Tensor, " experts"]:
        """``[E]``: all ones, scaled to unit L2 norm (``1 / sqrt(E)`` each)."""
        return torch.full((self.n_experts,), 1.0 / math.sqrt(self.n_experts))

    def combined(self, layer: int,
                 weights: Float[torch.Tensor, " experts"]) -> Float[torch.Tensor, "d_model d_model"]:
        """``sum_e w_e J_{l,e}``: fp32 ``[d, d]`` from ``weights`` ``[E]`` (used as given, not renormalised).

        Raises:
            KeyError: the lens was not fitted at ``layer``.
            ValueError: ``weights`` is not ``[E]``.
        """
        w = torch.as_tensor(weights, dtype=torch.float32).cpu()
        if tuple(w.shape) != (self.n_experts,):
            raise ValueError(f"weights has shape {tuple(w.shape)}, expected ({self.n_experts},).")
        return torch.einsum("e,eij->ij", w, self.expert_matrices(layer))

    def layer_weights(self, layer: int) -> Float[torch.Tensor, " experts"]:
        """``[E]``: the learned weights of ``layer``, or the uniform ones when none are learned."""
        self._check_layer(layer)
        return self.weights[layer] if self.weights is not None else self.uniform_weights()

    def matrix(self, layer: int) -> Float[torch.Tensor, "d_model d_model"]:
        """``sum_e w_e J_{l,e}`` with the learned (or uniform) weights, fp32 ``[d, d]``; ``I`` at the target.

        Raises:
            KeyError: the lens was not fitted at ``layer``.
        """
        if layer == self.target_layer:
            return torch.eye(self.d_model)
        mat = self._matrix_cache.get(layer)
        if mat is None:
            mat = self._matrix_cache[layer] = self.combined(layer, self.layer_weights(layer))
        return mat

    def halves(self) -> tuple[ExpertLens, ExpertLens] | None:
        """The split halves (docs/method.md §3.3) as :meth:`MatrixTransportMixin.halves` says, reading with this
        lens's learned weights (when it has them) and ``min_positions``."""
        base = super().halves()
        if base is None:
            return None
        if self._weighted_halves is None:  # built once: a stability reading asks for them on every read
            self._weighted_halves = (self._weighted_half(base[0]), self._weighted_half(base[1]))
        return self._weighted_halves

    def _weighted_half(self, half: ExpertLens) -> ExpertLens:
        return half.replace(weights=self.weights, weight_items=self.weight_items, min_positions=self.min_positions)

    def check_model(self, model: LensModel) -> None:
        """Raise :class:`LensFileError` if this lens was fitted for another model than ``model``."""
        check_made_for(self, model, what="expert lens", made="fitted on",
                       remedy="fit an expert lens for this model, or load its own lens")

    # -- variants ------------------------------------------------------------------------------
    def with_weights(self, weights: Mapping[int, Float[torch.Tensor, " experts"]] | None,
                     items: Sequence[str] = ()) -> ExpertLens:
        """A copy that reads with ``weights`` (``{layer: Tensor[E]}``, renormalised to unit L2 norm), learned
        on the labelled ``items`` (their names, recorded in the file); ``None`` goes back to uniform weights.

        Raises:
            ValueError: a layer without weights, a vector that is not ``[E]``, or one of norm 0 or not finite.
        """
        return self.replace(weights=weights, weight_items=list(items) if weights is not None else [])

    def to_jacobian_lens(self) -> JacobianLens:
        """A plain :class:`JacobianLens` whose matrix per layer is :meth:`matrix` (reads at a J lens's cost).

        Its record says where it came from (:attr:`~jlens_core.lenses.fit_settings.FitRecord.combined_from`, an
        :class:`~jlens_core.lenses.fit_settings.ExpertOrigin`: the kind, the weights ``{layer: [E floats]}``, the
        items they were learned on, ``min_positions`` and the positions per expert), and its fit settings ``experts``
        (E); its file's settings record them as ``expert_kind``, ``expert_weights``, ``weight_items``,
        ``min_positions``, ``expert_counts``. Save it with ``dtype="float16"`` to ship it.
        """
        origin = ExpertOrigin(kind=self.kind, weights={str(layer): [round(float(x), 7) for x in self.layer_weights(layer)]
                                                       for layer in self.source_layers},
                              weight_items=tuple(self.weight_items), min_positions=self.min_positions,
                              counts={str(layer): self.counts[layer].tolist() for layer in self.source_layers})
        fit = self.fit_settings.replace(experts=self.n_experts,
                                        cluster_prompts=self.fit_settings.cluster_prompts or DEFAULT_CLUSTER_PROMPTS)
        raw = self.raw_halves
        halves = None if raw is None else tuple(self._weighted_half(h).to_jacobian_lens() for h in raw)
        return JacobianLens.from_fit({layer: self.matrix(layer) for layer in self.source_layers}, fit,
                                     self.record.replace(combined_from=origin), d_model=self.d_model,
                                     n_layers=self.n_layers, halves=halves)  # type: ignore[arg-type]

    def pooled_lens(self) -> JacobianLens:
        """The plain lens of the same fit (the per-prompt mean of docs/method.md §3), as a :class:`JacobianLens`.

        Its fit settings are the fit's without experts: it is the lens a fit without experts gives, and a reader of
        ``experts`` would take it for a combination of experts."""
        raw = self.raw_halves
        return JacobianLens.from_fit(self.pooled, self.fit_settings.replace(experts=0), self.record,
                                     d_model=self.d_model, n_layers=self.n_layers,
                                     halves=None if raw is None else (raw[0].pooled_lens(), raw[1].pooled_lens()))

    # -- files ---------------------------------------------------------------------------------
    def metadata(self) -> dict[str, Any]:
        return {"format": EXPERTS_FORMAT_NAME, "format_version": EXPERTS_FORMAT_VERSION, "kind": self.kind,
                "model_name": self.model_name, "model_fingerprint": self.model_fingerprint,
                "d_model": self.d_model, "n_layers": self.n_layers, "source_layers": self.source_layers,
                "target_layer": self.target_layer, "n_prompts": self.n_prompts, "settings": self.settings_dict(),
                "rules": self.rules, "experts": self.n_experts, "min_positions": self.min_positions,
                "weighted": self.weights is not None, "weight_items": self.weight_items,
                "stop_reason": self.stop_reason, "diagnostics": self.diagnostics}

    def _dtype_matrices(self) -> list[torch.Tensor]:
        return [*self.pooled.values(), *self.experts.values()]

    def _file_tensors(self, store: torch.dtype, *, for_half: bool = False) -> dict[str, torch.Tensor]:
        # clone: layers may share one clustering or counts tensor, which safetensors refuses to store
        tensors: dict[str, torch.Tensor] = {}
        for layer in self.source_layers:
            tensors[f"J.{layer}"] = self.pooled[layer].to(store).contiguous().clone()
            tensors[f"experts.{layer}"] = self.experts[layer].to(store).contiguous().clone()
            tensors[f"counts.{layer}"] = self.counts[layer].contiguous().clone()
            if for_half:  # a half shares the lens's clustering and reads with its weights
                continue
            clus = self.clustering[layer]
            tensors[f"clustering.mean.{layer}"] = clus.mean.contiguous().clone()
            tensors[f"clustering.components.{layer}"] = clus.components.contiguous().clone()
            tensors[f"clustering.centroids.{layer}"] = clus.centroids.contiguous().clone()
            if self.weights is not None:
                tensors[f"weights.{layer}"] = self.weights[layer].contiguous().clone()
        return tensors

    def save(self, path: str | os.PathLike, *, dtype: str | torch.dtype = "float32", halves: bool = True) -> Path:
        """Write the lens as safetensors, atomically; returns the path written (docs/method.md §4.1).

        Tensors per source layer ``l``: ``J.l`` (pooled, ``[d, d]``), ``experts.l`` (``[E, d, d]``) in
        ``dtype`` (``float32`` or ``float16``; fp16 refuses values beyond its range: warns, stores fp32);
        ``counts.l`` (int64 ``[E]``); ``clustering.mean.l`` (``[d]``), ``clustering.components.l``
        (``[k, d]``), ``clustering.centroids.l`` (``[E, k]``) and ``weights.l`` (``[E]``, when learned), fp32.
        ``halves`` (default) also writes the split halves when the lens keeps them: each half's ``J``, ``experts``
        and ``counts`` under ``half.even.`` / ``half.odd.`` (docs/method.md §3.3), about 3x the size.
        """
        write_lens_file(path, EXPERTS_FORMAT_NAME, self.metadata(), self, dtype, halves)
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike, *, model: LensModel | None = None) -> ExpertLens:
        """Read a lens written by :meth:`save`.

        Raises:
            FileNotFoundError: no such file.
            LensFileError: not an expert lens file, truncated, a newer format, experts without their
                clustering, or (with ``model=``) a lens for another model.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"No lens file at {str(path)!r}.")
        info, tensors = read_lens_safetensors(path, EXPERTS_FORMAT_NAME, "is not an expert lens file (its header has "
                                              f"no {EXPERTS_FORMAT_NAME!r} metadata): load it with JacobianLens.load "
                                              "or load_lens.", key=str)
        rules = checked_rules(path, info, what="expert lens", version=EXPERTS_FORMAT_VERSION)
        every = tensors
        tensors = own_tensors(every)
        layers = [int(layer) for layer in info.get("source_layers", [])]
        if not layers:
            raise LensFileError(f"{str(path)!r} names no source layer.")
        for layer in layers:
            for name in ("J", "experts", "counts"):
                if f"{name}.{layer}" not in tensors:
                    raise LensFileError(f"{str(path)!r} lacks the tensor {name}.{layer}: the file is incomplete.")
            if any(f"clustering.{part}.{layer}" not in tensors for part in ("mean", "components", "centroids")):
                raise LensFileError(f"{str(path)!r} holds expert Jacobians but no clustering for layer {layer}, "
                                    "so no position can be routed: refit the expert lens.")
        weighted = bool(info.get("weighted"))
        if weighted and any(f"weights.{layer}" not in tensors for layer in layers):
            raise LensFileError(f"{str(path)!r} says it has learned weights but lacks some: learn them again "
                                "(jlens weigh).")
        from .canary import read_canary

        clustering = {layer: Clustering(tensors[f"clustering.mean.{layer}"], tensors[f"clustering.components.{layer}"],
                                        tensors[f"clustering.centroids.{layer}"]) for layer in layers}

        def part(named: dict[str, torch.Tensor]) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor],
                                                          dict[int, torch.Tensor]]:
            """The pooled matrices, experts and counts in ``named`` (a file's, or a half's)."""
            pooled, experts, counts = ({layer: named[f"{name}.{layer}"] for layer in layers}
                                       for name in ("J", "experts", "counts"))
            return pooled, experts, counts

        try:
            fit_settings, record = fit_types(info.get("settings"), layers=layers, target_layer=info["target_layer"],
                                             rules=rules, n_prompts=info["n_prompts"],
                                             model_name=info.get("model_name"),
                                             model_fingerprint=info.get("model_fingerprint"),
                                             diagnostics=info.get("diagnostics"), stop_reason=info.get("stop_reason"))
            shape: dict[str, Any] = {"d_model": info["d_model"], "n_layers": info.get("n_layers")}
            halves = None
            half_prompts = half_prompts_of(info)
            if half_prompts is not None:  # each half: its J, experts and counts, with the lens's clustering
                halves = tuple(cls.from_fit(*part(extra_tensors(every, f"{HALF_PREFIX}{name}.")), clustering,
                                            fit_settings, record.for_half(n), **shape)
                               for name, n in zip(HALF_NAMES, half_prompts))
            lens = cls.from_fit(*part(tensors), clustering, fit_settings, record.replace(canary=read_canary(path)),
                                weights={layer: tensors[f"weights.{layer}"] for layer in layers} if weighted else None,
                                weight_items=info.get("weight_items"),
                                min_positions=info.get("min_positions", MIN_POSITIONS),
                                halves=halves, **shape)  # type: ignore[arg-type]
        except (ValueError, KeyError) as exc:
            raise LensFileError(f"{str(path)!r} is not a consistent expert lens: {exc}") from exc
        if model is not None:
            lens.check_model(model)
        return lens

    # -- combining -----------------------------------------------------------------------------
    @classmethod
    def _check_merge(cls, lenses: Sequence[ExpertLens]) -> None:
        """Expert lenses merge without learned weights, with one E and one clustering."""
        if any(lens.weights is not None for lens in lenses):
            raise ValueError("Cannot merge expert lenses with learned weights: merge the fits, then learn the "
                             "weights on the merged lens.")
        first = lenses[0]
        for other in lenses[1:]:
            if (other.d_model, other.source_layers, other.n_experts) != (first.d_model, first.source_layers,
                                                                          first.n_experts):
                raise ValueError(f"Cannot merge expert lenses of widths/layers/E {first.d_model}/"
                                 f"{first.source_layers}/{first.n_experts} and {other.d_model}/"
                                 f"{other.source_layers}/{other.n_experts}.")
            bad = [layer for layer in first.source_layers
                   if not first.clustering[layer].same_as(other.clustering[layer])]
            if bad:
                raise ValueError(f"Cannot merge expert lenses with different clusterings (layers {bad}): fit the "
                                 "shards with the same cluster_prompts, so they compute the same clustering.")

    @classmethod
    def _merged_matrices(cls, lenses: Sequence[ExpertLens], total: int) -> dict[str, Any]:
        """The pooled matrices' ``n_prompts``-weighted mean, the experts' position sums and counts added (float64)."""
        pooled, experts, counts = {}, {}, {}
        for layer in lenses[0].source_layers:
            pooled[layer] = prompt_weighted_mean([(lens.pooled[layer], lens.n_prompts) for lens in lenses], total)
            count = functools.reduce(operator.add, [lens.counts[layer] for lens in lenses])  # [E]
            sums = functools.reduce(operator.add, [lens.experts[layer].double()
                                                   * lens.counts[layer].double()[:, None, None] for lens in lenses])
            experts[layer] = (sums / count.clamp_min(1).double()[:, None, None]).float()
            counts[layer] = count
        return {"pooled": pooled, "experts": experts, "counts": counts}


def is_expert_lens_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a safetensors file whose header says it is an expert lens (reads the header only)."""
    path = Path(path)
    if not path.is_file() or path.suffix != ".safetensors":
        return False
    header = header_or_none(path)  # not readable as a jlens lens: not an expert lens file
    return header is not None and header.is_expert


if TYPE_CHECKING:  # mypy checks here that the expert lens implements the protocol
    _expert_is_a_fitted_lens: type[FittedLens] = ExpertLens


__all__ = ["MIN_POSITIONS", "UNIT_EPS", "Clustering", "ExpertLens", "is_expert_lens_file"]
