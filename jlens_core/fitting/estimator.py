"""The per-prompt Jacobian estimator (docs/method.md §2).

For a prompt of ``seq_len`` tokens the valid positions are ``V = [skip_first, seq_len - 1)``. Row
``i`` of the per-prompt ``J_l`` is the mean over source positions ``p in V`` of the gradient, at
``h_l[p]``, of ``sum_{p' in V} e_i . h_T[p']``. One backward pass yields that row for every source
layer at once.

Exact savings used here (all follow from causality, docs/method.md §2):

* the prefix ``[0, skip_first)`` runs once without gradients and is handed to the rest of the
  prompt as a key/value cache: no path from a valid source to a valid target goes through it.
  Where a model's cache is not plain attention keys/values (linear attention, state-space or
  convolution states, sparse-attention indexers) or the cached run differs from the whole prompt
  run at once, the whole prompt runs with the graph instead (decided once per model,
  :func:`_prefix_cache_usable`);
* the last token is dropped: it is neither a valid source nor a valid target (kept where the
  model is not causal, e.g. a sparse-attention indexer choosing among later keys);
* the forward stops right after the target layer (no final norm, no logits);
* the graph starts at the lowest source layer, so backward never runs below it;
* the ``dim_batch`` cotangents of one backward pass are batched over one forward of batch 1
  (``is_grads_batched``), instead of replicating the prompt ``dim_batch`` times.

Methods: ``"batched"`` (autograd, as above), ``"replicated"`` (autograd, the prompt replicated
``dim_batch`` times), ``"fused"`` (the analytic backward of :mod:`jlens_core.fitting.fused`: Llama,
Mistral, Qwen2, Gemma, Gemma 2, GPT-2, GPT-NeoX and Phi layouts, on one device or spread over several; the backward coefficients are computed once per prompt instead of once per
backward call, and, where memory allows, all rows go through one layer at a time with the MLP half
as one matrix per position; ``dim_batch`` then sizes the attention half's chunks) and ``"auto"``
(the default: ``"fused"`` where the model supports it, else ``"batched"``). All give the same
Jacobian.

``rules="relevance"`` computes the same quantity with the relevance rules in the backward
(docs/method.md §9.1): the autograd methods run their forward-with-graph inside
:func:`~jlens_core.fitting.relevance.relevance_rules`, the fused method uses the rules' coefficients.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import torch
from jaxtyping import Bool, Float, Int

from .._keywords import checked_options
from ..layerspec import resolve_layers
from ..lenses.kinds import relevance_backward
from ..models.model import LensModel, kv_cache_problem
from ..models.recorder import ActivationRecorder
from .fused import (
    FusedMismatchError,
    fused_backward,
    fused_unsupported_reason,
    prepare_layers,
)
from .memory_budget import FitSizes, MemoryPlan, budget_bytes, plan_memory
from .methods import METHODS, check_rules
from .relevance import relevance_rules, relevance_unsupported_reason, unsupported_message
from .routing import expert_counts, one_hot_routes, routed_sums, routes_for

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's own from Python 3.11

    from ..lenses.experts import Clustering

log = logging.getLogger(__name__)


@dataclass
class PromptJacobian:
    """The per-prompt result of :func:`jacobian_for_prompt`.

    Attributes:
        jacobians: ``{source_layer: Tensor[d_model, d_model]}``, fp32 on the CPU; row ``i`` is
            output dimension ``i`` of the target layer.
        seq_len: tokens in the (truncated) prompt.
        n_valid: ``|V| = seq_len - 1 - skip_first``.
        expert_sums: with a clustering, ``{source_layer: Tensor[E, d_model, d_model]}`` (fp32, CPU):
            ``sum_{p in e} G_p``, the row blocks of the source positions routed to expert ``e``,
            summed (not averaged; docs/method.md §9.1, experts); else ``None``.
        expert_counts: with a clustering, ``{source_layer: LongTensor[E]}``: positions per expert.
        dim_batch: the rows per backward pass used (per attention chunk in the fused layer-major order).
        layer_major: the fused method's order, when a memory budget chose it; else ``None``.
    """

    jacobians: dict[int, Float[torch.Tensor, "d_model d_model"]]
    seq_len: int
    n_valid: int
    expert_sums: dict[int, Float[torch.Tensor, "experts d_model d_model"]] | None = None
    expert_counts: dict[int, Int[torch.Tensor, " experts"]] | None = None
    dim_batch: int | None = None
    layer_major: bool | None = None


def valid_position_mask(seq_len: int, skip_first: int = 16) -> Bool[torch.Tensor, " seq"]:
    """``BoolTensor[seq_len]``, true on ``V = [skip_first, seq_len - 1)``.

    Raises:
        ValueError: ``V`` is empty (the prompt is too short for ``skip_first``), or bad arguments.
    """
    if skip_first < 0:
        raise ValueError(f"skip_first={skip_first} must be >= 0.")
    if seq_len - 1 - skip_first <= 0:
        raise ValueError(f"The prompt has {seq_len} tokens: with skip_first={skip_first} it has no valid "
                         f"position (needs at least {skip_first + 2} tokens). Use a longer prompt or a "
                         "smaller skip_first.")
    mask = torch.zeros(seq_len, dtype=torch.bool)
    mask[skip_first: seq_len - 1] = True
    return mask


def prompt_ids(model: LensModel, prompt: str | Sequence[int] | torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """Text (tokenized by ``model.encode``) or ids, truncated to ``max_seq_len``: ``LongTensor[1, seq]``."""
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len={max_seq_len} must be at least 2.")
    if isinstance(prompt, str):
        return model.encode(prompt, max_length=max_seq_len)
    ids = torch.as_tensor(prompt, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"input ids must have shape [seq] or [1, seq], got {tuple(ids.shape)}.")
    return ids[:, :max_seq_len].to(model.device)


def auto_dim_batch(model: LensModel, n_valid: int, n_layers_backward: int, *, fraction: float = 0.5,
                   cap: int = 256, fused: bool = False) -> int:
    """A ``dim_batch`` that fits in free accelerator memory (``"auto"``); 16 on the CPU.

    Autograd (``fused=False``) holds about ``dim_batch * n_valid * (d_model * 6 + d_ff * 3)``
    activations per backpropagated layer at its peak. The fused backward holds one layer's
    cotangents at a time, about ``dim_batch * n_valid * (d_model * 6 + d_ff * 3 + 2 * heads * seq)``.
    ``fraction`` of the free memory is allowed for them.
    """
    device = model.device
    if device.type != "cuda":
        return 16
    free, _total = torch.cuda.mem_get_info(device)
    d = model.d_model
    config = model.config
    d_ff = getattr(config, "intermediate_size", None) or 4 * d
    per_position = 6 * d + 3 * d_ff
    if fused:
        heads = getattr(config, "num_attention_heads", 1)
        per_position += 2 * heads * (n_valid + 64)  # attention scores over all keys (prefix bounded)
        n_layers_backward = 1
    bytes_per_row = n_valid * per_position * max(n_layers_backward, 1) * torch.finfo(model.dtype).bits // 8
    return int(max(1, min(cap, d, fraction * free // max(bytes_per_row, 1))))


def _one_hot_cotangents(rows: range, batch: int, n_valid: int, d_model: int, like: torch.Tensor) -> torch.Tensor:
    # [k, batch, n_valid, d_model]: cotangent k is e_{rows[k]} at every valid target position
    cot = torch.zeros(len(rows), batch, n_valid, d_model, dtype=like.dtype, device=like.device)
    cot[torch.arange(len(rows)), :, :, torch.tensor(list(rows))] = 1
    return cot


# fp32 noise of an exact cached run is ~3e-7 relative; a family above this (Gemma 4: ~3e-6, which
# moves the Jacobian by ~1e-4) runs the whole prompt instead.
_PROBE_RTOL = 1e-6


def _prefix_cache_usable(model: LensModel, ids: torch.Tensor, target: int, skip_first: int) -> bool:
    """Whether the causal shortcuts are exact on ``model`` (decided once per model object).

    The shortcuts are: the prefix ``[0, skip_first)`` handed over as a key/value cache and the last
    token dropped. They are exact when the prefix's cache holds only attention keys and values and
    the target layer's residuals over ``V`` computed that way equal those of the whole prompt run
    at once (relative :data:`_PROBE_RTOL` in fp32, four machine epsilons in lower precision).
    Linear-attention, state-space, convolution and sparse-indexer caches are refused, and so is a
    model whose residuals at ``V`` depend on the last token (a sparse-attention indexer that is not
    causal): the estimator then runs the whole prompt with the graph.
    """
    usable = getattr(model, "_jlens_prefix_cache", None)  # memo _remember set on the object, if any
    if usable is not None:
        return usable
    seq_len = ids.shape[1]
    reason = None
    try:
        with torch.no_grad():
            with ActivationRecorder(model.layers, [target], stop_after=target) as rec:
                model.run_with_cache(ids)
            full = rec.activations[target][:, skip_first: seq_len - 1].float()
            cache = None
            if skip_first > 0:
                cache = model.run_with_cache(ids[:, :skip_first], use_cache=True)
                reason = kv_cache_problem(cache)
            if reason is None:
                with ActivationRecorder(model.layers, [target], stop_after=target) as rec:
                    model.run_with_cache(ids[:, skip_first: seq_len - 1], cache=cache)
                fast = rec.activations[target]
                # low precision: its own rounding noise (bf16: ~1e-2) is allowed, not more
                rtol = max(_PROBE_RTOL, 4 * torch.finfo(fast.dtype).eps) if fast.is_floating_point() else _PROBE_RTOL
                fast = fast.float()
                diff = float((fast - full).norm() / full.norm().clamp_min(1e-30))
                if fast.shape != full.shape or not diff <= rtol:
                    reason = (f"the cached prefix or the dropped last token changes the target residuals by "
                              f"{diff:.1e} (relative)")
    except Exception as exc:  # noqa: BLE001 - any failure of the cached path means: do not use it
        reason = f"the cached path fails ({type(exc).__name__}: {exc})"
    if reason is not None:
        log.info("%s: the whole prompt runs with the graph (no prefix cache): %s.",
                 model.name, reason)
    _remember(model, "_jlens_prefix_cache", reason is None)
    return reason is None


def _forward_suffix(model: LensModel, ids: torch.Tensor, sources: list[int], target: int, skip_first: int,
                    batch: int, rules: str = "jacobian") -> tuple[dict[int, torch.Tensor], int]:
    """Prefix without grad as a cache, then ``V`` with a graph from the lowest source layer up.

    With ``rules="relevance"`` the forward with the graph runs under
    :func:`~jlens_core.fitting.relevance.relevance_rules` (same values, the rules' gradients).

    Where those shortcuts are not exact (:func:`_prefix_cache_usable`), the whole prompt runs with
    the graph instead, and the recorded tensors keep the prefix and the last position.

    Returns:
        ``(acts, offset)``: the recorded ``{layer: Tensor[batch, positions, d_model]}`` and the first
        position of ``V`` in them; ``V`` is ``[offset, offset + n_valid)`` there.
    """
    seq_len = ids.shape[1]
    ids = ids.expand(batch, -1)
    rules_on = relevance_rules(model) if relevance_backward(rules) else contextlib.nullcontext()
    if not _prefix_cache_usable(model, ids[:1], target, skip_first):
        with rules_on, torch.enable_grad(), ActivationRecorder(model.layers, sources + [target],
                                                     start_graph_at=sources[0], stop_after=target) as rec:
            model.run_with_cache(ids)
        return rec.activations, skip_first
    cache = None
    if skip_first > 0:
        with torch.no_grad():
            cache = model.run_with_cache(ids[:, :skip_first], use_cache=True)
    with rules_on, torch.enable_grad(), ActivationRecorder(model.layers, sources + [target],
                                                           start_graph_at=sources[0], stop_after=target) as rec:
        model.run_with_cache(ids[:, skip_first: seq_len - 1], cache=cache)
    return rec.activations, 0


def _fused_usable(model: LensModel) -> bool:
    """Whether ``method="auto"`` takes the fused path on ``model`` (decided once per model object)."""
    usable = getattr(model, "_jlens_fused_usable", None)  # memo _remember set on the object, if any
    if usable is None:
        reason = fused_unsupported_reason(model)
        usable = reason is None
        if not usable:
            log.info("method='auto': autograd ('batched') for %s: the fused backward does not apply (%s).",
                     model.name, reason)
        _remember(model, "_jlens_fused_usable", usable)
    return usable


def _remember(model: LensModel, attr: str, value: bool) -> None:
    try:
        setattr(model, attr, value)
    except AttributeError:  # an object without a __dict__: decide again next time
        pass


class PromptJacobianKeywords(TypedDict, total=False):
    """:func:`jacobian_for_prompt`'s further keywords (its Args): an expert fit's ``clustering`` and the memory
    budget ``max_memory``."""

    clustering: Mapping[int, Clustering] | None
    max_memory: int | str | None


def jacobian_for_prompt(model: LensModel, prompt: str | Sequence[int] | Int[torch.Tensor, "*shape"], *,
                        source_layers: Iterable[int] | None = None,
                        target_layer: int | None = None, dim_batch: int | str = 8, max_seq_len: int = 128,
                        skip_first: int = 16, method: str = "auto", rules: str = "jacobian",
                        **options: Unpack[PromptJacobianKeywords]) -> PromptJacobian:
    """The per-prompt Jacobians ``{l: J_l}`` of docs/method.md §2.

    Args:
        model: an :class:`~jlens_core.models.model.HFLensModel` (or anything with its interface).
        prompt: text, or token ids ``[seq]`` / ``[1, seq]``.
        source_layers: layers to carry (default: every layer below the target).
        target_layer: default the last layer; negative counts from the end.
        dim_batch: output dimensions (rows) per backward pass; memory, not result. ``"auto"``
            sizes it from free GPU memory (:func:`auto_dim_batch`).
        max_seq_len: truncate the prompt to this many tokens.
        skip_first: leading positions excluded as attention sinks.
        method: ``"auto"`` (``"fused"`` where supported, else ``"batched"``), ``"fused"`` (the
            analytic backward of :mod:`jlens_core.fitting.fused`), ``"batched"`` (autograd: one forward,
            ``dim_batch`` cotangents batched in backward) or ``"replicated"`` (autograd: the prompt
            replicated ``dim_batch`` times, one cotangent each). Same result; speed and memory differ.
        rules: ``"jacobian"`` (ordinary gradients) or ``"relevance"`` (the R-lens's backward rules,
            docs/method.md §9.1: residual-path norms' denominators constant, identity rule for
            activations, half rule for gated products, MoE routers constant; forward unchanged).
        clustering: ``{source_layer: Clustering}`` (docs/method.md §9.1, experts): each valid source
            position is routed by its own layer residual, and its row block also summed into its
            expert (:attr:`PromptJacobian.expert_sums`), in the same backward passes.
        max_memory: a budget (bytes, or ``"6GiB"``) for this prompt's working memory on each device the
            layers run on, beyond the weights (:mod:`~jlens_core.fitting.memory_budget`): ``dim_batch`` and
            the fused order follow from it and the model's sizes; an integer ``dim_batch`` is then the
            most rows per pass, ``"auto"`` no limit but ``d_model``.

    Returns:
        :class:`PromptJacobian` with fp32 CPU matrices ``[d_model, d_model]``.

    Raises:
        ValueError: bad layer indices, ``dim_batch < 1``, an unknown method or rules, ``"fused"`` on a
            model it does not support, ``rules="relevance"`` on a model whose layers have a part the
            rules do not name, or a prompt with no valid position.
        MemoryBudgetError: ``max_memory`` too small for one row per pass (a ``ValueError``).
        TypeError: a keyword that is none of these (``clustering`` and ``max_memory``: :class:`PromptJacobianKeywords`).
    """
    given = checked_options("jacobian_for_prompt", options, PromptJacobianKeywords)
    clustering: Mapping[int, Clustering] | None = given.get("clustering")
    max_memory: int | str | None = given.get("max_memory")
    check_rules(rules)
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not one of {METHODS}.")
    if dim_batch != "auto" and (not isinstance(dim_batch, int) or dim_batch < 1):
        raise ValueError(f"dim_batch={dim_batch!r} must be an integer >= 1 or 'auto'.")
    sources, target = resolve_layers(model.n_layers, source_layers, target_layer)
    ids = prompt_ids(model, prompt, max_seq_len)
    seq_len = ids.shape[1]
    valid_position_mask(seq_len, skip_first)  # raises on a too-short prompt
    if relevance_backward(rules):
        reason = relevance_unsupported_reason(model)
        if reason is not None:
            raise ValueError(unsupported_message(model, reason))
    n_valid = seq_len - 1 - skip_first
    auto = method == "auto"
    if auto:
        method = "fused" if _fused_usable(model) else "batched"
    experts = max((c.experts for c in clustering.values()), default=0) if clustering is not None else 0
    rows = _RowPlan.make(model, dim_batch, max_memory, method, n_valid=n_valid, sources=sources, target=target,
                         skip_first=skip_first, experts=experts)
    d = model.d_model
    sums = ({layer: torch.zeros(experts, d, d, dtype=torch.float32) for layer in sources}
            if clustering is not None else None)
    if method == "fused":
        try:
            prep = prepare_layers(model, ids, sources[0], target, skip_first, rules=rules)
            onehots, counts = _routing(clustering, prep.residuals, sources, experts, like=prep.like)
            jacobians = fused_backward(model, prep, sources, target, rows.per_pass, rows.layer_major,
                                       routes=onehots, expert_sums=sums)
            return PromptJacobian(jacobians=jacobians, seq_len=seq_len, n_valid=n_valid, expert_sums=sums,
                                  expert_counts=counts, dim_batch=rows.per_pass, layer_major=rows.layer_major)
        except FusedMismatchError as exc:
            if not auto:
                raise
            # Warned once: autograd from now on for this model object.
            log.warning("%s Falling back to autograd ('batched').", exc)
            _remember(model, "_jlens_fused_usable", False)
            method, rows = "batched", rows.for_autograd()
    jacobians, counts = _autograd_jacobians(model, ids, method, rows.per_pass, sources=sources, target=target,
                                            skip_first=skip_first, rules=rules, clustering=clustering,
                                            experts=experts, expert_sums=sums)
    return PromptJacobian(jacobians=jacobians, seq_len=seq_len, n_valid=n_valid, expert_sums=sums,
                          expert_counts=counts, dim_batch=rows.per_pass)


@dataclass
class _RowPlan:
    """Rows (output dimensions) per backward pass, and the fused order, for one prompt.

    ``fallback`` is what autograd takes if the fused path falls back (autograd holds more per row);
    with a memory budget it is planned again for autograd (:meth:`for_autograd`).
    """

    per_pass: int
    fallback: int
    layer_major: bool | None = None
    replan: Callable[[str], MemoryPlan] | None = None

    @classmethod
    def make(cls, model: LensModel, dim_batch: int | str, max_memory: int | str | None, method: str, *,
             n_valid: int, sources: list[int], target: int, skip_first: int, experts: int) -> _RowPlan:
        layers_backward = target - sources[0]
        if max_memory is not None:
            sizes = FitSizes.of(model, n_valid=n_valid, layers_backward=layers_backward, n_sources=len(sources),
                                skip_first=skip_first, experts=experts)
            budget = budget_bytes(max_memory)
            most_rows = None if isinstance(dim_batch, str) else dim_batch

            def replan(method_now: str) -> MemoryPlan:
                return plan_memory(sizes, budget, method_now, most_rows)

            plan = replan(method)
            return cls(plan.dim_batch, plan.dim_batch if method != "fused" else 0, plan.layer_major, replan)
        if isinstance(dim_batch, str):  # "auto" (checked by the caller)
            fallback = auto_dim_batch(model, n_valid, layers_backward)
            per_pass = auto_dim_batch(model, n_valid, layers_backward, fused=True) if method == "fused" else fallback
            return cls(per_pass, fallback)
        return cls(dim_batch, dim_batch)

    def for_autograd(self) -> _RowPlan:
        """The plan once the fused path fell back to autograd ("batched")."""
        per_pass = self.replan("batched").dim_batch if self.replan is not None else self.fallback
        return _RowPlan(per_pass, per_pass)


def _autograd_jacobians(model: LensModel, ids: torch.Tensor, method: str, rows_per_pass: int, *, sources: list[int],
                        target: int, skip_first: int, rules: str, clustering: Mapping[int, Clustering] | None,
                        experts: int, expert_sums: dict[int, torch.Tensor] | None
                        ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor] | None]:
    """``({layer: J_l}, expert counts)`` by autograd (``"batched"`` or ``"replicated"``); ``expert_sums``
    are filled in place. Each pass backpropagates ``rows_per_pass`` one-hot cotangents."""
    n_valid = ids.shape[1] - 1 - skip_first
    d = model.d_model
    jacobians = {layer: torch.zeros(d, d, dtype=torch.float32) for layer in sources}
    acts, off = (_forward_suffix(model, ids, sources, target, skip_first, 1, rules) if method == "batched"
                 else ({}, 0))
    onehots = counts = None
    for start in range(0, d, rows_per_pass):
        rows = range(start, min(start + rows_per_pass, d))
        if method == "batched":
            if start == 0:
                onehots, counts = _routing(clustering, {layer: acts[layer][0, off: off + n_valid] for layer in sources},
                                           sources, experts, like=acts[sources[0]])
            h_target = acts[target][:, off: off + n_valid]  # [1, n_valid, d]
            cot = _one_hot_cotangents(rows, 1, n_valid, d, h_target)  # [k, 1, n_valid, d]
            grads = torch.autograd.grad(h_target, [acts[layer] for layer in sources], grad_outputs=cot,
                                        is_grads_batched=True, retain_graph=True)
            per_position = [g[:, 0, off: off + n_valid] for g in grads]  # each [k, n_valid, d]
        else:
            k = len(rows)
            rep, off = _forward_suffix(model, ids, sources, target, skip_first, k, rules)
            if start == 0:
                onehots, counts = _routing(clustering, {layer: rep[layer][0, off: off + n_valid] for layer in sources},
                                           sources, experts, like=rep[sources[0]])
            h_target = rep[target][:, off: off + n_valid]  # [k, n_valid, d]
            cot = _one_hot_cotangents(rows, 1, n_valid, d, h_target)[:, 0]  # [k, n_valid, d]
            grads = torch.autograd.grad(h_target, [rep[layer] for layer in sources], grad_outputs=cot)
            per_position = [g[:, off: off + n_valid] for g in grads]  # each [k, n_valid, d]
        for layer, g in zip(sources, per_position):  # g: [k, n_valid, d], row block G_p per position p
            jacobians[layer][start: rows.stop] = g.float().sum(dim=1).cpu() / n_valid
            if onehots is not None and expert_sums is not None:
                expert_sums[layer][:, start: rows.stop] = routed_sums(onehots[layer], g).cpu()
    return jacobians, counts

def _routing(clustering: Mapping[int, Clustering] | None, residuals: Mapping[int, torch.Tensor], sources: list[int],
             experts: int, like: torch.Tensor) -> tuple[dict[int, torch.Tensor] | None, dict[int, torch.Tensor] | None]:
    """One-hot routes ``{l: [E, n_valid]}`` (``like``'s dtype and device) and counts ``{l: LongTensor[E]}``
    of the valid positions, from their residuals ``{l: [n_valid, d]}``; ``(None, None)`` without clustering."""
    if clustering is None:
        return None, None
    routes = routes_for(clustering, residuals, sources)
    return ({layer: one_hot_routes(route, experts, like) for layer, route in routes.items()},
            {layer: expert_counts(route, experts) for layer, route in routes.items()})
