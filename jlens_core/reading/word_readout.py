"""The word-token readout: which tokens a ``vocab="word"`` reading keeps (docs/method.md §9.1).

A token is a **word token** when its decoded text has a letter or a digit
(``any(c.isalnum() for c in text)``). Not word tokens, so left out of top-k lists and ranks under
``vocab="word"``: whitespace, punctuation and symbol tokens, byte fragments that decode to no
character of either kind (the ``\\xNN`` escapes :class:`~jlens_core.reading.tokens.TokenDisplay`
writes for bytes that do not decode are not text), special and added tokens (their decoded text,
with special tokens skipped, is empty), and the padded rows of an output head wider than the
tokenizer (ids ``>= len(tokenizer)``, which stand for no text).

Under ``vocab="word"`` the rank of a token ``t`` is ``1 + #{v in W : logit_v > logit_t}`` with
``W`` the kept ids: only kept tokens can stand above it, whether ``t`` is kept or not. Entropy, KL
and cross-entropy stay over the full distribution. ``vocab="all"`` (the default) keeps every id.

The mask is computed once per tokenizer (a pass over its decoded texts) and cached with its
:class:`~jlens_core.reading.tokens.TokenDisplay`.
"""

from __future__ import annotations

import re
import weakref

import numpy as np

from .readout_protocol import VOCABS
from .tokens import TokenDisplay, id_label

# how TokenDisplay.texts writes a byte that does not decode (``errors="backslashreplace"``)
_UNDECODED_BYTE = re.compile(r"\\x[0-9a-f]{2}")
_MASKS: weakref.WeakKeyDictionary[TokenDisplay, np.ndarray] = weakref.WeakKeyDictionary()


def check_vocab(vocab: str) -> str:
    """``vocab`` itself when it is one of :data:`VOCABS`.

    Raises:
        ValueError: any other value (one sentence naming the choices).
    """
    if vocab not in VOCABS:
        raise ValueError(f"Unknown vocab {vocab!r}: use 'all' (every token) or 'word' (tokens whose text has a "
                         "letter or digit).")
    return str(vocab)


def is_word_token(text: str) -> bool:
    """Whether decoded ``text`` has a letter or a digit (any script): the word-token rule."""
    return any(c.isalnum() for c in text)


def word_mask(display: TokenDisplay) -> np.ndarray:
    """``bool[display.vocab_size]``, read-only: True on the word tokens (see the module docstring).

    Cached per ``display`` (so per tokenizer and width); the first call costs one pass over the
    decoded texts.
    """
    cached = _MASKS.get(display)
    if cached is not None:
        return cached
    tokenizer = display.tokenizer
    n_named = len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.get_vocab_size(with_added_tokens=True)
    texts = display.texts
    mask = np.fromiter((i < n_named and texts[i] != id_label(i) and is_word_token(_UNDECODED_BYTE.sub("", texts[i]))
                        for i in range(display.vocab_size)), dtype=bool, count=display.vocab_size)
    if display.special_ids:
        mask[list(display.special_ids)] = False
    mask.flags.writeable = False
    _MASKS[display] = mask
    return mask


def kept_ids_mask(display: TokenDisplay, vocab: str, width: int) -> np.ndarray | None:
    """``bool[width]`` of the ids a ``vocab`` readout keeps over logits ``width`` wide; ``None`` for ``"all"``.

    Ids past ``display.vocab_size`` are not kept.

    Raises:
        ValueError: an unknown ``vocab``, or a ``"word"`` readout that keeps no id at all.
    """
    if check_vocab(vocab) == "all":
        return None
    mask = word_mask(display)[:width]
    if len(mask) < width:
        mask = np.pad(mask, (0, width - len(mask)))
    if not mask.any():
        raise ValueError(f"vocab='word' leaves no token: none of the {width} output ids decodes to text with a "
                         "letter or digit; use vocab='all'.")
    return mask


__all__ = ["check_vocab", "is_word_token", "kept_ids_mask", "word_mask"]
