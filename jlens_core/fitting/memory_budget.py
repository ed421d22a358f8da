"""The fit's working memory from a budget: ``dim_batch`` and the backward's order from sizes, not a guess.

``fit(..., max_memory="6GiB")`` (shell: ``jlens fit --fit-memory 6GiB``) bounds the memory one prompt's
estimator may hold on each device the decoder layers run on, beyond the model's own weights. The
estimator's sizes (``d_model``, the MLP width, heads, the valid positions and keys of the prompt, the
layers backpropagated, the dtype) give its bytes as ``fixed + dim_batch * per_row``
(:func:`plan_memory`): the largest ``dim_batch`` within the budget is taken, and the fused method's
layer-major order (``3 n d^2`` more, fewer FLOPs) where it fits with at least :data:`LAYER_MAJOR_MIN_ROWS`
rows per attention chunk. A budget too small for ``dim_batch = 1`` is a :class:`MemoryBudgetError`
that says how much is needed.

The byte counts are planning bounds of the tensors the estimator holds at its peak (counted in
the code of :mod:`~jlens_core.fitting.fused` and autograd's saved tensors), not allocator
measurements; :func:`peak_memory_bytes` reports what was actually reached.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

import torch

from ..models.device_maps import format_bytes, parse_size
from ..models.model import LensModel
from .fused import MLP_BLOCK

# The layer-major order is taken only where its attention chunks can hold this many rows (or dim_batch's cap).
LAYER_MAJOR_MIN_ROWS = 8
# Families whose MLP is one projection, an activation and another (others count as gated: an upper bound).
PLAIN_MLP_MODEL_TYPES = frozenset({"gpt2", "gpt_neox", "phi", "gptj", "opt", "bloom", "falcon", "gpt_bigcode"})


class MemoryBudgetError(ValueError):
    """A ``max_memory`` too small for one row per backward pass; the sentence says how much is needed."""


@dataclass(frozen=True)
class FitSizes:
    """The sizes one prompt's estimator memory follows from (elements, not bytes, except ``element_bytes``).

    Attributes:
        d_model: residual width ``d``.
        mlp_width: the MLP's hidden width ``F`` (``intermediate_size``).
        mlp_parts: 2 for a gated MLP (gate and up), 1 for a plain one.
        heads: query heads ``H``.
        n_valid: valid positions ``n`` of the prompt (``seq_len - 1 - skip_first``).
        keys: keys ``S`` each valid query attends to at most (``seq_len - 1``).
        layers_backward: decoder layers backpropagated (``target - lowest source``).
        n_sources: source layers, each with a ``[d, d]`` fp32 result.
        element_bytes: bytes per element of the model's dtype (4 for fp32, 2 for bf16).
        results_on_device: the ``[d, d]`` fp32 results are held in the budgeted memory (a CPU fit).
        experts: expert sums per source layer (``E``; 0 without experts).
    """

    d_model: int
    mlp_width: int
    mlp_parts: int
    heads: int
    n_valid: int
    keys: int
    layers_backward: int
    n_sources: int
    element_bytes: int
    results_on_device: bool
    experts: int = 0

    @classmethod
    def of(cls, model: LensModel, *, n_valid: int, layers_backward: int, n_sources: int, skip_first: int,
           experts: int = 0) -> FitSizes:
        """The sizes of ``model`` for a prompt with ``n_valid`` valid positions after ``skip_first``."""
        config = model.config
        d = model.d_model
        width = int(getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * d)
        gated = getattr(config, "model_type", "") not in PLAIN_MLP_MODEL_TYPES
        heads = int(getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None) or 1)
        return cls(d_model=d, mlp_width=width, mlp_parts=2 if gated else 1, heads=heads, n_valid=n_valid,
                   keys=skip_first + n_valid, layers_backward=max(layers_backward, 1), n_sources=n_sources,
                   element_bytes=torch.finfo(model.dtype).bits // 8, results_on_device=model.device.type == "cpu",
                   experts=experts)


def results_bytes(s: FitSizes) -> int:
    """The per-prompt results in the budgeted memory: ``[d, d]`` fp32 per source layer (and ``E`` expert
    sums each) when they live there (a CPU fit), else nothing."""
    return s.n_sources * (1 + s.experts) * s.d_model ** 2 * 4 if s.results_on_device else 0


def forward_bytes(s: FitSizes) -> int:
    """The model's own forward of the prompt, one layer's temporaries at a time: ``S (4 d + 3 F) + 2 H S^2``."""
    return (s.keys * (4 * s.d_model + 3 * s.mlp_width) + 2 * s.heads * s.keys ** 2) * s.element_bytes


def fused_prompt_bytes(s: FitSizes) -> int:
    """What the fused backward holds for the whole prompt, in bytes: per layer the attention probabilities
    (``H n (S + n)``), ``n (8 d + parts F)`` coefficients and ``3 S d`` recorded residual, keys and values;
    plus the forward's temporaries (:func:`forward_bytes`) and the results (:func:`results_bytes`)."""
    per_layer = s.heads * s.n_valid * (s.keys + s.n_valid) + s.n_valid * (8 * s.d_model + s.mlp_parts * s.mlp_width)
    per_layer += 3 * s.keys * s.d_model
    return per_layer * s.layers_backward * s.element_bytes + forward_bytes(s) + results_bytes(s)


