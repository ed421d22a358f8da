"""Where each Hugging Face model family keeps its decoder layers, final norm, embedding and head.

A layout is data, not code: a table of dotted attribute paths tried in order. Adding a family is
adding a row. ``find_layout`` returns the first row whose paths all resolve on the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


@dataclass(frozen=True)
class ModelLayout:
    """Dotted attribute paths (from the ``*ForCausalLM`` object) to the parts a lens needs.

    ``final_norm`` may be ``None`` for families without one (OPT-350m). ``pre_head`` lists
    optional modules applied between the final norm and the head (OPT's ``project_out``).
    ``attn`` / ``mlp`` are paths *inside one decoder layer* to its attention and MLP sublayers,
    used only by hidden-state dumps.
    """

    name: str
    base: str  # the decoder stack module whose forward runs embedding -> layers -> final norm
    layers: str
    final_norm: str | None
    embed: str
    head: str
    pre_head: tuple[str, ...] = ()
    attn: str | None = None
    mlp: str | None = None
    extra: dict = field(default_factory=dict)


# Order matters: more specific paths first (``model.language_model`` before ``model``).
LAYOUTS: tuple[ModelLayout, ...] = (
    ModelLayout("multimodal-language-model", "model.language_model", "model.language_model.layers",
                "model.language_model.norm", "model.language_model.embed_tokens", "lm_head",
                attn="self_attn", mlp="mlp"),
    ModelLayout("language-model-wrapper", "language_model.model", "language_model.model.layers",
                "language_model.model.norm", "language_model.model.embed_tokens", "language_model.lm_head",
                attn="self_attn", mlp="mlp"),
    ModelLayout("opt", "model.decoder", "model.decoder.layers", "model.decoder.final_layer_norm",
                "model.decoder.embed_tokens", "lm_head", pre_head=("model.decoder.project_out",),
                attn="self_attn", mlp=None),
    ModelLayout("llama-like", "model", "model.layers", "model.norm", "model.embed_tokens", "lm_head",
                attn="self_attn", mlp="mlp"),
    ModelLayout("phi", "model", "model.layers", "model.final_layernorm", "model.embed_tokens", "lm_head",
                attn="self_attn", mlp="mlp"),
    ModelLayout("gpt2", "transformer", "transformer.h", "transformer.ln_f", "transformer.wte", "lm_head",
                attn="attn", mlp="mlp"),
    ModelLayout("gpt-neox", "gpt_neox", "gpt_neox.layers", "gpt_neox.final_layer_norm",
                "gpt_neox.embed_in", "lm_head", attn="attention", mlp="mlp"),
    ModelLayout("gpt-neox-legacy", "gpt_neox", "gpt_neox.layers", "gpt_neox.final_layer_norm",
                "gpt_neox.embed_in", "embed_out", attn="attention", mlp="mlp"),
)


def get_path(root: nn.Module, path: str | None):
    """Resolve a dotted attribute path; ``None`` when any part is missing or ``None``."""
    if path is None:
        return None
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def find_layout(model: nn.Module) -> ModelLayout:
    """Return the first layout of ``LAYOUTS`` whose required paths all exist on ``model``.

    Raises:
        ValueError: no layout matches; the message lists every path looked for.
    """
    for layout in LAYOUTS:
        required = [layout.base, layout.layers, layout.embed, layout.head]
        if layout.final_norm is not None and layout.name != "opt":
            required.append(layout.final_norm)
        if all(get_path(model, p) is not None for p in required) and isinstance(
                get_path(model, layout.layers), (nn.ModuleList, nn.Sequential)):
            return layout
    tried = "; ".join(
        f"{lay.name}: layers={lay.layers}, norm={lay.final_norm}, embed={lay.embed}, head={lay.head}"
        for lay in LAYOUTS
    )
    raise ValueError(
        f"Cannot find the decoder layers, final norm, embedding and output head of "
        f"{type(model).__name__}. Looked for: {tried}. Pass an explicit "
        f"layout=ModelLayout(...) to HFLensModel for this architecture."
    )
