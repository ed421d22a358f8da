"""Token display strings (byte-level BPE, SentencePiece, plain), naming a token by a string, and the word-like filter."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from jlens_core.reading.tokens import (
    TOKEN_RULES,
    TokenDisplay,
    bytes_to_unicode,
    detect_kind,
    display_ids,
    display_token,
    is_word_like,
    spellings,
    token_id,
    visible,
)


def token_display(tokenizer, ids, *, show_whitespace: bool = False) -> list[str]:
    """Display strings of token ``ids`` through the tokenizer's cached :class:`TokenDisplay`."""
    return TokenDisplay.for_tokenizer(tokenizer)(ids, show_whitespace=show_whitespace)


def _sentencepiece_tokenizer(*, byte_fallback: bool = True):
    """A Llama-2-style tokenizer built by hand: Metaspace (``▁``), BPE, ``<0xNN>`` byte fallback."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyzPTF.,":
        vocab.setdefault(ch, len(vocab))
    merges = [("▁", "P"), ("a", "r"), ("▁P", "ar"), ("i", "s"), ("▁Par", "is"), ("▁", "t"), ("h", "e"),
              ("▁t", "he"), ("▁", "i"), ("▁i", "s")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=byte_fallback)
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def sp_tokenizer():
    return _sentencepiece_tokenizer()


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# -- byte-level BPE (the test tokenizer of conftest) ------------------------------------------
def test_byte_level_kind_and_alphabet(tokenizer):
    assert detect_kind(tokenizer) == "byte_level"
    alphabet = bytes_to_unicode()
    assert len(alphabet) == 256 and len(set(alphabet.values())) == 256
    assert alphabet[ord(" ")] == "Ġ" and alphabet[ord("\n")] == "Ċ" and alphabet[ord("a")] == "a"


def test_byte_level_display(tokenizer):
    ids = _ids(tokenizer, "The capital\n\tis 日")
    raw = tokenizer.convert_ids_to_tokens(ids)
    assert "Ġcapital" in raw and "Ċ" in raw and "ĉ" in raw
    plain = token_display(tokenizer, ids)
    glyphs = token_display(tokenizer, ids, show_whitespace=True)
    assert plain[raw.index("Ġcapital")] == " capital"
    assert glyphs[raw.index("Ġcapital")] == "·capital"
    assert plain[raw.index("Ċ")] == "\\n" and glyphs[raw.index("Ċ")] == "↵"
    assert plain[raw.index("ĉ")] == "\\t" and glyphs[raw.index("ĉ")] == "→"
    # 日 is three UTF-8 bytes, each its own token here: shown as escapes, not as replacement chars
    assert plain[-3:] == ["\\xe6", "\\x97", "\\xa5"]
    assert "".join(plain).count("\ufffd") == 0
    # every display string is one line
    display = TokenDisplay.for_tokenizer(tokenizer)
    assert all("\n" not in s and "\t" not in s for s in display.strings())
    assert all("\n" not in s and " " not in s for s in display.strings(True))


def test_special_and_out_of_vocab_ids(tokenizer):
    display = TokenDisplay(tokenizer, vocab_size=len(tokenizer) + 4)
    assert display.display(tokenizer.bos_token_id) == "<|bos|>"
    assert tokenizer.bos_token_id in display.special_ids
    assert display.display(len(tokenizer) + 1) == f"<id:{len(tokenizer) + 1}>"
    assert display.display(10_000) == "<id:10000>"
    assert len(display.strings()) == len(tokenizer) + 4
    assert not display.word_like_mask()[tokenizer.bos_token_id]


def test_display_cache_is_shared(tokenizer):
    assert TokenDisplay.for_tokenizer(tokenizer) is TokenDisplay.for_tokenizer(tokenizer)
    display = TokenDisplay.for_tokenizer(tokenizer)
    assert display.strings() is display.strings()
    assert display([5, 6]) == token_display(tokenizer, np.array([5, 6]))


# -- SentencePiece --------------------------------------------------------------------------------
def test_sentencepiece_display(sp_tokenizer):
    assert detect_kind(sp_tokenizer) == "sentencepiece"
    ids = _ids(sp_tokenizer, "the Paris\n日")
    raw = sp_tokenizer.convert_ids_to_tokens(ids)
    assert raw[:2] == ["▁the", "▁Paris"]
    assert "<0x0A>" in raw and raw[-3:] == ["<0xE6>", "<0x97>", "<0xA5>"]
    plain = token_display(sp_tokenizer, ids)
    glyphs = token_display(sp_tokenizer, ids, show_whitespace=True)
    assert plain[:2] == [" the", " Paris"]
    assert glyphs[:2] == ["·the", "·Paris"]
    assert plain[raw.index("<0x0A>")] == "\\n" and glyphs[raw.index("<0x0A>")] == "↵"
    assert plain[-3:] == ["\\xe6", "\\x97", "\\xa5"]
    display = TokenDisplay.for_tokenizer(sp_tokenizer)
    assert display.texts[sp_tokenizer.convert_tokens_to_ids("<0x41>")] == "A"
    assert display.display(sp_tokenizer.convert_tokens_to_ids("<s>")) == "<s>"


def test_sentencepiece_token_lookup(sp_tokenizer):
    paris = sp_tokenizer.convert_tokens_to_ids("▁Paris")
    assert token_id(sp_tokenizer, "Paris") == paris  # the Metaspace prefix space
    assert token_id(sp_tokenizer, "▁Paris") == paris  # a raw vocabulary entry
    assert token_id(sp_tokenizer, " Paris") == paris  # a lone leading ▁ is skipped
    assert paris in spellings(sp_tokenizer, "Paris", rule="first").values()


def test_unknown_token_is_an_error():
    tok = _sentencepiece_tokenizer(byte_fallback=False)
    with pytest.raises(ValueError, match="unknown token"):
        token_id(tok, "日")
    with pytest.raises(ValueError, match="non-empty"):
        token_id(tok, "")
    with pytest.raises(ValueError, match="out of range"):
        token_id(tok, 10_000)


# -- naming a token by a string: token_id's rules, spellings ----------------------------------------
def test_token_id_rules(tokenizer):
    vocab = tokenizer.get_vocab()
    the, space_the, capital = vocab["The"], vocab["ĠThe"], vocab["Ġcapital"]
    assert tokenizer.tokenize("capitals") == ["cap", "ital", "s"]  # the premise of the multi-token cases
    for rule in TOKEN_RULES:  # ids, "<id:N>" and raw entries are taken exactly by every rule
        assert token_id(tokenizer, 7, rule=rule) == 7
        assert token_id(tokenizer, f"<id:{capital}>", rule=rule) == capital
        assert token_id(tokenizer, "Ġcapital", rule=rule) == capital
        assert token_id(tokenizer, " capital", rule=rule) == capital
    # "first": a text of several tokens is its first token
    assert token_id(tokenizer, "capitals") == token_id(tokenizer, "capitals", rule="first") == vocab["cap"]
    assert token_id(tokenizer, " capital city", rule="first") == capital
    # "exact": only a text one token stands for; the error shows the pieces
    assert token_id(tokenizer, "The", rule="exact") == the
    with pytest.raises(ValueError, match=r"^'capitals' is not a single vocabulary token: it is 3 pieces 'cap' 'ital' 's';"):
        token_id(tokenizer, "capitals", rule="exact")
    # "word": a bare word is its leading-space spelling, even where the bare word is a raw entry too
    assert token_id(tokenizer, "The", rule="word") == space_the
    assert token_id(tokenizer, "capital", rule="word") == capital
    with pytest.raises(ValueError, match="'capitals' is not a single vocabulary token"):
        token_id(tokenizer, "capitals", rule="word")
    with pytest.raises(ValueError, match=r"^rule='last' is not a token rule: use one of first, exact, word\.$"):
        token_id(tokenizer, "The", rule="last")


def test_spellings_rules(tokenizer, sp_tokenizer):
    vocab = tokenizer.get_vocab()
    # "exact": the variants one token stands for, leading-space forms first
    assert list(spellings(tokenizer, "the").items()) == [(" The", vocab["ĠThe"]), ("The", vocab["The"])]
    assert spellings(tokenizer, "capitals") == {}
    # "first": the first token of the word as written and with a leading space
    assert spellings(tokenizer, "capitals", rule="first") == {"cap": vocab["cap"], " capital": vocab["Ġcapital"]}
    assert spellings(tokenizer, " capitals ", rule="first") == spellings(tokenizer, "capitals", rule="first")
    paris = sp_tokenizer.convert_tokens_to_ids("▁Paris")  # Metaspace adds the space: one candidate, not two
    assert spellings(sp_tokenizer, "Paris", rule="first") == {" Paris": paris}
    with pytest.raises(ValueError, match="it is empty"):
        spellings(tokenizer, " ", rule="first")
    with pytest.raises(ValueError, match="rule='whole' is not a spelling rule"):
        spellings(tokenizer, "the", rule="whole")


def test_display_ids_name_ids_beyond_the_strings(tokenizer):
    display = TokenDisplay.for_tokenizer(tokenizer)
    capital, n = tokenizer.get_vocab()["Ġcapital"], display.vocab_size
    assert display_ids(display, [capital, n, -1]) == [" capital", f"<id:{n}>", "<id:-1>"]
    assert display_ids(display, [capital], show_whitespace=True) == ["·capital"]
    assert display_ids(["a", "b"], [1, 2]) == ["b", "<id:2>"]  # a reading's vocab_strings
    assert display_token(display, n + 3) == display.display(n + 3) == f"<id:{n + 3}>"
    assert token_id(tokenizer, display_token(display, capital)) == capital  # a display string names its token


# -- plain vocabularies ------------------------------------------------------------------------------
def test_plain_vocabulary():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    assert detect_kind(hf) == "plain"
    assert token_display(hf, [1, 2, 0]) == ["hello", "world", "[UNK]"]


# -- visible() and the word-like filter ------------------------------------------------------------
def test_visible():
    assert visible(" a\tb\r\n") == " a\\tb\\r\\n"
    assert visible(" a\tb\r\n", show_whitespace=True) == "·a→b␍↵"
    assert visible("\x00\x07\x7f") == "\\x00\\x07\\x7f"
    assert visible("\x00\x07\x7f", show_whitespace=True) == "␀␇␡"
    assert visible("a\u200bb\ufeff") == "a\\u200bb\\ufeff"
    assert visible("a\u00a0b", show_whitespace=True) == "a⍽b"
    assert visible("plain") == "plain"


@pytest.mark.parametrize("text, expected", [
    (" Paris", True), ("·Paris", True), ("Paris", True), ("ing", True), ("don't", True), ("well-known", True),
    (" été", True), ("日本", True), ("I", True),
    (" ", False), ("", False), ("↵", False), (".", False), (" ,", False), ("12", False), ("<|eos|>", False),
    ("\\xe6", False), ("'s", False), ("-ly", False), ("a1", False),
])
def test_is_word_like(text, expected):
    assert is_word_like(text) is expected


def test_is_word_like_digits():
    assert is_word_like("a1", allow_digits=True) and is_word_like(" 42", allow_digits=True)


def test_word_like_mask_matches_filter(tokenizer):
    display = TokenDisplay.for_tokenizer(tokenizer)
    mask = display.word_like_mask()
    assert mask.dtype == bool and mask.shape == (display.vocab_size,)
    expected = [is_word_like(t) and i not in display.special_ids for i, t in enumerate(display.texts)]
    assert mask.tolist() == expected
    assert mask.any() and not mask.all()


def test_large_vocabulary_is_fast():
    """A 50k byte-level vocabulary: all display strings and the word mask in well under a second or two."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = list(bytes_to_unicode().values())
    rng = random.Random(0)
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    while len(vocab) < 50_000:
        word = "".join(rng.choices(alphabet, k=rng.randint(2, 8)))
        vocab.setdefault(("Ġ" if rng.random() < 0.5 else "") + word, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    start = time.perf_counter()
    display = TokenDisplay(hf)
    display.strings(False)
    display.strings(True)
    display.word_like_mask()
    elapsed = time.perf_counter() - start
    assert display.vocab_size == 50_000 and display.kind == "byte_level"
    assert elapsed < 5.0, f"building the display of a 50k vocabulary took {elapsed:.2f} s"


def test_pin_spec_maps_back_to_the_token(tokenizer):
    from jlens_core.reading.tokens import pin_spec

    display = TokenDisplay.for_tokenizer(tokenizer)
    named = 0
    for tid in range(display.vocab_size):
        spec = pin_spec(tokenizer, tid)
        assert token_id(tokenizer, spec) == tid and "," not in spec
        named += spec == display.texts[tid]
    assert named > display.vocab_size // 2  # mostly the readable text, not the raw entry
    comma = display.token_to_id[","]
    assert pin_spec(tokenizer, comma) == f"<id:{comma}>"
    with pytest.raises(ValueError, match="out of range"):
        pin_spec(tokenizer, display.vocab_size)
