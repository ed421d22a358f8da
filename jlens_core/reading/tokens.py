"""Readable display strings for token ids, and a word-like-token filter for display.

Tokenizers store tokens in their own encodings: byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM)
writes bytes as printable stand-ins (``Ġ`` for a space, ``Ċ`` for a newline); SentencePiece
(Llama 2, Gemma, Mistral v1) writes ``▁`` for a space and ``<0x0A>`` for raw bytes. This module
turns every vocabulary entry back into the text it stands for and then into a one-line display
string.

Display conventions (both modes):

* bytes that are not valid UTF-8 on their own (a piece of a multi-byte character) are shown as
  ``\\xNN`` escapes, one per byte;
* special and added tokens (``<|endoftext|>``, ``<s>``) are shown as they are written;
* invisible format characters (zero-width space, BOM, soft hyphen, line/paragraph separators) are
  shown as ``\\uNNNN`` escapes;
* ids beyond the tokenizer's vocabulary (padding rows of the output head) are shown as ``<id:N>``.

Plain mode (``show_whitespace=False``) keeps spaces as spaces and escapes line breaks and control
characters: newline ``\\n``, tab ``\\t``, carriage return ``\\r``, others ``\\xNN``. A token that
literally holds a backslash followed by ``n`` reads the same as a newline in this mode; the
whitespace mode tells them apart.

Whitespace mode (``show_whitespace=True``) shows whitespace as glyphs: space ``·``, newline ``↵``,
tab ``→``, carriage return ``␍``, no-break space ``⍽``, other C0 control characters as their
Unicode control pictures (``␀`` ... ``␟``, ``␡``).

:class:`TokenDisplay` computes the strings for the whole vocabulary once (a 50k vocabulary takes
a fraction of a second) and is cached per tokenizer by :meth:`TokenDisplay.for_tokenizer`.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:  # this module imports no torch at run time
    from ..models.model import LensModel

log = logging.getLogger(__name__)

KINDS = ("byte_level", "sentencepiece", "plain")
SPACE_GLYPH = "·"
NEWLINE_GLYPH = "↵"
TAB_GLYPH = "→"
CR_GLYPH = "␍"
NBSP_GLYPH = "⍽"
# Glyphs and markers stripped before judging whether a display string is word-like.
_MARKERS = " \t\n\r" + SPACE_GLYPH + NEWLINE_GLYPH + TAB_GLYPH + CR_GLYPH + NBSP_GLYPH + "▁Ġ\u00a0"
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: ``{byte: printable character}`` for all 256 byte values.

    Printable Latin-1 bytes stand for themselves; the others (control characters, space, ...) are
    shifted to ``U+0100`` and up, which is why a space reads ``Ġ`` (``U+0120``) and a newline ``Ċ``.
    """
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in keep}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


@functools.lru_cache(maxsize=1)
def _byte_level_table() -> dict[int, int]:
    """``str.translate`` table from the byte-level alphabet back to ``chr(byte)`` (then Latin-1)."""
    return {ord(ch): b for b, ch in bytes_to_unicode().items()}


def _make_tables() -> tuple[dict[int, str], dict[int, str]]:
    plain: dict[int, str] = {}
    glyphs: dict[int, str] = {}
    for code in list(range(0x20)) + [0x7F] + list(range(0x80, 0xA0)):
        plain[code] = f"\\x{code:02x}"
    plain.update({ord("\n"): "\\n", ord("\t"): "\\t", ord("\r"): "\\r"})
    glyphs.update(plain)
    for code in range(0x20):
        glyphs[code] = chr(0x2400 + code)
    glyphs[0x7F] = "\u2421"
    glyphs.update({ord(" "): SPACE_GLYPH, ord("\n"): NEWLINE_GLYPH, ord("\t"): TAB_GLYPH,
                   ord("\r"): CR_GLYPH, 0xA0: NBSP_GLYPH})
    # Invisible format characters and line separators: escaped in both modes.
    for code in (0x00AD, 0x061C, 0x180E, 0x2028, 0x2029, 0xFEFF, *range(0x200B, 0x2010),
                 *range(0x202A, 0x202F), *range(0x2060, 0x2065), *range(0x2066, 0x2070)):
        plain[code] = glyphs[code] = f"\\u{code:04x}"
    return plain, glyphs


