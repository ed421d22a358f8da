"""Summaries and comparisons of readings: the most common top-1 tokens in a layer band, and two
readings of one prompt side by side or as a difference (the app's difference mode).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from .prompt_reading import PromptReading
from .tokens import is_word_like
from .word_readout import check_vocab

MOST_COMMON_COLUMNS = ("token_id", "token", "count", "n_layers", "per_layer")


def band_layers(reading: PromptReading, band: tuple[int, int] | Sequence[int] | None = None, *,
                include_output: bool = False) -> list[int]:
    """The reading's layers inside ``band``: ``(lo, hi)`` inclusive, or a list of layers.

    ``None`` is every layer of the reading below the model's output row (``include_output`` keeps it).

    Raises:
        ValueError: a band that holds none of the reading's layers.
    """
    if band is None:
        chosen = [layer for layer in reading.layers if include_output or layer != reading.output_layer]
    elif isinstance(band, tuple) and len(band) == 2:
        lo, hi = sorted(int(x) for x in band)
        chosen = [layer for layer in reading.layers if lo <= layer <= hi]
    else:
        wanted = {int(x) for x in band}
        chosen = [layer for layer in reading.layers if layer in wanted]
    if not chosen:
        raise ValueError(f"The layer band {band} holds none of the reading's layers {reading.layers}.")
    return chosen


def most_common_tokens(reading: PromptReading, *, layers: tuple[int, int] | Sequence[int] | None = None,
                       positions: Iterable[int] | None = None, word_like: bool = False,
                       top_n: int = 20, vocab: str = "all") -> pd.DataFrame:
    """The tokens that are a lens's top-1 most often across positions, within a band of layers.

    Each (layer, position) cell of the band contributes its top-1 token. With ``word_like`` a cell
    contributes its most probable *word-like* token among its top-k (:func:`~jlens_core.reading.tokens.is_word_like`)
    and nothing when its top-k holds none; with ``vocab="word"`` likewise its most probable *word token*
    (a letter or digit in its text, :mod:`~jlens_core.reading.word_readout`, docs/method.md §9.1). A
    reading taken with ``vocab="word"`` already lists word tokens only.

    Args:
        reading: a :class:`PromptReading`.
        layers: a band ``(lo, hi)`` (inclusive) or a list of layers; default every layer below the
            model's output row (what the middle layers hold, not the model's own answer).
        positions: positions to count over (default all of the reading's).
        word_like: count word-like tokens only.
        top_n: rows returned (the most frequent first; ties by token id).
        vocab: ``"all"`` (default) or ``"word"``: count word tokens only.

    Returns:
        DataFrame with columns :data:`MOST_COMMON_COLUMNS`: ``count`` (cells where it is top-1),
        ``n_layers`` (layers where it is top-1 at least once) and ``per_layer`` (``{layer: count}``).

    Raises:
        ValueError: a band with none of the reading's layers, an unknown ``vocab``, or ``vocab="word"``
            on a reading without its word mask (one built by hand).
    """
    if check_vocab(vocab) == "word" and reading.word_ids is None:
        raise ValueError("vocab='word' needs the reading's word mask: read the prompt with read_prompt, which "
                         "records it.")
    chosen = band_layers(reading, layers)
    pos = reading.positions.tolist() if positions is None else [int(p) for p in positions]
    cols = [reading.position_index(p) for p in pos]
    word: dict[int, bool] | None = {} if word_like else None
    keep = reading.word_ids if vocab == "word" else None  # bool[vocab]
    counts: dict[int, dict[int, int]] = {}
    for layer in chosen:
        li = reading.layer_index(layer)
        for pi in cols:
            row = reading.top_ids[li, pi]  # [top_k]
            if keep is not None:
                row = row[keep[np.minimum(row, len(keep) - 1)] & (row < len(keep))]  # its word tokens, in order
                if not len(row):
                    continue
            token = int(row[0])
            if word is not None:
                token = -1
                for candidate in row.tolist():
                    if candidate not in word:
                        name = reading.vocab_strings[candidate] if candidate < len(reading.vocab_strings) else ""
                        word[candidate] = is_word_like(name)
                    if word[candidate]:
                        token = int(candidate)
                        break
                if token < 0:
                    continue
            per_layer = counts.setdefault(token, {})
            per_layer[layer] = per_layer.get(layer, 0) + 1
    ordered = sorted(counts.items(), key=lambda item: (-sum(item[1].values()), item[0]))  # most counted first
    rows = [{"token_id": tid, "token": reading._names([tid])[0], "count": sum(per.values()),
             "n_layers": len(per), "per_layer": dict(sorted(per.items()))} for tid, per in ordered]
    return pd.DataFrame(rows[: max(0, int(top_n))], columns=list(MOST_COMMON_COLUMNS))


# -- comparing two readings ------------------------------------------------------------------------
COMPARE_STATS = ("entropy_bits", "kl_bits", "ce_bits", "next_token_rank", "final_top1_rank")


def _check_comparable(a: PromptReading, b: PromptReading) -> None:
    if not np.array_equal(a.input_ids, b.input_ids):
        raise ValueError("The two readings are of different prompts (their token ids differ): read the same "
                         "prompt with both lenses.")
    if not np.array_equal(a.positions, b.positions):
        raise ValueError(f"The two readings read different positions ({a.positions.tolist()} vs "
                         f"{b.positions.tolist()}): read the same positions.")


def difference(a: PromptReading, b: PromptReading, stat: str = "kl_bits") -> pd.DataFrame:
    """``a - b`` of one statistic over the layers both readings have, for the app's difference mode.

    Returns:
        DataFrame indexed by layer (the common layers, ascending), one column per position.

    Raises:
        ValueError: different prompts or positions, no common layer, or an unknown ``stat``.
    """
    _check_comparable(a, b)
    common = [layer for layer in a.layers if layer in b.layers]
    if not common:
        raise ValueError(f"The readings share no layer ({a.layers} vs {b.layers}).")
    values = a.grid(stat, layers=common) - b.grid(stat, layers=common)
    return pd.DataFrame(values, index=pd.Index(common, name="layer"),
                        columns=pd.Index(a.positions.tolist(), name="position"))


def compare_readings(a: PromptReading, b: PromptReading, *, names: tuple[str, str] = ("a", "b")) -> pd.DataFrame:
    """Long frame over the (layer, position) cells both readings have, side by side.

    Columns: ``layer, position, token``, then for each of ``entropy_bits, kl_bits, ce_bits,
    next_token_rank, final_top1_rank``: ``<stat>_<name_a>``, ``<stat>_<name_b>`` and
    ``<stat>_diff`` (= a - b), then ``top1_<name_a>``, ``top1_<name_b>`` and ``same_top1``.

    Raises:
        ValueError: different prompts or positions, no common layer, or equal names.
    """
    _check_comparable(a, b)
    na, nb = names
    if na == nb:
        raise ValueError(f"names must differ, got {names}.")
    common = [layer for layer in a.layers if layer in b.layers]
    if not common:
        raise ValueError(f"The readings share no layer ({a.layers} vs {b.layers}).")
    rows_a = [a.layers.index(layer) for layer in common]
    rows_b = [b.layers.index(layer) for layer in common]
    n_p = a.n_positions
    data: dict[str, Any] = {"layer": np.repeat(np.asarray(common, dtype=np.int64), n_p),
                            "position": np.tile(a.positions, len(common)),
                            "token": [a.tokens[p] for p in np.tile(a.positions, len(common)).tolist()]}
    for stat in COMPARE_STATS:
        va = a.grid(stat)[rows_a].reshape(-1)
        vb = b.grid(stat)[rows_b].reshape(-1)
        data[f"{stat}_{na}"], data[f"{stat}_{nb}"], data[f"{stat}_diff"] = va, vb, va - vb
    top_a = a.top_ids[rows_a, :, 0].reshape(-1)
    top_b = b.top_ids[rows_b, :, 0].reshape(-1)
    data[f"top1_{na}"] = a._names(top_a)
    data[f"top1_{nb}"] = b._names(top_b)
    data["same_top1"] = top_a == top_b
    return pd.DataFrame(data)


__all__ = ["COMPARE_STATS", "MOST_COMMON_COLUMNS", "band_layers", "compare_readings", "difference",
           "most_common_tokens"]
