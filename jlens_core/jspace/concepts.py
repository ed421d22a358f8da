"""Concept vectors (docs/method.md §11.4): the mean residual at a position over prompts that evoke a concept minus
the mean over baseline prompts (the paper: "Tell me about {concept}" minus the mean over 100 other concepts; a
two-hop intermediate's probe: the mean over prompts that imply it minus the mean over all intermediates).

A prompt is a string (tokenized as :meth:`~jlens_core.LensModel.encode` does, special tokens included) or a list
of chat turns ``[{"role": ..., "content": ...}]``, which goes through the tokenizer's chat template (with the
assistant header appended when the last turn is not the assistant's).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from jaxtyping import Float

from ..layerspec import normalise_layers
from ..models.model import LensModel
from ..reading.inputs import record_residuals

Prompt = str | Sequence[Mapping[str, str]]


def prompt_ids(model: LensModel, prompt: Prompt) -> torch.Tensor:
    """``LongTensor[1, seq]`` of a prompt (module docstring).

    Raises:
        ValueError: an empty prompt, a malformed chat turn, or chat turns for a tokenizer with no chat template.
    """
    if isinstance(prompt, str):
        return model.encode(prompt)
    turns = list(prompt)
    if not turns or not all(isinstance(t, Mapping) and {"role", "content"} <= set(t) for t in turns):
        raise ValueError(f"Prompt {prompt!r} is neither text nor a list of chat turns {{'role', 'content'}}.")
    tokenizer: Any = model.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"The tokenizer of {model.name!r} has no chat template, so chat-turn prompts cannot be "
                         "encoded: give plain-text prompts.")
    out = tokenizer.apply_chat_template([dict(t) for t in turns], tokenize=True,
                                        add_generation_prompt=turns[-1]["role"] != "assistant")
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)
    if ids.numel() == 0:
        raise ValueError(f"The chat prompt {turns!r} encodes to no tokens.")
    return ids.to(model.device)


def _mean_at(model: LensModel, prompts: Iterable[Prompt], layers: list[int], position: int,
             what: str) -> dict[int, torch.Tensor]:
    sums: dict[int, torch.Tensor] = {}
    count = 0
    for prompt in prompts:
        ids = prompt_ids(model, prompt)
        seq = int(ids.shape[-1])
        if not -seq <= int(position) < seq:
            raise ValueError(f"Position {position} is outside a {what} prompt of {seq} tokens ({prompt!r}).")
        recorded = record_residuals(model, ids, layers)
        for layer in layers:
            row = recorded[layer][int(position)].float().cpu()
            sums[layer] = sums[layer] + row if layer in sums else row.clone()
        count += 1
    if not count:
        raise ValueError(f"No {what} prompts: give at least one.")
    return {layer: total / count for layer, total in sums.items()}


def concept_vectors(model: LensModel, prompts: Sequence[Prompt], baseline_prompts: Sequence[Prompt], *,
                    layers: Iterable[int], position: int = -1) -> dict[int, Float[torch.Tensor, " d_model"]]:
    """``{layer: mean_p h_l(p)[position] - mean_b h_l(b)[position]}`` fp32 ``[d_model]`` each (module docstring).

    Args:
        model: the model.
        prompts: prompts that evoke the concept (strings or chat-turn lists).
        baseline_prompts: the baseline (other concepts, the same template).
        layers: decoder layers (negatives count from the end).
        position: the token position read in every prompt (negatives count from the end; default the last).

    Raises:
        ValueError: no prompts on either side, a position outside a prompt, a layer outside the model, or chat turns
            for a tokenizer with no chat template.
        TypeError: one string where a list of prompts belongs.
    """
    chosen = normalise_layers(layers, int(model.n_layers))
    if isinstance(prompts, str) or isinstance(baseline_prompts, str):
        raise TypeError("prompts and baseline_prompts are lists of prompts, not one string: wrap it in a list.")
    concept = _mean_at(model, prompts, chosen, position, "concept")
    base = _mean_at(model, baseline_prompts, chosen, position, "baseline")
    return {layer: concept[layer] - base[layer] for layer in chosen}


def concept_vector(model: LensModel, layer: int, prompts: Sequence[Prompt], baseline_prompts: Sequence[Prompt], *,
                   position: int = -1) -> Float[torch.Tensor, " d_model"]:
    """:func:`concept_vectors` at one layer."""
    vectors = concept_vectors(model, prompts, baseline_prompts, layers=[layer], position=position)
    return next(iter(vectors.values()))


__all__ = ["Prompt", "concept_vector", "concept_vectors", "prompt_ids"]
