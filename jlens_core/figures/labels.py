"""Names, colours and token text shared by the figures (and the app's controls). No plotly here.

Tokens are drawn as the reading displays them; a whitespace-only token gets glyphs so it can be seen
(:func:`shown`), and every string that goes into Plotly text is escaped (:func:`esc`).
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

from ..lenses.kinds import KINDS
from ..reading.tokens import display_ids, visible

# by lens kind (jlens_core.lenses.kinds), in the order panels and legends list them
LENS_NAMES = {k.kind: k.label for k in KINDS}
LENS_SHORT = {k.kind: k.short for k in KINDS}  # in "B − A"
LENS_ABBR = {k.kind: k.abbr for k in KINDS}  # the difference's colour bar
# the line styles and colours also by the name the app gives a loaded lens of a kind ("J++"): drawn alike
LENS_DASHES = {k.kind: k.dash for k in KINDS} | {k.tag: k.dash for k in KINDS if k.tag not in LENS_NAMES}
LENS_COLORS = {k.kind: k.colour for k in KINDS} | {k.tag: k.colour for k in KINDS if k.tag not in LENS_NAMES}
STAT_LABELS = {"top1_prob": "top-1 probability", "entropy_bits": "entropy (bits)", "kl_bits": "KL to final (bits)",
               "ce_bits": "next-token CE (bits)", "next_token_rank": "rank of next token",
               "final_top1_rank": "rank of final top-1"}
RANK_STATS = ("next_token_rank", "final_top1_rank")
HIGHER_IS_BETTER = ("top1_prob",)
SELECTED_COLOUR = "#ff2b2b"  # the outline of the cell the detail panel shows
GENERATED_COLOUR = "#c2410c"  # tick labels of generated tokens
UNFITTED_FILL = "rgba(120, 120, 120, 0.45)"  # the shade over positions before a lens's skip_first


def esc(text: str) -> str:
    """Escape a token for Plotly text (which reads a little HTML)."""
    return html.escape(str(text), quote=False)


def shown(token: str) -> str:
    """A whitespace-only token is shown with glyphs (``·`` for a space, ``∅`` if empty), so it can be seen."""
    return token if token.strip() else (visible(token, show_whitespace=True) or "∅")


def short(text: str, n: int = 10) -> str:
    """``text`` cut to ``n`` characters, the last one an ellipsis when cut."""
    return text if len(text) <= n else text[: n - 1] + "…"


def cell_text(token: str, max_chars: int) -> str:
    """A token as written in a cell (escaped, shortened to ``max_chars``)."""
    return esc(short(shown(token), max_chars))


def token_names(reading: Any, ids: Sequence[int]) -> list[str]:
    """Display strings of token ids, from the reading's vocabulary strings."""
    return display_ids(reading.vocab_strings, ids)


def is_rank(stat: str) -> bool:
    """Whether a statistic is a rank (drawn on a log scale, written as an integer)."""
    return stat in RANK_STATS or stat.startswith("rank_")


def fmt(stat: str, value: float | None) -> str:
    """A statistic's value as written in a hover label (``–`` for missing)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if is_rank(stat):
        return f"{int(value):,}"
    if stat == "top1_prob":
        return f"{value:.1%}"
    return f"{value:.2f}"


def row_labels(layers: Sequence[int], output_layer: int) -> list[str]:
    """``L0, L1, ...`` with the model's output row named as such."""
    return [f"output (L{layer})" if layer == output_layer else f"L{layer}" for layer in layers]


def column_labels(reading: Any) -> list[str]:
    """``"<position>: <token>"`` per read position; generated tokens end in ``" ✎"``."""
    n_prompt = int(getattr(reading, "n_prompt", None) or len(reading.input_ids))
    return [f"{p}: {short(t)}" + (" ✎" if p >= n_prompt else "")
            for p, t in zip(reading.positions.tolist(), reading.position_tokens)]


def unfitted_note(reading: Any) -> str:
    """The hover line of a cell at a position the reading's lens was never fitted on (before its ``skip_first``)."""
    return (f"<br><i>not fitted: position &lt; skip_first={int(reading.skip_first)} of this lens "
            "(its fit averaged later positions only)</i>")


__all__ = ["GENERATED_COLOUR", "HIGHER_IS_BETTER", "LENS_ABBR", "LENS_COLORS", "LENS_DASHES", "LENS_NAMES",
           "LENS_SHORT", "RANK_STATS", "SELECTED_COLOUR", "STAT_LABELS", "UNFITTED_FILL", "cell_text", "column_labels",
           "esc", "fmt", "is_rank", "row_labels", "short", "shown", "token_names", "unfitted_note"]
