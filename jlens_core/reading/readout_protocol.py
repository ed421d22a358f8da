"""The readout protocol as one value (no torch, no numpy: the CLI's parser reads it).

:class:`Readout` is what reading, pass@k, the study and the app share about how a lens's logits are read:
where an item is read (``position``), how its words are spelled (``spelling``, ``synonyms``), what they rank
among (``vocab``, docs/method.md §9.1) and the cut-off ``k``. :data:`VOCABS`: the vocabularies (``"all"``, every
token; ``"word"``, tokens whose text has a letter or digit; :mod:`~jlens_core.reading.word_readout` builds the
mask).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

VOCABS = ("all", "word")


@dataclass(frozen=True)
class Readout:
    """The readout protocol (docs/method.md §8, §9.1); each function checks the fields it uses.

    Attributes:
        position: where an item is read: ``"last"``, ``"last_newline"``, a token position or ``{"before": text}``;
            ``None``: the item's own rule, else its set's, else ``"last"`` (pass@k, the study).
        spelling: ``"whole"`` (complete single-token spellings) or ``"first_token"``.
        synonyms: ``"numbers_ops"`` or ``None`` (the item's own).
        vocab: one of :data:`VOCABS`: the tokens ranks are counted among.
        k: the cut-off: tokens kept per cell (reading), the cut-offs of pass@k (one or several), the top-k of the
            study; ``None``: the function's default.
    """

    position: Any = None
    spelling: str = "whole"
    synonyms: str | None = None
    vocab: str = "all"
    k: int | tuple[int, ...] | None = None

    def updated(self, keywords: Mapping[str, Any], aliases: Mapping[str, str] | None = None) -> Readout:
        """This readout with the fields ``keywords`` names replaced (a call's older keywords: ``vocab=``, ``k=``,
        ...; ``aliases`` maps a keyword to its field, e.g. ``{"top_k": "k", "readout": "position"}``), popping
        them from ``keywords`` when it is a dict; unchanged without any."""
        aliases = aliases or {}
        names = {f.name for f in dataclasses.fields(self)}
        changes = {aliases.get(key, key): value for key, value in keywords.items() if aliases.get(key, key) in names}
        if isinstance(keywords, dict):
            for key in [key for key in keywords if aliases.get(key, key) in names]:
                del keywords[key]
        return dataclasses.replace(self, **changes) if changes else self


def no_other_keywords(function: str, keywords: Mapping[str, Any]) -> None:
    """Raise Python's own ``TypeError`` for a keyword ``function`` does not take (what is left of ``**options``)."""
    if keywords:
        raise TypeError(f"{function}() got an unexpected keyword argument {next(iter(keywords))!r}")


__all__ = ["VOCABS", "Readout", "no_other_keywords"]