_PLAIN_TABLE, _GLYPH_TABLE = _make_tables()
_NEEDS_TABLE = re.compile(r"[\x00-\x20\x7f-\xa0\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]")


def visible(text: str, *, show_whitespace: bool = False) -> str:
    """A one-line display form of decoded ``text`` (see the module docstring for the conventions).

    Examples:
        ``visible(" Paris\\n")`` is ``' Paris\\\\n'``; with ``show_whitespace=True`` it is ``'·Paris↵'``.
    """
    if not _NEEDS_TABLE.search(text):
        return text
    return text.translate(_GLYPH_TABLE if show_whitespace else _PLAIN_TABLE)


def _bytes_text(data: bytes) -> str:
    """UTF-8 text of ``data``; bytes that do not decode are ``\\xNN`` escapes."""
    return data.decode("utf-8", errors="backslashreplace")


def is_word_like(display: str, *, allow_digits: bool = False) -> bool:
    """Whether a token's display (or decoded) string looks like (part of) a word.

    After stripping surrounding whitespace and whitespace glyphs (``·``, ``↵``, ``▁``, ``Ġ``), the
    rest must be non-empty, start with a letter, and hold only letters (any script) and inner
    apostrophes or hyphens; with ``allow_digits`` digits count as letters. Punctuation, numbers,
    whitespace, byte fragments (``\\xe2``) and special tokens (``<|endoftext|>``) are not word-like.

    This is a display filter only: ranks are always over the full vocabulary.
    """
    core = display.strip(_MARKERS)
    if not core:
        return False

    def letter(ch: str) -> bool:
        return ch.isalpha() or (allow_digits and ch.isdigit())

    if not letter(core[0]) or not letter(core[-1]):
        return False
    return all(letter(ch) or ch in "'’-" for ch in core)


