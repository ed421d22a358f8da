"""The readout protocol's choices as plain values (no torch, no numpy: the CLI's parser reads them).

:data:`VOCABS`: the vocabularies a readout ranks among (docs/method.md §9.1): ``"all"`` (every token) or
``"word"`` (tokens whose text has a letter or digit; :mod:`~jlens_core.reading.word_readout` builds the mask).
"""

from __future__ import annotations

VOCABS = ("all", "word")

__all__ = ["VOCABS"]
