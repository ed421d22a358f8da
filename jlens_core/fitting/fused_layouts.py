"""Which families the fused backward covers, where their decoder layers keep each part, and their weights.

A :class:`FusedLayout` is data: the module paths inside one decoder layer, the norm kind
(:mod:`~jlens_core.fitting.fused_norms`), how the attention projects queries, keys and values, a
gated or plain MLP, and how the two halves meet the residual stream (docs/method.md §2.2):

* sequential (Llama, Mistral, Qwen2, Gemma, Gemma 2, GPT-2): ``y = x + attn(norm1(x))``,
  ``h = y + mlp(norm2(y))``; Gemma 2 also normalises each branch's output (post-norms);
* parallel (GPT-NeoX): ``h = x + attn(norm1(x)) + mlp(norm2(x))``;
* parallel with one norm (Phi): ``h = x + attn(norm(x)) + mlp(norm(x))``.

:func:`fused_unsupported_reason` says why a model is not covered; :class:`LayerWeights` holds one
layer's weights in ``nn.Linear`` orientation (``[out, in]``; GPT-2's ``Conv1D`` weights are
transposed views), read where they live (:func:`layer_weights` materialises offloaded ones).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..models.layouts import get_path
from ..models.model import LensModel
from ..models.placement import materialised
from .fused_activations import ACTIVATION_CLASSES, activation_kind


@dataclass(frozen=True)
class FusedLayout:
    """One family's decoder layer, as the fused backward reads it (paths relative to the layer)."""

    norm: str  # "rms" | "rms_one_plus" | "layer" (fused_norms.NORM_KINDS)
    attn: str  # the attention module
    attn_norm: str  # the norm before the attention
    mlp_norm: str | None  # the norm before the MLP; None: the MLP reads the attention's normed input
    qkv: str  # "separate" (q, k, v paths below), "gpt2" (one Conv1D, [q | k | v]), "neox" (per head [q k v])
    q: str  # inside attn: q / k / v projections ("separate"), or the fused projection (q only)
    k: str | None
    v: str | None
    o: str  # inside attn: the output projection
    mlp_in: tuple[str, ...]  # gated: (gate, up); plain: (fc_in,)
    mlp_out: str
    act: str  # the activation module
    rotary: bool  # rotary embeddings from the stack's rotary_emb (partial when its width is < head_dim)
    parallel: bool = False
    attn_post_norm: str | None = None  # Gemma 2: a norm on the attention's output, before the residual
    mlp_post_norm: str | None = None

    @property
    def gated(self) -> bool:
        return len(self.mlp_in) == 2

    def paths(self) -> tuple[str, ...]:
        """Every module path this layout reads in a layer."""
        inner = [self.q, self.k, self.v, self.o]
        attn = [f"{self.attn}.{p}" for p in inner if p is not None]
        norms = [self.attn_norm, self.mlp_norm, self.attn_post_norm, self.mlp_post_norm]
        return (*[n for n in norms if n is not None], *attn, *self.mlp_in, self.mlp_out, self.act)


_LLAMA = FusedLayout(norm="rms", attn="self_attn", attn_norm="input_layernorm", mlp_norm="post_attention_layernorm",
                     qkv="separate", q="q_proj", k="k_proj", v="v_proj", o="o_proj",
                     mlp_in=("mlp.gate_proj", "mlp.up_proj"), mlp_out="mlp.down_proj", act="mlp.act_fn",
                     rotary=True)
_GEMMA = FusedLayout(**{**_LLAMA.__dict__, "norm": "rms_one_plus"})
_GEMMA2 = FusedLayout(**{**_GEMMA.__dict__, "mlp_norm": "pre_feedforward_layernorm",
                         "attn_post_norm": "post_attention_layernorm", "mlp_post_norm": "post_feedforward_layernorm"})
_GPT2 = FusedLayout(norm="layer", attn="attn", attn_norm="ln_1", mlp_norm="ln_2", qkv="gpt2", q="c_attn", k=None,
                    v=None, o="c_proj", mlp_in=("mlp.c_fc",), mlp_out="mlp.c_proj", act="mlp.act", rotary=False)
_NEOX = FusedLayout(norm="layer", attn="attention", attn_norm="input_layernorm", mlp_norm="post_attention_layernorm",
                    qkv="neox", q="query_key_value", k=None, v=None, o="dense",
                    mlp_in=("mlp.dense_h_to_4h",), mlp_out="mlp.dense_4h_to_h", act="mlp.act", rotary=True,
                    parallel=True)