def fused_row_bytes(s: FitSizes) -> int:
    """Bytes per row of a row-major chunk (one layer's cotangents at a time): ``n (6 d + 3 F + 2 H S)``."""
    return s.n_valid * (6 * s.d_model + 3 * s.mlp_width + 2 * s.heads * s.keys) * s.element_bytes


def attention_row_bytes(s: FitSizes) -> int:
    """Bytes per row of the layer-major order's attention chunks: ``n (6 d + 2 H S)``."""
    return s.n_valid * (6 * s.d_model + 2 * s.heads * s.keys) * s.element_bytes


def layer_major_buffer_bytes(s: FitSizes) -> int:
    """The layer-major order's buffers: three ``[n, d, d]`` and the ``[block, d, parts F]`` scaled weights
    (the same count as :func:`jlens_core.fitting.fused.layer_major_bytes`)."""
    d, n = s.d_model, s.n_valid
    return (3 * n * d * d + MLP_BLOCK * d * s.mlp_parts * s.mlp_width) * s.element_bytes


def autograd_prompt_bytes(s: FitSizes) -> int:
    """Autograd's forward graph of batch 1, in bytes: per layer about ``n (10 d + 4 F) + 2 H n S`` saved
    values; plus the forward's temporaries (:func:`forward_bytes`) and the results (:func:`results_bytes`)."""
    per_layer = s.n_valid * (10 * s.d_model + 4 * s.mlp_width) + 2 * s.heads * s.n_valid * s.keys
    return per_layer * s.layers_backward * s.element_bytes + forward_bytes(s) + results_bytes(s)


def autograd_row_bytes(s: FitSizes, replicated: bool = False) -> int:
    """Bytes per row of an autograd backward pass: one layer's batched cotangents ``n (6 d + 3 F + 2 H S)``
    and the gradients kept at every source layer (``n d`` each); ``"replicated"`` also holds a forward
    graph per row (:func:`autograd_prompt_bytes` less the results)."""
    row = s.n_valid * (6 * s.d_model + 3 * s.mlp_width + 2 * s.heads * s.keys + s.d_model * s.n_sources)
    row *= s.element_bytes
    if replicated:
        row += autograd_prompt_bytes(s) - forward_bytes(s) - results_bytes(s)
    return row


@dataclass(frozen=True)
class MemoryPlan:
    """How one prompt's backward runs within a budget.

    Attributes:
        dim_batch: rows per backward pass (per attention chunk in the layer-major order).
        layer_major: the fused method's order (``None`` for autograd).
        planned_bytes: the bytes the plan holds at its peak by the formulas here.
        budget_bytes: the budget it was made for.
    """

    dim_batch: int
    layer_major: bool | None
    planned_bytes: int
    budget_bytes: int


