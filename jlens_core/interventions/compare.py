"""A clean and an edited run of the same prompt, side by side: next-token top-k and continuations.

The result, :class:`~jlens_core.reading.run_comparison.RunComparison`, is defined with the readings
(a reading file holds one) and re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from ..models.model import LensModel
from ..reading.generation import generate
from ..reading.run_comparison import RunComparison


def compare_runs(model: LensModel, prompt: str, edits: Sequence[Any], *, max_new_tokens: int = 20, chat: bool = False,
                 top_k: int = 10, progress=None) -> RunComparison:
    """Greedy continuations of ``prompt`` without and with ``edits``, and their next-token top-k."""
    clean = generate(model, prompt, max_new_tokens=max_new_tokens, chat=chat, top_k=top_k, progress=progress)
    edited = generate(model, prompt, max_new_tokens=max_new_tokens, chat=chat, top_k=top_k, edits=list(edits),
                      progress=progress)
    rows = [{"clean_token": model.decode([int(a)]), "clean_prob": float(pa),
             "edited_token": model.decode([int(b)]), "edited_prob": float(pb)}
            for a, pa, b, pb in zip(clean.top_ids[0], clean.top_probs[0], edited.top_ids[0], edited.top_probs[0])]
    first = next((i for i, (a, b) in enumerate(zip(clean.generated_ids, edited.generated_ids)) if a != b), None)
    if first is None and clean.n_generated != edited.n_generated:
        first = min(clean.n_generated, edited.n_generated)
    return RunComparison(clean, edited, pd.DataFrame(rows), first)


__all__ = ["RunComparison", "compare_runs"]
