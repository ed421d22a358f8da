"""``PromptReading``: the statistics of one prompt read through one lens, layer x position (docs/method.md §6).

Built by :func:`~jlens_core.reading.reader.read_prompts`; its arrays are indexed
``[layer_index, position_index]``, and :attr:`PromptReading.frame` is the long DataFrame.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ..lenses.protocol import Lens, recorded_skip_first
from .file_format import pick_reading, read_file, write_readings
from .stability import STABILITY_COLUMNS, Stability, stability_by_layer
from .tokens import TokenDisplay, display_ids
from .word_readout import word_mask

if TYPE_CHECKING:
    from ..models.model import LensModel

FRAME_COLUMNS = ("layer", "position", "token", "segment", "fitted", "top_ids", "top_tokens", "top_probs",
                 "entropy_bits", "kl_bits", "ce_bits", "next_token_rank", "final_top1_rank")
GRID_STATS = ("entropy_bits", "kl_bits", "ce_bits", "next_token_rank", "final_top1_rank", "top1_prob")


@dataclass(eq=False)
class PromptReading:
    """What :func:`read_prompt` returns: statistics for every readable layer x read position.

    Array attributes are indexed ``[layer_index, position_index]`` along :attr:`layers` and
    :attr:`positions` (``n_layers`` rows, ``n_positions`` columns).

    Attributes:
        text: the prompt text (decoded from the ids when ids were given).
        model_name: the model's name.
        lens_kind: ``"jacobian"`` or ``"logit"``.
        input_ids: ``int64[seq]`` the prompt's token ids (after truncation).
        tokens: ``list[str]`` of length ``seq``: display strings of the input tokens.
        layers: readable layers, ascending; the last is the lens's target layer.
        positions: ``int64[n_positions]`` the positions read.
        output_layer: the model's last layer (whose reading is the model's own output).
        top_k: tokens kept per cell.
        show_whitespace: whether display strings show whitespace as glyphs.
        word_like: whether the top-k lists were restricted to word-like tokens (ranks never are).
        pinned: ``{name: token id}``; ``name`` is the pinned token as given (``rank_<name>``).
        top_ids: ``int64[n_layers, n_positions, top_k]``, most probable first.
        top_probs: ``float32[n_layers, n_positions, top_k]``, lens probabilities (full softmax).
        entropy_bits, kl_bits, ce_bits: ``float64[n_layers, n_positions]`` (bits); ``ce_bits`` is
            NaN at the last position.
        next_token_rank: ``float64[n_layers, n_positions]``, 1-based; NaN at the last position.
        final_top1_rank: ``int64[n_layers, n_positions]``, 1-based (1 at the model's output layer).
        pinned_ranks: ``{name: int64[n_layers, n_positions]}``, 1-based.
        next_ids: ``int64[n_positions]`` the actual next token (``-1`` at the last position).
        final_top1_ids: ``int64[n_positions]`` the model's own top-1 token.
        n_prompt: how many of ``input_ids`` are the prompt; the rest were generated (a reading of a
            :class:`~jlens_core.reading.generation.Generation`).
        edits: ``repr`` of the residual edits the reading was taken under (empty: the clean model).
        vocab: the readout, ``"all"`` or ``"word"`` (docs/method.md §9.1): with ``"word"`` the top-k
            lists and every rank leave out tokens whose text has no letter or digit; entropy, KL and
            CE are over the full distribution either way.
        display: the tokenizer's cached :class:`~jlens_core.reading.tokens.TokenDisplay` (names the
            tokens; gives :attr:`word_ids`); None in a reading built by hand.
        skip_first: the lens's ``skip_first`` (0 when it has none: the logit lens): the
            positions before it were never fitted (:attr:`fitted`).
        saved_word_ids: ``bool[vocab]``, the word mask a reading loaded from a file carries (True on the
            recorded word tokens, the ids it shows; docs/method.md §6.1); None in a reading with a
            :attr:`display`, which gives the whole mask.
        stability: the stability marks (docs/method.md §6.2: the shown token's rank under the lens's even
            and odd halves, the halves' top-1 agreement, the stable flag), or None when not asked for.
        stability_note: why a reading asked for stability has none (one sentence; ``""`` otherwise).

    A reading saves to a reading file (:meth:`save`, docs/method.md §6.1) and :meth:`load` opens one
    without the model: the same attributes and numbers, with ``display=None`` and ``vocab_strings``
    naming only the ids the reading shows.
    """

    text: str
    model_name: str
    lens_kind: str
    input_ids: np.ndarray
    tokens: list[str]
    layers: list[int]
    positions: np.ndarray
    output_layer: int
    top_k: int
    show_whitespace: bool
    word_like: bool
    pinned: dict[str, int]
    top_ids: np.ndarray
    top_probs: np.ndarray
    entropy_bits: np.ndarray
    kl_bits: np.ndarray
    ce_bits: np.ndarray
    next_token_rank: np.ndarray
    final_top1_rank: np.ndarray
    pinned_ranks: dict[str, np.ndarray]
    next_ids: np.ndarray
    final_top1_ids: np.ndarray
    vocab_strings: list[str] = field(repr=False, default_factory=list)
    n_prompt: int | None = None
    edits: list[str] = field(default_factory=list)
    vocab: str = "all"
    display: TokenDisplay | None = field(repr=False, default=None)
    skip_first: int = 0
    saved_word_ids: np.ndarray | None = field(repr=False, default=None)
    stability: Stability | None = field(repr=False, default=None)
    stability_note: str = ""

    def __post_init__(self) -> None:
        if self.n_prompt is None:
            self.n_prompt = len(self.input_ids)

    # -- shape -----------------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_positions(self) -> int:
        return len(self.positions)

    def layer_index(self, layer: int) -> int:
        """Row of ``layer`` in the arrays (negative layers count from the model's end).

        Raises:
            KeyError: the layer was not read.
        """
        i = int(layer) % (self.output_layer + 1) if layer < 0 else int(layer)
        try:
            return self.layers.index(i)
        except ValueError:
            raise KeyError(f"Layer {layer} was not read; this reading has layers {self.layers}.") from None

    @property
    def _prompt_length(self) -> int:
        """``n_prompt`` as an int (``None`` only until ``__post_init__`` fills it in)."""
        return len(self.input_ids) if self.n_prompt is None else int(self.n_prompt)

    @property
    def n_generated(self) -> int:
        """Tokens of the reading that the model generated (after the prompt)."""
        return len(self.input_ids) - self._prompt_length

    @property
    def word_ids(self) -> np.ndarray | None:
        """``bool[vocab]`` (read-only, cached per tokenizer): the word tokens, the ids ``vocab="word"`` keeps
        (:func:`~jlens_core.reading.word_readout.word_mask`); a loaded reading's :attr:`saved_word_ids`;
        None without either."""
        return self.saved_word_ids if self.display is None else word_mask(self.display)

    @property
    def fitted(self) -> np.ndarray:
        """``bool[n_positions]``: whether each read position is at or past the lens's ``skip_first``.

        A Jacobian lens is fitted on positions ``>= skip_first`` only (docs/method.md §3), so a reading
        before them is of a map never fitted there; a tuned lens likewise trains on positions
        ``>= skip_first``. The logit lens fits nothing: every position is ``True``.
        """
        return self.positions >= int(self.skip_first)

    @property
    def segments(self) -> list[str]:
        """``"prompt"`` or ``"generated"`` for each read position."""
        return ["generated" if p >= self.n_prompt else "prompt" for p in self.positions.tolist()]

    def position_index(self, position: int) -> int:
        """Column of ``position`` in the arrays (negative positions count from the prompt's end).

        Raises:
            KeyError: the position was not read.
        """
        i = int(position) % len(self.input_ids) if position < 0 else int(position)
        hits = np.flatnonzero(self.positions == i)
        if not len(hits):
            raise KeyError(f"Position {position} was not read; this reading has positions "
                           f"{self.positions.tolist()}.")
        return int(hits[0])

    # -- strings -----------------------------------------------------------------------------------
    def _names(self, ids: Iterable[int]) -> list[str]:
        return display_ids(self.vocab_strings, ids)

    @property
    def position_tokens(self) -> list[str]:
        """Display strings of the input token at each read position (``n_positions``)."""
        return [self.tokens[p] for p in self.positions.tolist()]

    @property
    def next_tokens(self) -> list[str]:
        """Display strings of the actual next token at each read position (``""`` at the last)."""
        return [self.tokens[p + 1] if p + 1 < len(self.tokens) else "" for p in self.positions.tolist()]

    @property
    def final_top1_tokens(self) -> list[str]:
        """Display strings of the model's own top-1 token at each read position."""
        return self._names(self.final_top1_ids)

    def top_tokens(self, layer: int, position: int) -> list[str]:
        """Display strings of the top-k tokens at one cell (``layer``, ``position`` are model indices)."""
        return self._names(self.top_ids[self.layer_index(layer), self.position_index(position)])

    def top1_grid(self) -> list[list[str]]:
        """``[n_layers][n_positions]`` display strings of the lens's top-1 token."""
        return [self._names(row) for row in self.top_ids[:, :, 0]]

    def cell(self, layer: int, position: int) -> dict:
        """Everything about one cell, as plain Python values (for tooltips and detail panes)."""
        li, pi = self.layer_index(layer), self.position_index(position)
        rank = self.next_token_rank[li, pi]
        return {"layer": self.layers[li], "position": int(self.positions[pi]),
                "token": self.tokens[int(self.positions[pi])], "next_token": self.next_tokens[pi],
                "segment": "generated" if int(self.positions[pi]) >= self._prompt_length else "prompt",
                "fitted": bool(self.fitted[pi]),
                "top_ids": self.top_ids[li, pi].tolist(), "top_tokens": self._names(self.top_ids[li, pi]),
                "top_probs": [float(x) for x in self.top_probs[li, pi]],
                "entropy_bits": float(self.entropy_bits[li, pi]), "kl_bits": float(self.kl_bits[li, pi]),
                "ce_bits": float(self.ce_bits[li, pi]),
                "next_token_rank": None if np.isnan(rank) else int(rank),
                "final_top1_rank": int(self.final_top1_rank[li, pi]),
                **{f"rank_{name}": int(r[li, pi]) for name, r in self.pinned_ranks.items()},
                **self._stability_cell(li, pi)}

    def _stability_cell(self, li: int, pi: int) -> dict[str, Any]:
        marks = self.stability
        if marks is None:
            return {}
        return {"half_top1_agree": bool(marks.half_top1_agree[li, pi]),
                "half_rank_even": int(marks.half_rank_even[li, pi]), "half_rank_odd": int(marks.half_rank_odd[li, pi]),
                "stable": bool(marks.stable[li, pi])}

    # -- stability (docs/method.md §6.2) -------------------------------------------------------------
    def stability_by_layer(self, *, fitted_only: bool = True) -> pd.DataFrame:
        """Per layer: how many cells are stable (the shown token within the top ``stability_k`` under both
        halves) and how often the halves' top-1 tokens agree (docs/method.md §6.2).

        Args:
            fitted_only: count only the positions the lens was fitted on (:attr:`fitted`); positions
                before ``skip_first`` read a map never fitted there.

        Returns:
            DataFrame with columns ``layer, n_cells, n_stable, stable_fraction, half_top1_agree_fraction``
            (fractions NaN where no cell is counted).

        Raises:
            ValueError: the reading has no stability marks (its :attr:`stability_note` says why, when asked).
        """
        if self.stability is None:
            raise ValueError(self.stability_note or "This reading has no stability marks: read it with "
                             "stability=True (a lens with halves) or halves=(even, odd).")
        counted = self.fitted if fitted_only else np.ones(self.n_positions, dtype=bool)
        return stability_by_layer(self.layers, self.stability, counted)

    # -- grids ---------------------------------------------------------------------------------------
    @property
    def stats(self) -> list[str]:
        """Names :meth:`grid` accepts."""
        return list(GRID_STATS) + [f"rank_{name}" for name in self.pinned]

    def grid(self, stat: str, *, layers: Sequence[int] | None = None) -> np.ndarray:
        """``float64[n_layers, n_positions]`` of one statistic, for heatmaps.

        Args:
            stat: one of :attr:`stats`: ``entropy_bits``, ``kl_bits``, ``ce_bits``,
                ``next_token_rank`` (NaN at the last position), ``final_top1_rank``, ``top1_prob``,
                or ``rank_<pinned>``.
            layers: rows to return, in that order (default :attr:`layers`); a layer this reading
                lacks is a row of NaN (so two readings can share one layer axis).

        Raises:
            ValueError: an unknown ``stat``.
        """
        if stat in ("entropy_bits", "kl_bits", "ce_bits", "next_token_rank", "final_top1_rank"):
            values = getattr(self, stat)
        elif stat == "top1_prob":
            values = self.top_probs[:, :, 0]
        elif stat.startswith("rank_") and stat[5:] in self.pinned_ranks:
            values = self.pinned_ranks[stat[5:]]
        else:
            raise ValueError(f"Unknown statistic {stat!r}: choose one of {self.stats}.")
        values = np.asarray(values, dtype=np.float64)
        if layers is None:
            return values.copy()
        out = np.full((len(layers), self.n_positions), np.nan)
        for row, layer in enumerate(layers):
            if layer in self.layers:
                out[row] = values[self.layers.index(layer)]
        return out

    # -- the long frame --------------------------------------------------------------------------------
    @cached_property
    def frame(self) -> pd.DataFrame:
        """One row per (layer, position), layers outer: the columns of :data:`FRAME_COLUMNS` plus
        ``rank_<token>`` per pinned token, then, with stability marks, ``half_top1_agree``,
        ``half_rank_even``, ``half_rank_odd`` and ``stable`` (docs/method.md §6.2).

        ``top_ids`` / ``top_tokens`` / ``top_probs`` hold Python lists; ``next_token_rank`` is a
        nullable ``Int64`` column, missing (``<NA>``) at the last position; other ranks are ``int64``.
        """
        n_l, n_p = self.n_layers, self.n_positions
        layer_col = np.repeat(np.asarray(self.layers, dtype=np.int64), n_p)
        position_col = np.tile(self.positions.astype(np.int64), n_l)
        flat_ids = self.top_ids.reshape(n_l * n_p, -1)
        data: dict[str, Any] = {
            "layer": layer_col,
            "position": position_col,
            "token": [self.tokens[p] for p in position_col.tolist()],
            "segment": np.where(position_col >= self._prompt_length, "generated", "prompt"),
            "fitted": position_col >= int(self.skip_first),
            "top_ids": flat_ids.tolist(),
            "top_tokens": [self._names(row) for row in flat_ids],
            "top_probs": self.top_probs.reshape(n_l * n_p, -1).astype(np.float64).tolist(),
            "entropy_bits": self.entropy_bits.reshape(-1),
            "kl_bits": self.kl_bits.reshape(-1),
            "ce_bits": self.ce_bits.reshape(-1),
            "next_token_rank": pd.array(
                [None if np.isnan(x) else int(x) for x in self.next_token_rank.reshape(-1)], dtype="Int64"),
            "final_top1_rank": self.final_top1_rank.reshape(-1).astype(np.int64),
        }
        for name, ranks in self.pinned_ranks.items():
            data[f"rank_{name}"] = ranks.reshape(-1).astype(np.int64)
        if self.stability is not None:
            marks = self.stability
            columns = dict(zip(STABILITY_COLUMNS, (marks.half_top1_agree, marks.half_rank_even, marks.half_rank_odd,
                                                   marks.stable)))
            for name in STABILITY_COLUMNS:
                data[name] = columns[name].reshape(-1).astype(bool if name in ("half_top1_agree", "stable") else np.int64)
        return pd.DataFrame(data)

    # -- files -----------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike, *, model: LensModel | None = None, lens: Lens | None = None,
             origin: str | None = None, name: str | None = None) -> Path:
        """Write this reading to a reading file (JSON, docs/method.md §6.1), atomically; returns the path.

        Args:
            path: the file (``reading.jlens.json`` by convention).
            model: the model read (its fingerprint goes in the file).
            lens: the lens read (its kind, settings and model identity go in the file).
            origin: where the lens came from (a file, ``"default"``).
            name: the reading's name in the file (default :attr:`lens_kind`).

        Several readings (two lenses, an edited run, a generation, a comparison) go in one file with
        :func:`~jlens_core.reading.reading_file.save_readings`.
        """
        key = name or self.lens_kind
        return write_readings(path, {key: self}, model=model, lenses={key: lens} if lens is not None else None,
                              origins={key: origin} if origin is not None else None)

    @classmethod
    def load(cls, path: str | os.PathLike, name: str | None = None) -> PromptReading:
        """The reading ``name`` of a reading file (default: its only one), without the model (docs/method.md §6.1).

        Raises:
            FileNotFoundError: no file at ``path``.
            ReadingFileError: not a reading file, another format version, a missing field, no reading
                ``name``, or several readings and no ``name`` (one sentence).
        """
        return pick_reading(path, read_file(path, cls)["readings"], name)

    def __repr__(self) -> str:
        return (f"PromptReading(model={self.model_name!r}, lens={self.lens_kind!r}, layers={self.layers}, "
                f"positions={self.n_positions} of {len(self.input_ids)}, top_k={self.top_k}, "
                f"pinned={list(self.pinned)})")

    # -- figures (jlens_core.figures; plotly: pip install jacobian-lens[app]) --------------------------------------
    def figure(self, stat: str = "top1_prob", *, others: dict[str, PromptReading] | None = None,
               mode: str | None = None, **options: Any) -> Any:
        """The layer x position heatmap the app's Inspect page draws, as a Plotly figure.

        Args:
            stat: the colour, one of :attr:`stats`.
            others: ``{lens name: PromptReading}`` of the same prompt through other lenses: drawn side by side
                (one other), stacked (more) or as a difference (``mode="diff"``, the other minus this one
                is ``pair[1] - pair[0]``).
            mode: :func:`~jlens_core.figures.heatmaps.heatmap_figure`'s mode (default: from ``others``).
            options: the rest of its options (``layers``, ``hover_k``, ``selected``, ``pair``).
        """
        from ..figures.heatmaps import reading_figure

        return reading_figure(self, stat, others=others, mode=mode, **options)

    def to_html(self, path: str | os.PathLike, *, others: dict[str, PromptReading] | None = None,
                **options: Any) -> Path:
        """Write this reading (and ``others`` of the same prompt) as one HTML page that works offline: the
        heatmap with hover, a click's cell detail and pinned ranks, the settings in a header
        (:mod:`jlens_core.figures.html_page`; ``options``: ``mode``, ``stat``, ``pair``, ``title``, ...).

        Returns:
            The path written.
        """
        from ..figures.html_page import write_reading_page

        readings = {str(self.lens_kind): self}
        readings.update(others or {})
        return write_reading_page(readings, path, **options)

    def _repr_html_(self) -> str | None:
        """A compact heatmap in Jupyter, offline (:mod:`jlens_core.figures.notebook` says how)."""
        from ..figures.notebook import reading_html

        return reading_html(self)


def lens_skip_first(lens: Lens) -> int:
    """The first position a reading through ``lens`` counts as fitted: ``lens.skip_first``, else 0.

    The Jacobian lens's fit and the tuned lens's training record it; the logit lens (``skip_first = None``)
    and a lens file without it have every position fitted.
    """
    value = recorded_skip_first(lens)
    return max(0, int(value)) if value is not None else 0


__all__ = ["FRAME_COLUMNS", "GRID_STATS", "PromptReading", "lens_skip_first"]
