"""``RunComparison``: a clean and an edited run of one prompt, as data (made by
:func:`~jlens_core.interventions.compare.compare_runs`).

It lives with the readings, not with the edits, so that a reading file
(:mod:`~jlens_core.reading.reading_file`) can hold one and give it back without the edits' code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

    from .generation import Generation

NEXT_TOKEN_COLUMNS = ("clean_token", "clean_prob", "edited_token", "edited_prob")


@dataclass
class RunComparison:
    """What :func:`~jlens_core.interventions.compare.compare_runs` returns.

    Attributes:
        clean, edited: the two :class:`~jlens_core.reading.generation.Generation` runs (greedy).
        next_tokens: the first step's top-k, ``rank`` rows with ``clean_token, clean_prob,
            edited_token, edited_prob`` (probabilities of the next token after the prompt).
        first_difference: the index of the first generated token where they differ (``None``: same).
    """

    clean: Generation
    edited: Generation
    next_tokens: pd.DataFrame
    first_difference: int | None

    def figure(self, *, k: int = 10) -> Any:
        """The next token after the prompt, clean vs edited: top-k bars side by side, as a Plotly figure
        (the app's Intervene panel; :func:`~jlens_core.figures.interventions.comparison_figure`)."""
        from ..figures.interventions import comparison_figure

        return comparison_figure(self, k=k)


__all__ = ["NEXT_TOKEN_COLUMNS", "RunComparison"]
