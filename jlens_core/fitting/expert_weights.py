"""Combination weights of an expert lens, learned from labelled items (docs/method.md §9.1, expert weights).

Per source layer ``l`` an :class:`~jlens_core.lenses.experts.ExpertLens` reads with one matrix
``J_l = sum_e w_e J_{l,e}`` (``w`` signed, unit L2 norm). This module learns ``w`` from labelled
pass@k items read once (:func:`~jlens_core.evaluation.labelled_items.read_labelled_items`): each item
holds its source residuals ``h_l`` at its readout position, so ``J_{l,e} h_l`` is computed once per
expert and every step only combines them and unembeds, ``unembed(sum_e w_e J_{l,e} h_l)``.

* **Exact score** (:func:`macro_pass_at_k`): docs/method.md §8's pass@k with every readable layer (the
  source layers and the output): an intermediate passes when its best rank over the layers is
  ``<= k``; an item scores the fraction of its scored intermediates that pass; a set the mean over
  its scored items; the macro score the mean over the sets (``macro_mean``).
* **Surrogate** (:func:`surrogate_terms`): per scored intermediate and source layer,
  ``sigmoid((c - t_k) / (T * s))`` with ``c`` the best candidate spelling's logit, ``t_k`` the k-th
  largest logit (among the readout's kept ids), ``s`` the population standard deviation of the
  logits over the whole output row and ``T = 0.1``; it is above 1/2 exactly when the layer alone
  ranks the word ``<= k``. The objective is the per-layer macro surrogate (items and sets weighted as
  in the exact score) averaged over the source layers: the weights are per layer, so each layer's
  ``w_l`` is pushed to find the words there, and the output layer (which no weight changes) is left out.
* **Optimiser** (:func:`learn_expert_weights`): Adam (lr 0.05) for 200 steps on all layers' ``w`` at
  once, each row renormalised to unit norm after every step, from three starts: all ones, the best
  single expert and the top three experts (per layer, by the layer's own exact macro pass@k, ties
  by its surrogate). Every iterate (the start included) is scored exactly; the one with the best
  exact macro pass@k over all starts is kept (the earliest on ties).
* **Split** (:func:`split_items`): items go to the held-out side by a seeded hash of their prompt,
  so the weights are never scored on the items they were learned on.
* **Fast path** (:class:`LogitBasis`): when the readout is the final norm then a linear head, and the norm
  is an RMSNorm (gain ``w`` or Gemma's ``1 + w``) or a LayerNorm (as
  :func:`~jlens_core.fitting.relevance.recognise_norm` finds it), the unembedding is exact algebra in ``w``,
  not an approximation: with ``y_e = J_{l,e} h_l``, ``c_e = y_e`` (RMSNorm) or ``y_e - mean(y_e)``
  (LayerNorm; the centring is linear), the norm's gain ``g``, bias ``b`` and epsilon, and the head ``W``
  (its rows past the vocabulary dropped, as ``unembed`` drops them),
  ``logits = (sum_e w_e B_e) / sqrt(w^T G w + eps) + offset`` with ``B_e = W (g * c_e)`` (``[n, E, vocab]``),
  ``G = C C^T / d`` (``[n, E, E]``: the combination's mean square, or variance, is ``w^T G w``) and
  ``offset = W b + head bias``; then the model's logit scale and soft-cap
  (:meth:`~jlens_core.models.model.HFLensModel.scale_and_cap`). Without a soft-cap the rows' standard
  deviation, which the surrogate divides by, is closed form too: ``sqrt(a^T S a)`` times the logit scale,
  with ``a = (w / sqrt(w^T G w + eps), 1)`` and ``S`` the covariance over the vocabulary of
  ``B_1 .. B_E, offset``. A step then costs an ``[E] x [E, vocab]`` product per item instead of
  ``[d] x [d, vocab]`` (``d / E`` fewer FLOPs: 72x on SmolLM2-135M with 8 experts; the step stays
  memory-bound: 6.5x faster there, bench/weigh_speed.py), and its backward reads only the basis's
  columns that the surrogate's gradient reaches (:func:`layer_surrogate`): one pass over the basis a
  step. The basis is built once (an ``[n E, d] x [d, vocab]`` product per layer) where it fits :data:`BASIS_BUDGET_BYTES` and the model
  computes in float32, and kept only when it reproduces ``unembed`` for the uniform weights on every layer
  (relative max error <= :data:`SELF_CHECK_RTOL`, else a warning). Otherwise (a readout or pre-head
  module, another norm, an offloaded or non-fp32 model, over budget) every step unembeds as above, and a
  log line says why.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch
from jaxtyping import Float
from torch import nn

from ..corpus import check_heldout_fraction, heldout_score
from ..lenses.experts import ExpertLens
from ..lenses.readout import transported_logits
from ..models.model import HFLensModel, LensModel, weight_of
from ..models.placement import is_offloaded
from .relevance import recognise_norm

log = logging.getLogger(__name__)

STEPS = 200
LEARNING_RATE = 0.05
PASS_K = 10
TEMPERATURE = 0.1  # the margin is divided by TEMPERATURE x the logits' standard deviation
STARTS = ("uniform", "best_expert", "top3")
REPORT_KS = (1, 5, 10)
# The fast path's logit basis, ``n_layers x n_items x E x vocab`` fp32, is built only up to this many bytes
# (6 GiB; 50 items of SmolLM2-135M, 29 layers, 8 experts, vocabulary 49152, take 2.1 GiB); above it, or
# with ``basis_budget=0``, every step unembeds (module docstring).
BASIS_BUDGET_BYTES = 6 * 2**30
# The basis is kept only when its logits for the uniform weights match ``unembed``'s to this relative
# max error (max |fast - unembed| / max |unembed|, on every layer).
SELF_CHECK_RTOL = 1e-4


class LabelledItem(Protocol):
    """What learning needs of one labelled item (:class:`~jlens_core.evaluation.labelled_items.LabelledReadout`)."""

    @property
    def set_name(self) -> str: ...

    @property
    def key(self) -> str: ...

    @property
    def prompt(self) -> str: ...

    @property
    def layers(self) -> tuple[int, ...]: ...

    @property
    def residuals(self) -> torch.Tensor: ...  # [len(layers), d] fp32

    @property
    def candidates(self) -> tuple[torch.Tensor, ...]: ...  # LongTensor[n_spellings] per scored intermediate

    @property
    def final_ranks(self) -> torch.Tensor: ...  # LongTensor[n_scored]

    @property
    def kept(self) -> torch.Tensor | None: ...  # [vocab] 0/1, or None (every id counts)


ItemT = TypeVar("ItemT", bound=LabelledItem)


@dataclass(frozen=True)
class WeighProgress:
    """Progress of :func:`learn_expert_weights`, reported after each iterate is scored.

    Attributes:
        start: the start's name (:data:`STARTS`); ``start_index`` its 0-based position.
        step: iterates scored so far in this start (``0`` = the start itself, up to ``n_steps``).
        surrogate: the objective at this iterate (mean over layers of the macro surrogate, in [0, 1]).
        macro: the exact macro pass@k at this iterate (k = :data:`PASS_K` by default).
        best_macro: the best exact macro pass@k so far, over every start.
    """

    start: str
    start_index: int
    n_starts: int
    step: int
    n_steps: int
    surrogate: float
    macro: float
    best_macro: float


@dataclass
class WeightFit:
    """The learned weights and how they were found.

    Attributes:
        weights: ``{source_layer: Tensor[E]}``, unit L2 norm, fp32 (the kept iterate).
        start: the start it came from (:data:`STARTS`); ``step``: its step in that start (0 = the start).
        macro: exact macro pass@k on the training items at the kept iterate, ``{k: score}`` for
            :data:`REPORT_KS` and the learning ``k``.
        history: one dict per scored iterate, in order: ``start``, ``step``, ``surrogate``, ``macro`` and
            ``weights`` (``[n_layers, E]`` fp32, rows in the order of the lens's source layers).
        items: the training items' keys (``"set:index"``), in order.
        seconds: wall time of the learning (the readings of the items excluded).
    """

    weights: dict[int, torch.Tensor]
    start: str
    step: int
    macro: dict[int, float]
    history: list[dict] = field(default_factory=list)
    items: list[str] = field(default_factory=list)
    seconds: float = 0.0


# -- the split ------------------------------------------------------------------------------------------------
def split_items(items: Sequence[ItemT], heldout_fraction: float = 0.5, *,
                seed: int = 0) -> tuple[list[ItemT], list[ItemT]]:
    """``(train, heldout)``: an item is held out when :func:`heldout_score` of its prompt is below
    ``heldout_fraction`` (so about that fraction is, the same prompt always on the same side, whatever
    the set or the order; a different ``seed`` draws another split).

    Raises:
        ValueError: ``heldout_fraction`` outside (0, 1), or a split that leaves either side without an item.
    """
    fraction = check_heldout_fraction(heldout_fraction)
    train: list[ItemT] = []
    heldout: list[ItemT] = []
    for item in items:
        (heldout if heldout_score(item.prompt, seed) < fraction else train).append(item)
    if not train or not heldout:
        side = "training" if not train else "held-out"
        raise ValueError(f"The split of {len(items)} items with held-out fraction {fraction} leaves no {side} "
                         "item: give more items or another fraction.")
    return train, heldout


# -- the tensors ---------------------------------------------------------------------------------------------
@dataclass
class LogitBasis:
    """The readout of transported items as exact algebra in the weights (the fast path, module docstring).

    Attributes:
        model: the model it reproduces (:func:`layer_logits` uses it for this model only).
        logits: ``{layer: [n_items, E, vocab]}`` fp32: ``B_e = W (g * c_e)``.
        gram: ``{layer: [n_items, E, E]}`` fp64: ``C C^T / d``; ``None`` when the model has no final norm.
        offset: ``[vocab]`` fp32: ``W b + head bias``, or ``None`` when both are absent.
        spread: ``{layer: [n_items, E + 1, E + 1]}`` fp64: the covariance over the vocabulary of the rows
            ``B_1 .. B_E, offset``, so the logits' row variance before the logit scale is ``a^T S a`` with
            ``a = (w / sqrt(w^T G w + eps), 1)`` (:meth:`layer_std`).
        eps: the final norm's epsilon.
    """

    model: HFLensModel
    logits: dict[int, torch.Tensor]
    gram: dict[int, torch.Tensor] | None
    offset: torch.Tensor | None
    spread: dict[int, torch.Tensor]
    eps: float

    def _coefficients(self, layer: int, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[n_items, E]``: ``w / sqrt(w^T G w + eps)`` per item (``w`` without a final norm)."""
        n = self.logits[layer].shape[0]
        w = weights.to(device=self.logits[layer].device, dtype=torch.float64)
        if self.gram is None:
            return w.expand(n, -1).to(dtype)
        square = torch.einsum("e,nef,f->n", w, self.gram[layer], w)  # mean square (or variance) [n]
        return (w[None, :] * torch.rsqrt(square + self.eps)[:, None]).to(dtype)

    def layer_logits(self, layer: int, weights: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[n_items, vocab]`` fp32: the model's ``unembed(sum_e w_e y_e)``, differentiable in ``weights [E]``;
        or written into ``out`` (an ``[n_items, vocab]`` buffer; under ``no_grad`` only, no autograd through it)."""
        basis = self.logits[layer]
        coefficients = self._coefficients(layer, weights, basis.dtype)[:, None, :]  # [n, 1, E]
        target = None if out is None else out.view(basis.shape[0], 1, basis.shape[2])
        if self.offset is None:
            logits = torch.bmm(coefficients, basis, out=target)
        else:  # the offset added inside the product
            logits = torch.baddbmm(self.offset.expand(basis.shape[0], 1, -1), coefficients, basis, out=target)
        return self.model.scale_and_cap(logits.squeeze(1), inplace=out is not None)

    def logits_at(self, layer: int, weights: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``[m]`` fp32: ``layer_logits(layer, weights)[rows, ids]`` from the basis's columns at ``ids`` alone
        (differentiable in ``weights``; ``rows``, ``ids``: ``LongTensor[m]``).

        The surrogate's gradient reaches only these few logits per row (the best candidate, the k-th
        largest): the backward reads ``m x E`` numbers instead of the whole ``[n_items, E, vocab]`` basis.
        """
        basis = self.logits[layer]
        coefficients = self._coefficients(layer, weights, basis.dtype)  # [n, E]
        values = (coefficients[rows] * basis[rows, :, ids]).sum(dim=-1)  # [m]
        if self.offset is not None:
            values = values + self.offset[ids]
        return self.model.scale_and_cap(values)

    def layer_std(self, layer: int, weights: torch.Tensor) -> torch.Tensor | None:
        """``[n_items]`` fp32: the population standard deviation of each row of :meth:`layer_logits` in closed
        form (differentiable in ``weights``), or ``None`` for a soft-capped model (not linear in ``w``)."""
        if self.model.softcap:
            return None
        coefficients = self._coefficients(layer, weights, torch.float64)
        a = torch.cat([coefficients, coefficients.new_ones(coefficients.shape[0], 1)], dim=1)  # [n, E + 1]
        variance = torch.einsum("ne,nef,nf->n", a, self.spread[layer], a)
        return (variance.clamp_min(0.0).sqrt() * abs(self.model.logit_scale)).float()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.logits.values())


def basis_bytes(n_layers: int, n_items: int, n_experts: int, vocab: int) -> int:
    """Bytes of a :class:`LogitBasis`'s ``logits`` (fp32)."""
    return 4 * n_layers * n_items * n_experts * vocab


def _basis_refusal(model: LensModel, transported: Mapping[int, torch.Tensor], budget: int) -> str | None:
    """Why ``model``'s readout of ``transported`` cannot be a :class:`LogitBasis` (``None``: it can)."""
    if not isinstance(model, HFLensModel):
        return f"the model is a {type(model).__name__}, not an HFLensModel"
    if model.dtype != torch.float32:
        return f"the model computes in {model.dtype}, the basis in float32"
    if model.readout is not None or model.pre_head:
        return "the model's readout runs modules between the final norm and the head"
    if not isinstance(model.head, nn.Linear):
        return f"the head is a {type(model.head).__name__}, not a linear layer"
    if is_offloaded(model.head) or (model.final_norm is not None and is_offloaded(model.final_norm)):
        return "the head or the final norm is offloaded"
    if model.final_norm is not None and recognise_norm(model.final_norm, model.d_model) is None:
        return f"the final norm ({type(model.final_norm).__name__}) is neither an RMSNorm nor a LayerNorm"
    first = next(iter(transported.values()))
    size = basis_bytes(len(transported), first.shape[0], first.shape[1], model.vocab_size)
    if size > budget:
        return f"the logit basis would take {size / 2**30:.2f} GiB, over its budget of {budget / 2**30:.2f} GiB"
    return None


def logit_basis(model: LensModel, transported: Mapping[int, torch.Tensor], *,
                budget: int | None = None) -> LogitBasis | None:
    """The :class:`LogitBasis` of ``transported`` (``{layer: [n_items, E, d]}`` fp32) for ``model``, or
    ``None`` (every step unembeds) when its readout is not a recognised final norm then a linear head, when
    the basis would exceed ``budget`` bytes (default :data:`BASIS_BUDGET_BYTES`; ``0`` always refuses), or
    when its logits for the uniform weights differ from ``model.unembed``'s by more than
    :data:`SELF_CHECK_RTOL` on some layer (logged as a warning).
    """
    budget = BASIS_BUDGET_BYTES if budget is None else int(budget)
    refusal = _basis_refusal(model, transported, budget)
    if refusal is not None:
        log.info("expert weights: every step unembeds (%s)", refusal)
        return None
    assert isinstance(model, HFLensModel)  # _basis_refusal refuses any other
    device = next(iter(transported.values())).device
    norm, vocab, d = model.final_norm, model.vocab_size, model.d_model
    rule = recognise_norm(norm, d) if norm is not None else None
    with torch.no_grad():
        gain: torch.Tensor | None = None  # the norm's effective gain (Gemma's 1 + w), None: all ones
        shift: torch.Tensor | None = None  # its bias
        if norm is not None and rule is not None:
            weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
            if isinstance(weight, torch.Tensor):
                gain = weight.detach().to(device, torch.float32)
                gain = 1.0 + gain if rule.one_plus else gain
            if isinstance(bias, torch.Tensor):
                shift = bias.detach().to(device, torch.float32)
        head = weight_of(model.head).detach()[:vocab].to(device, torch.float32)  # [vocab, d]: padding dropped
        offset = head @ shift if shift is not None else None
        head_bias = getattr(model.head, "bias", None)
        if isinstance(head_bias, torch.Tensor):
            head_bias = head_bias.detach()[:vocab].to(device, torch.float32)
            offset = head_bias if offset is None else offset + head_bias
        logits, gram, spread = {}, {}, {}
        for layer, y in transported.items():
            n, n_experts, _ = y.shape
            c = y - y.mean(-1, keepdim=True) if rule is not None and rule.centred else y
            scaled = c * gain if gain is not None else c
            logits[layer] = (scaled.reshape(n * n_experts, d) @ head.t()).view(n, n_experts, vocab)
            c64 = c.double()
            gram[layer] = c64 @ c64.transpose(1, 2) / d
            rows = torch.cat([logits[layer], (offset if offset is not None else head.new_zeros(vocab))
                              .expand(n, 1, vocab)], dim=1).double()  # [n, E + 1, vocab]
            rows -= rows.mean(-1, keepdim=True)
            spread[layer] = rows @ rows.transpose(1, 2) / vocab
            del rows
        basis = LogitBasis(model=model, logits=logits, gram=gram if norm is not None else None, offset=offset,
                           spread=spread, eps=rule.eps if rule is not None else 0.0)
        error = 0.0
        for layer, y in transported.items():
            uniform = torch.full((y.shape[1],), y.shape[1] ** -0.5, device=device)
            want = _unembed_combined(model, y, uniform)
            got = basis.layer_logits(layer, uniform)
            error = max(error, float((got - want).abs().max() / want.abs().max().clamp_min(1e-30)))
            std = basis.layer_std(layer, uniform)
            if std is not None:
                want_std = want.std(dim=-1, correction=0)
                error = max(error, float((std - want_std).abs().max() / want_std.abs().max().clamp_min(1e-30)))
            if not error <= SELF_CHECK_RTOL:  # NaN included
                log.warning("expert weights: the logit basis is %.1e off unembed on layer %d (relative max error "
                            "of the uniform weights' logits or their spread, over %.0e): every step unembeds "
                            "instead", error, layer, SELF_CHECK_RTOL)
                return None
    log.info("expert weights: logit basis of %d layers (%.2f GiB), %.1e off unembed (relative max error)",
             len(logits), basis.nbytes / 2**30, error)
    return basis


@dataclass
class ItemBatch:
    """Labelled items as tensors on one device (see :meth:`build`).

    Attributes:
        transported: ``{layer: [n_items, E, d]}`` fp32: ``J_{l,e} h_l`` per item and expert.
        cand: ``LongTensor[n_inter, S]``: each scored intermediate's candidate ids (padded by repeating
            its first).
        inter_item: ``LongTensor[n_inter]``: the item each scored intermediate belongs to.
        inter_weight: ``[n_inter]`` float64: its weight in the macro score (sums to 1).
        final_ranks: ``LongTensor[n_inter]``: its rank in the model's own output.
        kept: ``[n_items, vocab]`` 0/1 fp32, or ``None`` (every id counts).
        keys: the items' keys, in order.
        basis: the fast path's :class:`LogitBasis`, or ``None`` (every step unembeds).
        scratch: the step's reusable buffers by name (:meth:`buffer`).
    """

    transported: dict[int, torch.Tensor]
    cand: torch.Tensor
    inter_item: torch.Tensor
    inter_weight: torch.Tensor
    final_ranks: torch.Tensor
    kept: torch.Tensor | None
    keys: list[str]
    basis: LogitBasis | None = None
    scratch: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, matrices: Mapping[int, torch.Tensor], items: Sequence[LabelledItem],
              device: torch.device | str = "cpu", *, model: LensModel | None = None,
              basis_budget: int | None = None) -> ItemBatch:
        """Tensors of the scored ``items`` (the unscored are left out), transported by ``matrices``
        (``{layer: [E, d, d]}``, e.g. ``ExpertLens.expert_matrices``).

        With ``model``, also the fast path's :class:`LogitBasis` where :func:`logit_basis` builds one
        (``basis_budget`` bytes, default :data:`BASIS_BUDGET_BYTES`; ``0``: never): worth its cost (``E``
        unembeddings per layer) when the items are unembedded many times, as in learning.

        Weights: an intermediate counts ``1 / (n_sets * n_items_of_its_set * n_intermediates_of_its_item)``,
        counting only sets, items and intermediates that are scored: the macro mean over sets of the
        mean over items of the fraction passed (docs/method.md §8).

        Raises:
            ValueError: no scored item, or an item that lacks one of the layers.
        """
        scored = [item for item in items if item.candidates]
        if not scored:
            raise ValueError(f"None of the {len(items)} items has a scorable intermediate (a word with a "
                             "single-token spelling): nothing to learn or score on.")
        layers = sorted(int(layer) for layer in matrices)
        for item in scored:
            missing = sorted(set(layers) - set(item.layers))
            if missing:
                raise ValueError(f"Item {item.key} holds no residuals of layers {missing}: read the items at "
                                 "the lens's source layers.")
        items_per_set: dict[str, int] = {}
        for item in scored:
            items_per_set[item.set_name] = items_per_set.get(item.set_name, 0) + 1
        n_sets = len(items_per_set)
        width = max(len(c) for item in scored for c in item.candidates)
        cand, inter_item, inter_weight, final_ranks = [], [], [], []
        for i, item in enumerate(scored):
            share = 1.0 / (n_sets * items_per_set[item.set_name] * len(item.candidates))
            for c, rank in zip(item.candidates, item.final_ranks.tolist()):
                cand.append(torch.cat([c, c[:1].expand(width - len(c))]))
                inter_item.append(i)
                inter_weight.append(share)
                final_ranks.append(rank)
        transported = {}
        for layer in layers:
            mats = matrices[layer].to(device=device, dtype=torch.float32)  # [E, d, d]
            h = torch.stack([item.residuals[item.layers.index(layer)] for item in scored]).to(device)  # [n, d]
            transported[layer] = torch.einsum("nj,eij->nei", h.float(), mats)  # [n, E, d]
        kept = None
        if any(item.kept is not None for item in scored):
            if not all(item.kept is not None for item in scored):
                raise ValueError("The items mix readouts (some word, some all): read them with one vocab.")
            kept = torch.stack([item.kept for item in scored if item.kept is not None]).to(device)
        basis = logit_basis(model, transported, budget=basis_budget) if model is not None else None
        return cls(transported=transported, cand=torch.stack(cand).to(device),
                   inter_item=torch.tensor(inter_item, dtype=torch.long, device=device),
                   inter_weight=torch.tensor(inter_weight, dtype=torch.float64, device=device),
                   final_ranks=torch.tensor(final_ranks, dtype=torch.long, device=device), kept=kept,
                   keys=[item.key for item in scored], basis=basis)

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A reusable ``shape`` buffer, made once per ``name``: a step's ``[n, vocab]`` temporaries would
        otherwise be fresh allocations, and glibc maps each one over 32 MB anew, so every page faults in
        again (half of a learning run's time went to the kernel before)."""
        held = self.scratch.get(name)
        if held is None or held.shape != shape or held.dtype != dtype:
            held = self.scratch[name] = torch.empty(shape, dtype=dtype, device=self.cand.device)
        return held

    def kept_rows(self) -> torch.Tensor | None:
        """``[n_inter, vocab]`` fp32 0/1: the readout's kept ids on each intermediate's item row (``None``: every id)."""
        if self.kept is None:
            return None
        if "kept_rows" not in self.scratch:
            self.scratch["kept_rows"] = (self.kept.index_select(0, self.inter_item) > 0).float()
        return self.scratch["kept_rows"]

    def dropped(self) -> torch.Tensor | None:
        """``[n_items, vocab]`` bool: the ids the readout leaves out (``None``: every id counts)."""
        if self.kept is None:
            return None
        if "dropped" not in self.scratch:
            self.scratch["dropped"] = self.kept == 0
        return self.scratch["dropped"]

    @property
    def layers(self) -> list[int]:
        return sorted(self.transported)

    @property
    def n_experts(self) -> int:
        return int(next(iter(self.transported.values())).shape[1])


def _unembed_combined(model: LensModel, transported: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[n_items, vocab]`` fp32: ``model.unembed(sum_e w_e y_e)`` for ``transported [n_items, E, d]``."""
    h = torch.einsum("nei,e->ni", transported, weights.to(transported))  # [n, d]
    return transported_logits(model, h.to(model.dtype)).float()


def layer_logits(model: LensModel, batch: ItemBatch, layer: int, weights: torch.Tensor) -> torch.Tensor:
    """``[n_items, vocab]`` fp32: ``unembed(sum_e w_e J_{l,e} h_l)`` (differentiable in ``weights [E]``):
    through the batch's :class:`LogitBasis` when it has one for ``model``, else by ``model.unembed``."""
    if batch.basis is not None and batch.basis.model is model:
        return batch.basis.layer_logits(layer, weights)
    return _unembed_combined(model, batch.transported[layer], weights)


def layer_std(model: LensModel, batch: ItemBatch, layer: int, weights: torch.Tensor) -> torch.Tensor | None:
    """``[n_items]``: the population standard deviation of each row of :func:`layer_logits`, in closed form
    from the batch's :class:`LogitBasis` (:meth:`LogitBasis.layer_std`), or ``None`` where it has none (then
    :func:`surrogate_terms` computes it from the logits)."""
    if batch.basis is not None and batch.basis.model is model:
        return batch.basis.layer_std(layer, weights)
    return None


def surrogate_terms(logits: torch.Tensor, batch: ItemBatch, *, k: int = PASS_K,
                    temperature: float = TEMPERATURE, std: torch.Tensor | None = None) -> torch.Tensor:
    """``[n_inter]``: ``sigmoid((c - t_k) / (temperature * s))`` per scored intermediate (module docstring).

    ``logits`` is ``[n_items, vocab]``; ``t_k`` is the k-th largest kept logit of the item's row, ``s`` the
    population standard deviation of the whole row: ``std`` (``[n_items]``, :func:`layer_std`) when given,
    else computed from ``logits``.
    """
    dropped = batch.dropped()
    ranked = logits if dropped is None else logits.masked_fill(dropped, -math.inf)
    kth = ranked.topk(min(k, ranked.shape[-1]), dim=-1).values[:, -1]  # [n_items]
    spread = logits.std(dim=-1, correction=0) if std is None else std
    scale = temperature * spread.clamp_min(1e-12)  # [n_items]
    best = logits[batch.inter_item[:, None], batch.cand].max(dim=1).values  # [n_inter]
    return torch.sigmoid((best - kth[batch.inter_item]) / scale[batch.inter_item])


def layer_surrogate(model: LensModel, batch: ItemBatch, layer: int, weights: torch.Tensor, *, k: int = PASS_K,
                    temperature: float = TEMPERATURE) -> tuple[torch.Tensor, torch.Tensor]:
    """``(terms [n_inter], logits [n_items, vocab])``: :func:`surrogate_terms` of :func:`layer_logits`
    (differentiable in ``weights [E]``) and the logits themselves, detached (for the exact ranks; through
    the basis they lie in the batch's buffer, so they hold until the next call on the batch).

    Through the batch's :class:`LogitBasis`, without a soft-cap, the logits are computed once without
    autograd and the terms again from the basis's columns at each row's k-th largest kept id and each
    intermediate's best candidate (:meth:`LogitBasis.logits_at`), the only logits the terms' gradient
    reaches (the standard deviation is closed form): the same values and gradient, one pass over the basis
    a step instead of two. Otherwise through :func:`surrogate_terms`.
    """
    std = layer_std(model, batch, layer, weights)
    basis = batch.basis
    if basis is None or basis.model is not model or std is None:
        logits = layer_logits(model, batch, layer, weights)
        return surrogate_terms(logits, batch, k=k, temperature=temperature, std=std), logits.detach()
    with torch.no_grad():
        n_items, _, vocab = basis.logits[layer].shape
        logits = basis.layer_logits(layer, weights, out=batch.buffer("logits", (n_items, vocab), torch.float32))
        dropped = batch.dropped()
        ranked = logits
        if dropped is not None:
            ranked = batch.buffer("ranked", (n_items, vocab), torch.float32)
            ranked.copy_(logits).masked_fill_(dropped, -math.inf)
        kth_ids = ranked.topk(min(k, ranked.shape[-1]), dim=-1).indices[:, -1]  # [n_items]
        columns = logits[batch.inter_item[:, None], batch.cand].argmax(dim=1, keepdim=True)  # [n_inter, 1]
        best_ids = batch.cand.gather(1, columns).squeeze(1)  # [n_inter]
    rows = torch.arange(len(kth_ids), device=kth_ids.device)
    kth = basis.logits_at(layer, weights, rows, kth_ids)  # [n_items]
    best = basis.logits_at(layer, weights, batch.inter_item, best_ids)  # [n_inter]
    scale = temperature * std.clamp_min(1e-12)
    terms = torch.sigmoid((best - kth[batch.inter_item]) / scale[batch.inter_item])
    return terms, logits


def intermediate_ranks(logits: torch.Tensor, batch: ItemBatch) -> torch.Tensor:
    """``LongTensor[n_inter]``: each scored intermediate's best 1-based rank in its item's row of ``logits``:
    ``1 + #{kept v : logit_v > logit of its best candidate}`` (docs/method.md §6, §8)."""
    shape = (len(batch.inter_item), logits.shape[-1])
    if (logits.requires_grad and torch.is_grad_enabled()) or shape[1] >= 1 << 24:
        rows = logits.index_select(0, batch.inter_item)  # [n_inter, vocab]
        best = rows.gather(1, batch.cand).max(dim=1, keepdim=True).values  # [n_inter, 1]
        above = rows > best
        kept = batch.kept_rows()
        if kept is not None:
            above = above & (kept > 0)
        return above.sum(dim=1) + 1
    # The same count in the batch's buffers (out= takes no autograd): 0/1 as fp32, exact below 2^24 ids,
    # because summing a bool tensor first copies it to int64, a fresh [n_inter, vocab] allocation a layer.
    rows = torch.index_select(logits, 0, batch.inter_item, out=batch.buffer("rows", shape, logits.dtype))
    best = rows.gather(1, batch.cand).max(dim=1, keepdim=True).values  # [n_inter, 1]
    above = torch.gt(rows, best, out=batch.buffer("above", shape, torch.float32))
    kept = batch.kept_rows()
    if kept is not None:
        above.mul_(kept)
    return above.sum(dim=1).long() + 1


def macro_from_ranks(best_ranks: torch.Tensor, batch: ItemBatch, k: int) -> float:
    """The exact macro pass@k from each scored intermediate's best rank over the layers ``[n_inter]``."""
    return float((batch.inter_weight * (best_ranks <= k).double()).sum())


def _best_ranks(model: LensModel, batch: ItemBatch, weights: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """``[n_inter]``: best rank over the source layers (read with ``weights``) and the output layer."""
    best = batch.final_ranks.clone()
    with torch.no_grad():
        for layer in batch.layers:
            best = torch.minimum(best, intermediate_ranks(layer_logits(model, batch, layer, weights[layer]), batch))
    return best


def macro_pass_at_k(model: LensModel, matrices: Mapping[int, Float[torch.Tensor, "experts d_model d_model"]],
                    items: Sequence[LabelledItem], weights: Mapping[int, Float[torch.Tensor, " experts"]],
                    k: Sequence[int] = REPORT_KS) -> dict[int, float]:
    """Exact macro pass@k of the items read with ``sum_e w_e J_{l,e}`` per layer, the output layer included.

    Args:
        matrices: ``{layer: [E, d, d]}``; ``weights``: ``{layer: [E]}`` (used as given).
        k: the cut-offs.

    Returns:
        ``{k: score}``: the mean over sets of the mean over scored items of the fraction of scored
        intermediates whose best rank over the layers is ``<= k`` (the same number as
        :func:`~jlens_core.evaluation.passk.pass_at_k` and ``macro_mean`` give for the combined lens).
    """
    device = model.device
    batch = ItemBatch.build(matrices, items, device)
    best = _best_ranks(model, batch, {layer: torch.as_tensor(w, dtype=torch.float32, device=device)
                                      for layer, w in weights.items()})
    return {int(kk): macro_from_ranks(best, batch, int(kk)) for kk in k}


# -- learning -----------------------------------------------------------------------------------------------
def _starts(model: LensModel, batch: ItemBatch, k: int, temperature: float) -> dict[str, torch.Tensor]:
    """``{start: [n_layers, E]}`` unit rows: all ones, the best single expert, the top three (per layer,
    ranked by the layer's own exact macro pass@k, ties by its macro surrogate)."""
    n_experts = batch.n_experts
    best_rows, top_rows = [], []
    eye = torch.eye(n_experts, device=model.device)
    with torch.no_grad():
        for layer in batch.layers:
            scores = []
            for e in range(n_experts):
                logits = layer_logits(model, batch, layer, eye[e])
                exact = macro_from_ranks(intermediate_ranks(logits, batch), batch, k)
                terms = surrogate_terms(logits, batch, k=k, temperature=temperature,
                                        std=layer_std(model, batch, layer, eye[e]))
                smooth = float((batch.inter_weight * terms.double()).sum())
                scores.append((exact, smooth))
            order = sorted(range(n_experts), key=lambda e: (-scores[e][0], -scores[e][1], e))
            best_rows.append(eye[order[0]])
            top_rows.append(eye[order[:3]].sum(0))
    ones = torch.ones(len(batch.layers), n_experts, device=model.device)
    starts = {"uniform": ones, "best_expert": torch.stack(best_rows), "top3": torch.stack(top_rows)}
    return {name: rows / rows.norm(dim=1, keepdim=True) for name, rows in starts.items()}


def learn_expert_weights(model: LensModel, lens: ExpertLens, items: Sequence[LabelledItem], *, steps: int = STEPS,
                         lr: float = LEARNING_RATE, k: int = PASS_K, temperature: float = TEMPERATURE,
                         progress: Callable[[WeighProgress], None] | None = None,
                         basis_budget: int | None = None) -> WeightFit:
    """Learn ``{layer: w [E]}`` for ``lens`` on the training ``items`` (module docstring; docs/method.md §9.1).

    Args:
        model: the model the items were read with (its ``unembed``).
        lens: the expert lens; its source layers are the layers learned (the items must hold them).
        items: the training items (never the items the weights are then scored on: :func:`split_items`).
        steps: Adam steps per start; ``lr`` its learning rate.
        k: the pass@k the surrogate and the choice of iterate aim at.
        temperature: the surrogate's ``T`` (the margin is divided by ``T`` times the logits' std).
        progress: called after every scored iterate with a :class:`WeighProgress`.
        basis_budget: bytes the fast path's logit basis may take (default :data:`BASIS_BUDGET_BYTES`; ``0``:
            every step unembeds). Both paths give the same logits, to float32 rounding.

    Returns:
        A :class:`WeightFit`; ``lens.with_weights(fit.weights, fit.items)`` reads with them.

    Raises:
        ValueError: ``steps < 0``, ``lr <= 0``, ``k < 1``, ``temperature <= 0``, or no scored item.
    """
    if steps < 0 or not lr > 0 or k < 1 or not temperature > 0:
        raise ValueError(f"steps={steps}, lr={lr}, k={k}, temperature={temperature}: steps must be >= 0, k >= 1, "
                         "lr and temperature > 0.")
    began = time.perf_counter()
    matrices = {layer: lens.expert_matrices(layer) for layer in lens.source_layers}
    batch = ItemBatch.build(matrices, items, model.device, model=model, basis_budget=basis_budget)
    layers = batch.layers
    starts = _starts(model, batch, k, temperature)
    best: tuple[float, str, int, torch.Tensor] | None = None
    history: list[dict] = []
    for start_index, (start, rows) in enumerate(starts.items()):
        w = rows.clone().requires_grad_(True)  # [n_layers, E]
        optimiser = torch.optim.Adam([w], lr=lr)
        for step in range(steps + 1):
            optimiser.zero_grad()
            ranks = batch.final_ranks.clone()
            surrogate = 0.0
            for i, layer in enumerate(layers):
                terms, logits = layer_surrogate(model, batch, layer, w[i], k=k, temperature=temperature)
                objective = (batch.inter_weight.to(terms.dtype) * terms).sum() / len(layers)
                surrogate += float(objective.detach())
                if step < steps:
                    (-objective).backward()
                ranks = torch.minimum(ranks, intermediate_ranks(logits, batch))
            macro = macro_from_ranks(ranks, batch, k)
            history.append({"start": start, "step": step, "surrogate": surrogate, "macro": macro,
                            "weights": w.detach().cpu().clone()})
            if best is None or macro > best[0]:
                best = (macro, start, step, w.detach().clone())
            if progress is not None:
                progress(WeighProgress(start=start, start_index=start_index, n_starts=len(starts), step=step,
                                       n_steps=steps, surrogate=surrogate, macro=macro, best_macro=best[0]))
            if step < steps:
                optimiser.step()
                with torch.no_grad():
                    w /= w.norm(dim=1, keepdim=True).clamp_min(1e-12)
    assert best is not None  # at least one start and one iterate
    _, start, step, rows = best
    weights = {layer: rows[i].float().cpu() for i, layer in enumerate(layers)}
    final = _best_ranks(model, batch, {layer: rows[i] for i, layer in enumerate(layers)})
    scores = {kk: macro_from_ranks(final, batch, kk) for kk in sorted({*REPORT_KS, k})}
    seconds = time.perf_counter() - began
    log.info("expert weights: start %s step %d, macro pass@%d %.3f on %d items (%.1f s, %s)", start, step, k,
             scores[k], len(batch.keys), seconds, "logit basis" if batch.basis is not None else "unembed")
    return WeightFit(weights=weights, start=start, step=step, macro=scores, history=history, items=list(batch.keys),
                     seconds=seconds)


__all__ = ["BASIS_BUDGET_BYTES", "LEARNING_RATE", "PASS_K", "REPORT_KS", "SELF_CHECK_RTOL", "STARTS", "STEPS",
           "TEMPERATURE", "ItemBatch", "LabelledItem", "LogitBasis", "WeighProgress", "WeightFit", "basis_bytes",
           "heldout_score", "intermediate_ranks", "layer_logits", "layer_std", "layer_surrogate", "learn_expert_weights",
           "logit_basis", "macro_from_ranks", "macro_pass_at_k", "split_items", "surrogate_terms"]
