"""``RunComparison``: a clean and an edited run of one prompt, as data (made by
:func:`~jlens_core.interventions.compare.compare_runs`).

It lives with the readings, not with the edits, so that a reading file
(:mod:`~jlens_core.reading.reading_file`) can hold one and give it back without the edits' code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
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
        readout_kl_bits: the edit's readout side effect, ``KL(edited || clean)`` in bits of the next-token
            distributions after the prompt over the tokens other than ``readout_excluded`` (both renormalised
            without them; docs/method.md §7.2). downstream_kl_bits, downstream_kl_max_bits: the mean and the
            largest ``KL(edited || clean)`` over the clean continuation teacher-forced with the edit (bits).
            NaN where not computed (a comparison saved before these figures existed).
        readout_excluded: the tokens left out of the readout divergence (the edit's target).
    """

    clean: Generation
    edited: Generation
    next_tokens: pd.DataFrame
    first_difference: int | None
    readout_kl_bits: float = math.nan
    downstream_kl_bits: float = math.nan
    downstream_kl_max_bits: float = math.nan
    readout_excluded: list[str] = field(default_factory=list)

    def side_effects(self) -> str:
        """The side effects in words: ``readout KL 0.12 bits (without ' Berlin'), downstream KL 0.03 bits
        (max 0.2) over 20 tokens``."""
        if math.isnan(self.readout_kl_bits):
            return "side effects not computed"
        left_out = f" (without {', '.join(repr(t) for t in self.readout_excluded)})" if self.readout_excluded else ""
        text = f"readout KL {self.readout_kl_bits:.3g} bits{left_out}"
        if not math.isnan(self.downstream_kl_bits):
            text += (f", downstream KL {self.downstream_kl_bits:.3g} bits (max {self.downstream_kl_max_bits:.3g}) "
                     f"over the clean continuation's {self.clean.n_generated} tokens")
        return text

    def figure(self, *, k: int = 10) -> Any:
        """The next token after the prompt, clean vs edited: top-k bars side by side, as a Plotly figure
        (the app's Intervene panel; :func:`~jlens_core.figures.interventions.comparison_figure`)."""
        from ..figures.interventions import comparison_figure

        return comparison_figure(self, k=k)


__all__ = ["NEXT_TOKEN_COLUMNS", "RunComparison"]