_PHI = FusedLayout(norm="layer", attn="self_attn", attn_norm="input_layernorm", mlp_norm=None, qkv="separate",
                   q="q_proj", k="k_proj", v="v_proj", o="dense", mlp_in=("mlp.fc1",), mlp_out="mlp.fc2",
                   act="mlp.activation_fn", rotary=True, parallel=True)

# config.model_type -> layout
FUSED_LAYOUTS: dict[str, FusedLayout] = {
    "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "gemma": _GEMMA, "gemma2": _GEMMA2,
    "gpt2": _GPT2, "gpt_neox": _NEOX, "phi": _PHI,
}
FUSED_MODEL_TYPES = tuple(FUSED_LAYOUTS)


def layout_for(model: LensModel) -> FusedLayout:
    """``model``'s layout (GPT-NeoX without a parallel residual is sequential)."""
    config = model.config
    layout = FUSED_LAYOUTS[config.model_type]
    if config.model_type == "gpt_neox" and not getattr(config, "use_parallel_residual", True):
        layout = FusedLayout(**{**layout.__dict__, "parallel": False})
    return layout


def fused_unsupported_reason(model: LensModel) -> str | None:
    """Why the fused backward cannot run on ``model`` (``None`` when it can).

    Checks the family (``config.model_type`` in :data:`FUSED_MODEL_TYPES`), the activation module
    (SiLU or a GELU: :data:`~jlens_core.fitting.fused_activations.ACTIVATION_CLASSES`), the parts a family may switch on that
    the backward does not model (tensor-parallel slices, q/k norms, cross-attention), the
    rotary-embedding module, and the module names of every decoder layer. A model spread over
    devices or with offloaded weights is supported: each layer runs where it lives.
    """
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in FUSED_LAYOUTS:
        return f"model_type {model_type!r} is not one of {FUSED_MODEL_TYPES}"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    if getattr(config, "qk_layernorm", False):
        return "q/k layer norms (qk_layernorm)"
    if getattr(config, "add_cross_attention", False):
        return "cross-attention layers (add_cross_attention)"
    layout = layout_for(model)
    if layout.rotary and getattr(model.base, "rotary_emb", None) is None:  # a module of the family's own code
        return "no rotary_emb module on the decoder stack"
    for i, layer in enumerate(model.layers):
        for path in layout.paths():
            if get_path(layer, path) is None:
                return f"layer {i} has no {path}"
        act = get_path(layer, layout.act)
        if activation_kind(act) is None:
            return (f"the MLP activation {type(act).__name__} of layer {i} is not one of "
                    f"{tuple(sorted(ACTIVATION_CLASSES))}")
    return None


def is_conv1d(module: nn.Module) -> bool:
    """GPT-2's ``Conv1D``: a linear map whose weight is stored ``[in, out]``."""
    return type(module).__name__ == "Conv1D"


def linear_weight(module: nn.Module) -> torch.Tensor:
    """The weight of a linear map in ``nn.Linear`` orientation, ``[out, in]`` (a view for ``Conv1D``)."""
    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    return weight.t() if is_conv1d(module) else weight


def apply_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The linear map of ``module`` (``nn.Linear`` or ``Conv1D``) applied to ``x`` [m, in], with its bias."""
    bias = getattr(module, "bias", None)
    return nn.functional.linear(x, linear_weight(module), bias)


@dataclass
class LayerWeights:
    """One decoder layer's weights (``[out, in]``), for the backward; views of the module's tensors."""

    qkv: tuple[torch.Tensor, ...]  # "separate": (W_q, W_k, W_v); fused layouts: (W_qkv,)
    o: torch.Tensor  # [d, H * hd]
    mlp_in: tuple[torch.Tensor, ...]  # gated: (W_gate, W_up) [ff, d]; plain: (W_in,)
    mlp_out: torch.Tensor  # [d, ff]


def _weights(layout: FusedLayout, layer: nn.Module) -> LayerWeights:
    attn = get_path(layer, layout.attn)
    qkv = tuple(linear_weight(get_path(attn, p)) for p in (layout.q, layout.k, layout.v) if p is not None)
    return LayerWeights(qkv=qkv, o=linear_weight(get_path(attn, layout.o)),
                        mlp_in=tuple(linear_weight(get_path(layer, p)) for p in layout.mlp_in),
                        mlp_out=linear_weight(get_path(layer, layout.mlp_out)))


@contextlib.contextmanager
def layer_weights(layout: FusedLayout, layer: nn.Module, offloaded: bool) -> Iterator[LayerWeights]:
    """``layer``'s weights inside the block; an ``offloaded`` layer's are loaded once for the block
    (:func:`~jlens_core.models.placement.materialised`) and offloaded again after it."""
    if not offloaded:
        yield _weights(layout, layer)
        return
    with materialised(layer):
        yield _weights(layout, layer)
