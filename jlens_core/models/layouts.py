"""Where each Hugging Face model family keeps its decoder layers, final norm, embedding and head.

A layout is data: dotted attribute paths. ``find_layout`` first tries the table :data:`LAYOUTS`
(known families, in order), then finds the parts by structure (:func:`structural_layout`): the
input embedding and output head the model declares (``get_input_embeddings`` /
``get_output_embeddings``), the one ``ModuleList`` of repeated blocks under the module that holds
that embedding, the norm the stack declares after those blocks, and any readout module between the
stack and the head (a BERT-style prediction head).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass(frozen=True)
class ModelLayout:
    """Dotted attribute paths (from the ``*ForCausalLM`` object) to the parts a lens needs.

    ``final_norm`` may be ``None`` for families without one (OPT-350m, post-norm BERT). ``pre_head``
    lists optional modules applied between the final norm and the head (OPT's ``project_out``).
    ``readout``, when set, is a module whose forward maps the final-normed hidden state to the
    logits and which contains the head (BERT's ``cls``, RoBERTa's ``lm_head``); ``pre_head`` is then
    unused.
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
    readout: str | None = None


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
    # XLM keeps each layer's parts in parallel lists; the residual after layer i is layer_norm2[i]'s output
    ModelLayout("xlm", "transformer", "transformer.layer_norm2", None, "transformer.embeddings",
                "pred_layer.proj"),
)

# Blocks of these are never the decoder stack (a vision or audio tower of a multimodal model).
_TOWER_WORDS = ("vision", "image", "visual", "audio", "speech", "vqmodel", "vqvae")
_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f", "ln_out", "layer_norm",
               "layernorm", "final_norm", "embedding_norm", "output_layernorm", "norm_out")


def get_path(root: nn.Module, path: str | None) -> Any:
    """Resolve a dotted attribute path; ``None`` when any part is missing or ``None``.

    Returns ``Any``: a module, a module list or a parameter, as the path names (found by name).
    """
    if path is None:
        return None
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _module_names(model: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules() if name}


def _common_prefix(a: str, b: str) -> str:
    pa, pb = a.split("."), b.split(".")
    out = []
    for x, y in zip(pa, pb):
        if x != y:
            break
        out.append(x)
    return ".".join(out)


def _is_norm(name: str, module: nn.Module) -> bool:
    cls = type(module).__name__.lower()
    return (name.lower() in _NORM_NAMES or "norm" in cls) and not isinstance(module, (nn.ModuleList, nn.Embedding))


def structural_layout(model: nn.Module) -> ModelLayout | None:
    """Find the parts of ``model`` by structure; ``None`` where no decoder stack is found.

    * embedding / head: ``get_input_embeddings()`` / ``get_output_embeddings()``;
    * layers: among the ``nn.ModuleList`` s of >= 2 modules that sit in no other such list and in no
      vision/audio tower, the one that shares the deepest parent with the embedding (then the longest);
    * base: that deepest common parent (its forward runs embedding -> layers -> final norm);
    * final norm: the last norm-like module declared after the layers, walking from the layers'
      parent up to the base (``norm``, ``ln_f``, ``final_layer_norm``, a ``*Norm`` class, ...);
    * readout: when the head sits inside a top-level module of its own (BERT's ``cls``), that module;
      else the top-level modules declared before the head (ModernBERT's prediction head) are pre-head.
    """
    # ``model`` is any torch module handed in (not a LensModel): transformers' accessors may be absent
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    try:
        embed = get_in() if callable(get_in) else None
        head = get_out() if callable(get_out) else None
    except (NotImplementedError, AttributeError):
        return None
    names = _module_names(model)
    embed_path, head_path = names.get(id(embed)), names.get(id(head))
    if embed_path is None or head_path is None or getattr(head, "weight", None) is None:
        return None
    lists = [(name, m) for name, m in model.named_modules()
             if name and isinstance(m, nn.ModuleList) and len(m) >= 2
             and not any(w in name.lower() for w in _TOWER_WORDS)]
    outer = [(name, m) for name, m in lists if not any(name.startswith(o + ".") for o, _ in lists if o != name)]
    if not outer:
        return None

    def score(item):
        name, m = item
        return (len(_common_prefix(name, embed_path).split(".")) if _common_prefix(name, embed_path) else 0, len(m))

    layers_path, _ = max(outer, key=score)
    base_path = _common_prefix(layers_path, embed_path)
    if not base_path or base_path == layers_path:
        return None
    # the final norm: declared after the layers, from the layers' parent up to the base
    final_norm = None
    parts = layers_path.split(".")
    for depth in range(len(parts) - 1, len(base_path.split(".")) - 1, -1):
        parent_path, child = ".".join(parts[:depth]), parts[depth]
        parent = get_path(model, parent_path)
        seen, found = False, None
        for name, module in parent.named_children():
            if name == child:
                seen = True
            elif seen and _is_norm(name, module):
                found = f"{parent_path}.{name}"
        if found:
            final_norm = found
            break
    top = head_path.split(".")[0]
    readout: str | None = None
    pre_head: tuple[str, ...] = ()
    if top != head_path and top != base_path.split(".")[0]:
        readout = top
    elif "." not in head_path:
        before = []
        for name, module in model.named_children():
            if name == head_path:
                break
            if name != base_path.split(".")[0] and any(True for _ in module.parameters()):
                before.append(name)
        pre_head = tuple(before)
    return ModelLayout("structural", base_path, layers_path, final_norm, embed_path, head_path,
                       pre_head=pre_head, readout=readout)


def find_layout(model: nn.Module) -> ModelLayout:
    """The first layout of ``LAYOUTS`` whose required paths all exist on ``model``, else the structural one.

    Raises:
        ValueError: no layout matches and none is found by structure; the message lists every
            path looked for.
    """
    for layout in LAYOUTS:
        required = [layout.base, layout.layers, layout.embed, layout.head]
        if layout.final_norm is not None and layout.name != "opt":
            required.append(layout.final_norm)
        if all(get_path(model, p) is not None for p in required) and isinstance(
                get_path(model, layout.layers), (nn.ModuleList, nn.Sequential)):
            if layout.final_norm is not None and get_path(model, layout.final_norm) is None:
                # OPT without a final norm, or a BART-style decoder whose norm has another name
                found = structural_layout(model)
                if found is not None and found.final_norm is not None and found.layers == layout.layers:
                    return found
            return layout
    found = structural_layout(model)
    if found is not None:
        return found
    tried = "; ".join(
        f"{lay.name}: layers={lay.layers}, norm={lay.final_norm}, embed={lay.embed}, head={lay.head}"
        for lay in LAYOUTS
    )
    raise ValueError(
        f"Cannot find the decoder layers, final norm, embedding and output head of "
        f"{type(model).__name__}. Looked for: {tried}; and by structure (a ModuleList of blocks under "
        f"the module holding get_input_embeddings()). Pass an explicit "
        f"layout=ModelLayout(...) to HFLensModel for this architecture."
    )