def detect_kind(tokenizer: Any) -> str:
    """How ``tokenizer`` writes its tokens: ``"byte_level"``, ``"sentencepiece"`` or ``"plain"``.

    Looks at the fast tokenizer's decoder and pre-tokenizer (``ByteLevel``; ``Metaspace``,
    ``ByteFallback`` or a ``▁`` replacement), then at a slow tokenizer's attributes
    (``byte_decoder``, ``sp_model``), then at the vocabulary (``Ġ`` vs ``▁`` prefixes).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and type(tokenizer).__name__ == "Tokenizer" and hasattr(tokenizer, "id_to_token"):
        backend = tokenizer  # a bare ``tokenizers.Tokenizer``
    if backend is not None:
        parts = []
        for attr in ("decoder", "pre_tokenizer", "normalizer"):
            component = getattr(backend, attr, None)
            if component is None:
                continue
            try:
                parts.append(component.__getstate__().decode("utf-8", errors="replace"))
            except (AttributeError, TypeError, ValueError) as exc:  # no JSON state: use the class name
                log.debug("tokenizer component %s has no JSON state: %s", type(component).__name__, exc)
                parts.append(type(component).__name__)
        state = " ".join(parts)
        if '"ByteLevel"' in state or "ByteLevel" in parts:
            return "byte_level"
        if any(marker in state for marker in ('"Metaspace"', '"ByteFallback"', "\u2581", "\\u2581")):
            return "sentencepiece"
    if getattr(tokenizer, "byte_decoder", None) is not None:
        return "byte_level"
    if getattr(tokenizer, "sp_model", None) is not None:
        return "sentencepiece"
    vocab = _get_vocab(tokenizer)
    if vocab:
        sample = list(vocab)[:5000]
        n_g = sum(tok.startswith("Ġ") for tok in sample)
        n_s = sum(tok.startswith("\u2581") for tok in sample)
        if max(n_g, n_s) >= 0.02 * len(sample):
            return "byte_level" if n_g > n_s else "sentencepiece"
    return "plain"


def _get_vocab(tokenizer: Any) -> dict[str, int]:
    try:
        if hasattr(tokenizer, "get_vocab"):
            return dict(tokenizer.get_vocab())
    except (AttributeError, NotImplementedError, TypeError, ValueError) as exc:  # some slow tokenizers
        log.debug("get_vocab failed (%s); naming ids one by one", exc)
    return {}


def _raw_tokens(tokenizer: Any, n: int, vocab: dict[str, int]) -> list[str | None]:
    """The stored token string of every id ``0 .. n-1`` (``None`` where the tokenizer has none)."""
    raw: list[str | None] = [None] * n
    if vocab:
        for text, i in vocab.items():
            if 0 <= i < n:
                raw[i] = text
    missing = [i for i, tok in enumerate(raw) if tok is None]
    if missing:
        convert = getattr(tokenizer, "convert_ids_to_tokens", None) or getattr(tokenizer, "id_to_token", None)
        if convert is not None:
            for i in missing:
                try:
                    tok = convert(i)
                except (IndexError, KeyError, OverflowError, TypeError, ValueError):  # beyond the vocab
                    tok = None
                raw[i] = tok if isinstance(tok, str) else None
    return raw


def _special_ids(tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if isinstance(decoder, dict):
        ids.update(int(i) for i in decoder)
    for i in getattr(tokenizer, "all_special_ids", None) or ():
        if isinstance(i, int):
            ids.add(i)
    if not ids and hasattr(tokenizer, "to_str") and hasattr(tokenizer, "id_to_token"):
        try:  # a bare tokenizers.Tokenizer: its added tokens are in the JSON
            ids.update(int(t["id"]) for t in json.loads(tokenizer.to_str()).get("added_tokens", []))
        except (KeyError, TypeError, ValueError) as exc:  # not critical: they are shown as decoded
            log.debug("could not list added tokens: %s", exc)
    return ids


class TokenDisplay:
    """Display strings for every id of a tokenizer's vocabulary, computed once.

    Args:
        tokenizer: a Hugging Face tokenizer (fast or slow) or a bare ``tokenizers.Tokenizer``.
        vocab_size: ids to cover (default: the tokenizer's length); give the model's output-head
            rows when they exceed the tokenizer (padded vocabularies), so every logit has a name.

    Attributes:
        kind: ``"byte_level"``, ``"sentencepiece"`` or ``"plain"`` (see :func:`detect_kind`).
        token_to_id: the tokenizer's raw vocabulary ``{stored token string: id}``.
        special_ids: ids of special and added tokens.
        texts: ``list[str]`` over ids: the text each token stands for (real whitespace, undecodable
            bytes as ``\\xNN``, special tokens as written).
        vocab_size: ``len(texts)``.
    """

    _cache: ClassVar[weakref.WeakKeyDictionary] = weakref.WeakKeyDictionary()

    def __init__(self, tokenizer: Any, *, vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.kind = detect_kind(tokenizer)
        size = len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.get_vocab_size(with_added_tokens=True)
        n = max(int(size), int(vocab_size or 0))
        self.token_to_id: dict[str, int] = _get_vocab(tokenizer)
        raw = _raw_tokens(tokenizer, n, self.token_to_id)
        special = _special_ids(tokenizer)
        self.special_ids = frozenset(i for i in special if 0 <= i < n)
        convert = {"byte_level": self._from_byte_level, "sentencepiece": self._from_sentencepiece}.get(
            self.kind, lambda tok: tok)
        texts: list[str] = []
        for i, tok in enumerate(raw):
            if tok is None:
                texts.append(id_label(i))
            elif i in self.special_ids and not (self.kind == "sentencepiece" and _BYTE_TOKEN.match(tok)):
                texts.append(tok)  # added tokens are stored as plain text in every kind
            else:
                texts.append(convert(tok))
        self.texts = texts
        self.vocab_size = n
        self._strings: dict[bool, list[str]] = {}
        self._word_like: dict[bool, np.ndarray] = {}
        self._text_to_id: dict[str, int] | None = None  # built by _text_to_id on first use
        log.debug("TokenDisplay: %d ids, kind %s", n, self.kind)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, *, vocab_size: int | None = None) -> TokenDisplay:
        """The cached :class:`TokenDisplay` of ``tokenizer`` (built on first use)."""
        try:
            cached = cls._cache.get(tokenizer)
        except TypeError:  # not weak-referenceable or not hashable: no cache
            return cls(tokenizer, vocab_size=vocab_size)
        if cached is None or cached.vocab_size < int(vocab_size or 0):
            cached = cls(tokenizer, vocab_size=vocab_size)
            try:
                cls._cache[tokenizer] = cached
            except TypeError:
                pass
        return cached

    @classmethod
    def for_model(cls, model: LensModel) -> TokenDisplay:
        """The cached display of ``model.tokenizer``, covering all ``model.vocab_size`` logits.

        Raises:
            ValueError: the model's ``tokenizer`` is ``None``.
        """
        tokenizer = model.tokenizer
        if tokenizer is None:
            raise ValueError(f"The model {model.name!r} has no tokenizer to name tokens with.")
        return cls.for_tokenizer(tokenizer, vocab_size=model.vocab_size)

    # -- conversions ---------------------------------------------------------------------------
    @staticmethod
    def _from_byte_level(tok: str) -> str:
        latin = tok.translate(_byte_level_table())
        try:
            data = latin.encode("latin-1")
        except UnicodeEncodeError:  # characters outside the byte alphabet: an added token; keep it
            return tok
        return _bytes_text(data)

    @staticmethod
    def _from_sentencepiece(tok: str) -> str:
        match = _BYTE_TOKEN.match(tok)
        if match:
            return _bytes_text(bytes([int(match.group(1), 16)]))
        return tok.replace("\u2581", " ")

    # -- lookups -------------------------------------------------------------------------------
    def strings(self, show_whitespace: bool = False) -> list[str]:
        """Display strings for all ids (``list[str]`` of length ``vocab_size``), cached per mode."""
        key = bool(show_whitespace)
        if key not in self._strings:
            self._strings[key] = [visible(t, show_whitespace=key) for t in self.texts]
        return self._strings[key]

    def __call__(self, ids: Iterable[int] | int, *, show_whitespace: bool = False) -> list[str]:
        """Display strings of ``ids`` (an int, a sequence, a numpy array or a tensor)."""
        return [self.display(i, show_whitespace=show_whitespace) for i in _as_id_list(ids)]

    def display(self, token_id: int, *, show_whitespace: bool = False) -> str:
        """The display string of one id (``<id:N>`` beyond the vocabulary)."""
        return display_token(self.strings(show_whitespace), token_id)

    def word_like_mask(self, *, allow_digits: bool = False) -> np.ndarray:
        """``bool[vocab_size]``: which ids are word-like (:func:`is_word_like`); special tokens are not."""
        key = bool(allow_digits)
        if key not in self._word_like:
            mask = np.fromiter((is_word_like(t, allow_digits=key) for t in self.texts), dtype=bool,
                               count=self.vocab_size)
            if self.special_ids:
                mask[list(self.special_ids)] = False
            self._word_like[key] = mask
        return self._word_like[key]

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"TokenDisplay(kind={self.kind!r}, vocab_size={self.vocab_size})"


def _as_id_list(ids: Any) -> list[int]:
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, int):
        return [ids]
    out: list[int] = []
    for i in ids:
        if isinstance(i, (list, tuple)):
            out.extend(int(j) for j in i)
        else:
            out.append(int(i))
    return out


def encode_plain(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (BOS/EOS)."""
    if hasattr(tokenizer, "encode") and type(tokenizer).__name__ == "Tokenizer":  # bare tokenizers.Tokenizer
        return list(tokenizer.encode(text, add_special_tokens=False).ids)
    out = tokenizer(text, add_special_tokens=False)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return [int(i) for i in ids]


TOKEN_RULES = ("first", "exact", "word")
"""How :func:`token_id` maps a text that is not an id or a raw vocabulary entry (see there)."""

_ID_SPEC = re.compile(r"<id:(\d+)>")


def _first_token(tokenizer: Any, text: str) -> int:
    """The id of the first token of ``text`` (encoded without special tokens).

    Leading tokens that stand for whitespace only (a lone ``▁`` or ``Ġ``) are skipped when a
    later token exists, so ``" Paris"`` maps to ``▁Paris`` in SentencePiece vocabularies too.

    Raises:
        ValueError: ``text`` is empty, tokenizes to nothing, or only to the unknown token.
    """
    if not isinstance(text, str) or not text:
        raise ValueError(f"Cannot map {text!r} to a token: give a non-empty string.")
    ids = encode_plain(tokenizer, text)
    unk = getattr(tokenizer, "unk_token_id", None)
    if not ids or (unk is not None and all(i == unk for i in ids)):
        raise ValueError(f"{text!r} is not in the tokenizer's vocabulary (it tokenizes to "
                         f"{'nothing' if not ids else 'the unknown token'}): pick another string.")
    display = TokenDisplay.for_tokenizer(tokenizer)
    chosen = next((i for i in ids if i < display.vocab_size and display.texts[i].strip()), ids[0])
    if unk is not None and chosen == unk:
        raise ValueError(f"{text!r} starts with a character the tokenizer does not know (it maps to the "
                         "unknown token): pick another string.")
    return int(chosen)


def token_id(tokenizer: Any, token: str | int, *, rule: str = "first", vocab_size: int | None = None) -> int:
    """The id of the one token ``token`` names, under a stated ``rule`` for plain text.

    Every rule takes these exactly:

    * an ``int`` as an id (it must lie in ``[0, vocab_size)``);
    * ``"<id:N>"`` as id ``N`` (how readings name an id without a vocabulary entry);
    * a raw vocabulary entry (``"ĠParis"``, ``"▁Paris"``, ``"<|eos|>"``) as that entry's id.

    Any other text maps by ``rule``:

    * ``"first"``: the first token of its encoding (:func:`_first_token`): ``" Paris"`` is the
      space-prefixed token, a word split into several tokens is tracked by its first piece (pins);
    * ``"exact"``: the token whose text is exactly ``token`` (``" Paris"``); a text that is several
      tokens is an error (read directions: one token's direction);
    * ``"word"``: a bare word (no leading or trailing space, ``"France"``) is its first single-token
      spelling (:func:`spellings`, leading-space forms first: the form a word takes inside a
      sentence), even where the bare word is also a raw entry; a text with its spaces, or a word
      with no single-token spelling, as ``"exact"`` (concepts to steer, ablate or swap).

    Raises:
        ValueError: an unknown ``rule``, an id out of range, an empty string, a text that tokenizes
            to nothing or only to the unknown token, or (``"exact"``, ``"word"``) a text that is not
            one token (the message shows its pieces).
    """
    if rule not in TOKEN_RULES:
        raise ValueError(f"rule={rule!r} is not a token rule: use one of {', '.join(TOKEN_RULES)}.")
    display = TokenDisplay.for_tokenizer(tokenizer, vocab_size=vocab_size)
    size = int(vocab_size) if vocab_size is not None else display.vocab_size
    if isinstance(token, (int, np.integer)) and not isinstance(token, bool):
        if not 0 <= int(token) < size:
            raise ValueError(f"Token id {int(token)} is out of range: the vocabulary has ids 0..{size - 1}.")
        return int(token)
    if not isinstance(token, str) or not token:
        raise ValueError(f"Cannot map {token!r} to a token: give a non-empty string or a token id.")
    by_id = _ID_SPEC.fullmatch(token)
    if rule == "word" and not by_id and token.strip() == token:
        # Before the raw entries: a bare "France" means " France" in a sentence, not the raw entry "France".
        found = spellings(tokenizer, token, vocab_size=vocab_size)
        if found:
            return next(iter(found.values()))
    vocab = display.token_to_id
    if token in vocab and 0 <= vocab[token] < size:
        return int(vocab[token])
    if by_id:
        return token_id(tokenizer, int(by_id.group(1)), vocab_size=size)
    if rule == "first":
        return _first_token(tokenizer, token)
    exact = _text_to_id(display).get(token)
    if exact is not None:
        return exact
    pieces = display_ids(display, encode_plain(tokenizer, token))
    raise ValueError(f"{token!r} is not a single vocabulary token: it is {len(pieces)} pieces "
                     f"{' '.join(repr(p) for p in pieces)}; pick one of them, or a word that is one token "
                     f"(often with a leading space, like ' Paris').")


def pin_spec(tokenizer: Any, tid: int, *, vocab_size: int | None = None) -> str:
    """A string that :func:`token_id` (``rule="first"``) maps back to id ``tid``, as readable as possible.

    The token's text (``" Paris"``) when it names that token and holds no comma (pins are typed as a
    comma-separated list), else the raw vocabulary entry (``"ĠParis"``), else ``"<id:N>"``.

    Raises:
        ValueError: an id outside the vocabulary.
    """
    display = TokenDisplay.for_tokenizer(tokenizer, vocab_size=vocab_size)
    tid = int(tid)
    if not 0 <= tid < display.vocab_size:
        raise ValueError(f"Token id {tid} is out of range: the vocabulary has ids 0..{display.vocab_size - 1}.")
    text = display.texts[tid]
    candidates = [text] + [raw for raw, i in display.token_to_id.items() if i == tid]
    for candidate in candidates:
        if candidate and "," not in candidate:
            try:
                if token_id(tokenizer, candidate, vocab_size=vocab_size) == tid:
                    return candidate
            except ValueError:
                continue
    return id_label(tid)


def _text_to_id(display: TokenDisplay) -> dict[str, int]:
    """``{text: id}`` over the in-range non-special tokens (the smallest id where two share a text)."""
    cached = display._text_to_id
    if cached is None:
        cached = {}
        for i, text in enumerate(display.texts):
            if i not in display.special_ids and text not in cached:
                cached[text] = i
        display._text_to_id = cached
    return cached


def spelling_variants(word: str) -> list[str]:
    """The spellings of a word that count as it: as written, lower-cased, capitalised, each with and
    without a leading space (de-duplicated, in that order, the leading-space forms first)."""
    core = word.strip() if isinstance(word, str) else ""
    if not core:
        raise ValueError(f"Cannot look up the word {word!r}: it is empty.")
    forms = dict.fromkeys([core, core.lower(), core[:1].upper() + core[1:]])
    return list(dict.fromkeys([" " + f for f in forms] + list(forms)))


def spellings(tokenizer: Any, word: str, *, rule: str = "exact", vocab_size: int | None = None) -> dict[str, int]:
    """``{spelling: id}``: the tokens that count as ``word``.

    * ``rule="exact"``: each spelling of ``word`` (:func:`spelling_variants`: as written, lower-cased,
      capitalised, leading-space forms first) that one vocabulary token stands for exactly (its
      text equals the spelling; special tokens excluded). Empty when the word has no complete
      single-token spelling: it is then not scored by a prefix.
    * ``rule="first"``: the first token (:func:`_first_token`) of the word as written and with a
      leading space, keyed by the token's display text, de-duplicated (never empty). A word split
      into several tokens is found by its first piece (pass@k's ``spelling="first_token"``).

    Raises:
        ValueError: an empty word, an unknown ``rule``, or (``"first"``) a word that cannot be tokenized.
    """
    if rule == "exact":
        table = _text_to_id(TokenDisplay.for_tokenizer(tokenizer, vocab_size=vocab_size))
        return {v: table[v] for v in spelling_variants(word) if v in table}
    if rule != "first":
        raise ValueError(f"rule={rule!r} is not a spelling rule: use 'exact' or 'first'.")
    stripped = word.strip() if isinstance(word, str) else word
    if not isinstance(stripped, str) or not stripped:
        raise ValueError(f"Cannot look up the word {word!r}: it is empty.")
    display = TokenDisplay.for_tokenizer(tokenizer, vocab_size=vocab_size)
    out: dict[str, int] = {}
    for variant in (stripped, " " + stripped):
        tid = _first_token(tokenizer, variant)
        if tid not in out.values():
            out.setdefault(display_token(display, tid), tid)
    return out


def id_label(token_id: int) -> str:
    """``"<id:N>"``: how an id without a vocabulary entry (a padding row of the output head) is shown;
    :func:`token_id` maps it back to ``N``."""
    return f"<id:{int(token_id)}>"


def display_token(strings: TokenDisplay | Sequence[str], token_id: int, *, show_whitespace: bool = False) -> str:
    """The display string of one id: ``strings[id]``, or :func:`id_label` for an id outside them.

    Args:
        strings: a :class:`TokenDisplay` (its strings in the ``show_whitespace`` mode), or a list of
            display strings already chosen (a reading's ``vocab_strings``; ``show_whitespace`` unused).
        token_id: any integer id (negative or beyond the vocabulary: ``"<id:N>"``).
    """
    if isinstance(strings, TokenDisplay):
        strings = strings.strings(show_whitespace)
    i = int(token_id)
    return strings[i] if 0 <= i < len(strings) else id_label(i)


def display_ids(strings: TokenDisplay | Sequence[str], ids: Iterable[int], *,
                show_whitespace: bool = False) -> list[str]:
    """Display strings of ``ids`` (:func:`display_token` of each) from an existing :class:`TokenDisplay`
    or list of display strings (no cache look-up)."""
    if isinstance(strings, TokenDisplay):
        strings = strings.strings(show_whitespace)
    return [display_token(strings, i) for i in ids]


__all__ = ["KINDS", "TOKEN_RULES", "TokenDisplay", "bytes_to_unicode", "detect_kind", "display_ids", "display_token",
           "encode_plain", "id_label", "is_word_like", "pin_spec", "spelling_variants", "spellings", "token_id",
           "visible"]