def _rows_within(budget: int, fixed: int, per_row: int, most: int) -> int:
    return int(max(0, min(most, (budget - fixed) // max(per_row, 1))))


def plan_memory(sizes: FitSizes, budget_bytes: int, method: str, most_rows: int | None = None) -> MemoryPlan:
    """The largest ``dim_batch`` (at most ``most_rows``, default ``d_model``) whose bytes fit ``budget_bytes``.

    ``method`` is ``"fused"``, ``"batched"`` or ``"replicated"``. The fused method takes the layer-major
    order where it fits with ``min(most_rows, LAYER_MAJOR_MIN_ROWS)`` rows per attention chunk, else the
    row-major order.

    Raises:
        MemoryBudgetError: not even ``dim_batch = 1`` fits; the sentence gives the bytes needed.
    """
    most = sizes.d_model if most_rows is None else max(1, min(most_rows, sizes.d_model))
    if method == "fused":
        fixed = fused_prompt_bytes(sizes)
        lm_fixed = fixed + layer_major_buffer_bytes(sizes)
        lm_rows = _rows_within(budget_bytes, lm_fixed, attention_row_bytes(sizes), most)
        rm_rows = _rows_within(budget_bytes, fixed, fused_row_bytes(sizes), most)
        if lm_rows >= min(most, LAYER_MAJOR_MIN_ROWS) or (lm_rows >= 1 and rm_rows == 0):
            return MemoryPlan(lm_rows, True, lm_fixed + lm_rows * attention_row_bytes(sizes), budget_bytes)
        if rm_rows >= 1:
            return MemoryPlan(rm_rows, False, fixed + rm_rows * fused_row_bytes(sizes), budget_bytes)
        needed = min(fixed + fused_row_bytes(sizes), lm_fixed + attention_row_bytes(sizes))
    else:
        fixed = autograd_prompt_bytes(sizes)
        per_row = autograd_row_bytes(sizes, replicated=method == "replicated")
        rows = _rows_within(budget_bytes, fixed, per_row, most)
        if rows >= 1:
            return MemoryPlan(rows, None, fixed + rows * per_row, budget_bytes)
        needed = fixed + per_row
    raise MemoryBudgetError(
        f"max_memory={format_bytes(budget_bytes)} is too small for this fit: one row per backward pass "
        f"({method}, d_model {sizes.d_model}, {sizes.n_valid} valid positions, {sizes.layers_backward} layers) "
        f"needs {format_bytes(needed)}; give at least that much, or a smaller max_seq_len or fewer layers.")


def budget_bytes(max_memory: int | str) -> int:
    """Bytes from ``6GiB``, ``500MiB`` or an int; a size that is not positive is a :class:`MemoryBudgetError`."""
    value = parse_size(max_memory, what="max_memory")
    if value <= 0:
        raise MemoryBudgetError(f"max_memory={max_memory!r} must be a positive size, such as 6GiB.")
    return value


# How the reported peak is measured, per device type.
PEAK_MEASURES = {
    "cuda": "torch.cuda.max_memory_allocated on the fit's device since the fit started",
    "cpu": "the whole process's resident-set high-water mark (getrusage ru_maxrss) since the process started",
}


def reset_peak_memory(device: torch.device) -> None:
    """Start the peak over on a CUDA device; the CPU's process-wide high-water mark cannot be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """The peak reached, in bytes: CUDA ``max_memory_allocated`` on ``device``; elsewhere the whole
    process's resident-set high-water mark (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def peak_measure(device: torch.device) -> str:
    """What :func:`peak_memory_bytes` measures on ``device``, in words."""
    return PEAK_MEASURES["cuda" if device.type == "cuda" else "cpu"]


__all__ = ["LAYER_MAJOR_MIN_ROWS", "FitSizes", "MemoryBudgetError", "MemoryPlan", "attention_row_bytes",
           "autograd_prompt_bytes", "autograd_row_bytes", "budget_bytes", "forward_bytes", "fused_prompt_bytes",
           "fused_row_bytes", "layer_major_buffer_bytes", "peak_measure", "peak_memory_bytes", "plan_memory",
           "reset_peak_memory", "results_bytes"]
