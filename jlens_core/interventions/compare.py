"""A clean and an edited run of the same prompt, side by side: next-token top-k, continuations, and what else the
edit moved (the side effects of docs/method.md §7.2).

The result, :class:`~jlens_core.reading.run_comparison.RunComparison`, is defined with the readings
(a reading file holds one) and re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd
import torch

from ..models.model import LensModel
from ..reading.generation import generate
from ..reading.run_comparison import RunComparison
from ..reading.tokens import spellings
from .side_effects import teacher_forced_side_effects


def target_ids(model: LensModel, target: str | int) -> set[int]:
    """The token ids an edit's ``target`` stands for: an id, or every single-token spelling of a word.

    Raises:
        ValueError: a word with no single-token spelling, or an id outside the vocabulary.
    """
    if isinstance(target, int) and not isinstance(target, bool):
        if not 0 <= target < model.vocab_size:
            raise ValueError(f"Target id {target} is outside the vocabulary (0..{model.vocab_size - 1}).")
        return {int(target)}
    found = set(spellings(model.tokenizer, str(target).strip(), vocab_size=model.vocab_size).values())
    if not found:
        raise ValueError(f"The target {target!r} has no single-token spelling: give one vocabulary token, or its id.")
    return found


def compare_runs(model: LensModel, prompt: str, edits: Sequence[Any], *, max_new_tokens: int = 20, chat: bool = False,
                 top_k: int = 10, progress=None, target: str | int | None = None) -> RunComparison:
    """Greedy continuations of ``prompt`` without and with ``edits``, their next-token top-k, and the edit's side
    effects (docs/method.md §7.2): the readout divergence over the tokens other than ``target``'s and the
    downstream divergence over the clean continuation teacher-forced with ``edits``.

    Args:
        target: the token the edit aims at, left out of the readout divergence: a word (its single-token
            spellings) or a token id; ``None``: the token the edited model writes first (and its spellings).

    Raises:
        ValueError: a ``target`` with no single-token spelling (and what :func:`generate` raises).
    """
    excluded = target_ids(model, target) if target is not None else None
    clean = generate(model, prompt, max_new_tokens=max_new_tokens, chat=chat, top_k=top_k, progress=progress)
    edited = generate(model, prompt, max_new_tokens=max_new_tokens, chat=chat, top_k=top_k, edits=list(edits),
                      progress=progress)
    rows = [{"clean_token": model.decode([int(a)]), "clean_prob": float(pa),
             "edited_token": model.decode([int(b)]), "edited_prob": float(pb)}
            for a, pa, b, pb in zip(clean.top_ids[0], clean.top_probs[0], edited.top_ids[0], edited.top_probs[0])]
    first = next((i for i, (a, b) in enumerate(zip(clean.generated_ids, edited.generated_ids)) if a != b), None)
    if first is None and clean.n_generated != edited.n_generated:
        first = min(clean.n_generated, edited.n_generated)
    if excluded is None:
        written = int(edited.generated_ids[0])
        word = model.decode([written]).strip()
        excluded = {written} | (set(spellings(model.tokenizer, word, vocab_size=model.vocab_size).values())
                                if word else set())
    prompt_ids = torch.as_tensor(clean.prompt_ids, dtype=torch.long, device=model.device).reshape(1, -1)
    effects = teacher_forced_side_effects(model, prompt_ids, [int(t) for t in clean.generated_ids], list(edits),
                                          excluded)
    return RunComparison(clean, edited, pd.DataFrame(rows), first, readout_kl_bits=effects.readout_bits,
                         downstream_kl_bits=effects.downstream_bits,
                         downstream_kl_max_bits=effects.downstream_max_bits,
                         readout_excluded=[model.decode([t]) for t in sorted(excluded)])


__all__ = ["RunComparison", "compare_runs", "target_ids"]
