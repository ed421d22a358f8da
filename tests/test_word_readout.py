"""The word-token readout, ``vocab="word"`` (docs/method.md §9.1): the mask against the tokenizer's own
decoding, ranks and top-k against a filter of HF's own logits, pass@k with candidate spellings that are
not words, most common tokens, and the one-sentence errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_tokenizer
from helpers import reference_logits

from jlens_core import HFLensModel, LogitLens, most_common_tokens, pass_at_k, read_prompt
from jlens_core.evaluation.passk import pass_at_k_detail
from jlens_core.reading.tokens import TokenDisplay
from jlens_core.reading.word_readout import kept_ids_mask, word_mask

PADDING = 7  # output-head rows past the tokenizer


def independent_word_mask(tokenizer, width: int) -> np.ndarray:
    """``bool[width]`` by the rule itself: the tokenizer's decoding of each id, special tokens skipped."""
    special = set(tokenizer.all_special_ids)
    out = np.zeros(width, dtype=bool)
    for i in range(min(width, len(tokenizer))):
        text = tokenizer.decode([i], skip_special_tokens=True)
        out[i] = i not in special and any(c.isalnum() for c in text.replace("\ufffd", ""))
    return out


def char_model(chars: str, *, padding: int = PADDING) -> HFLensModel:
    """A tiny llama over a character tokenizer of ``chars`` whose output head has ``padding`` extra rows."""
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<bos>", "<eos>", *chars])}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[])),
                                        bos_token="<bos>", eos_token="<eos>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer) + padding, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, bos_token_id=0,
                         eos_token_id=1)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return HFLensModel(hf, tokenizer, name="tiny-chars-padded")


@pytest.fixture(scope="module")
def padded():
    return char_model("abcdefghij .,+*=!?0123456789")


def test_word_mask_matches_the_tokenizers_decoding(llama):
    tokenizer = llama.tokenizer
    display = TokenDisplay.for_model(llama)
    mask = word_mask(display)
    expected = independent_word_mask(tokenizer, display.vocab_size)
    assert mask.shape == (display.vocab_size,)
    assert np.array_equal(mask, expected)
    assert 0 < mask.sum() < len(mask)  # the BPE vocabulary has both kinds (bytes, punctuation, words)
    assert word_mask(display) is mask and not mask.flags.writeable  # cached, read-only


def test_word_mask_leaves_out_padded_rows(padded):
    display = TokenDisplay.for_model(padded)
    n = len(padded.tokenizer)
    mask = kept_ids_mask(display, "word", padded.vocab_size)
    assert padded.vocab_size == n + PADDING and mask.shape == (n + PADDING,)
    assert not mask[n:].any()
    assert np.array_equal(mask, independent_word_mask(padded.tokenizer, padded.vocab_size))
    assert kept_ids_mask(display, "all", padded.vocab_size) is None


def test_ranks_and_top_k_equal_a_filter_of_the_full_logits(padded):
    text = "abc, def! 12+3 = ?"
    lens = LogitLens.for_model(padded)
    word = read_prompt(padded, lens, text, top_k=5, pinned=["a", "+"], vocab="word")
    full = read_prompt(padded, lens, text, top_k=5, pinned=["a", "+"])
    ids = padded.encode(text)
    keep = torch.as_tensor(independent_word_mask(padded.tokenizer, padded.vocab_size))
    logits = reference_logits(padded, ids)  # per layer [seq, vocab]
    pins = {name: int(tid) for name, tid in word.pinned.items()}
    seq = ids.shape[1]
    for li, layer in enumerate(word.layers):
        for p in range(seq):
            z = logits[layer][p].double()  # [vocab]

            def rank(t: int, z=z) -> int:
                return 1 + int(((z > z[t]) & keep).sum())

            if p + 1 < seq:
                assert word.next_token_rank[li, p] == rank(int(ids[0, p + 1]))
            assert word.final_top1_rank[li, p] == rank(int(logits[-1][p].argmax()))
            for name, tid in pins.items():
                assert word.pinned_ranks[name][li, p] == rank(tid)
            expected_top = torch.where(keep, z, torch.tensor(-np.inf, dtype=z.dtype)).topk(5).indices
            assert word.top_ids[li, p].tolist() == expected_top.tolist()
    assert keep[word.top_ids.reshape(-1)].all()
    # the readout changes no distribution statistic, and makes no rank worse
    for stat in ("entropy_bits", "kl_bits", "ce_bits"):
        assert np.allclose(word.grid(stat), full.grid(stat), equal_nan=True)
    assert (word.final_top1_rank <= full.final_top1_rank).all()
    assert word.vocab == "word" and full.vocab == "all"
    assert not torch.equal(torch.as_tensor(word.final_top1_rank), torch.as_tensor(full.final_top1_rank))


def test_candidate_spellings_are_never_excluded(padded):
    items = [{"prompt": "ab cd ef", "intermediates": ["+", "c", "?"]},
             {"prompt": "1 2 3", "intermediates": ["!"], "target": "="}]
    lens = LogitLens.for_model(padded)
    detail = pass_at_k_detail(padded, {"logit": lens}, items, vocab="word")
    base = independent_word_mask(padded.tokenizer, padded.vocab_size)
    assert detail["scored"].all()  # "+", "?", "!", "=" have no letter or digit, and still count
    for index, item in enumerate(items):
        ids = padded.encode(item["prompt"])
        logits = torch.stack([z[-1] for z in reference_logits(padded, ids)]).double()  # [layers, vocab]
        rows = detail[detail["item"] == index]
        keep = torch.as_tensor(base.copy())
        keep[[int(t) for ids_ in rows["token_ids"] for t in ids_]] = True  # every spelling of the item
        for _, row in rows.iterrows():
            cands = [int(t) for t in row["token_ids"]]
            per_layer = [min(1 + int(((z > z[c]) & keep).sum()) for c in cands) for z in logits]
            assert row["best_rank"] == min(per_layer)
            assert row["final_rank"] == per_layer[-1]
    assert (detail["vocab"] == "word").all()
    summary = pass_at_k(padded, {"logit": lens}, items, k=(1, 3), vocab="word")
    assert (summary["vocab"] == "word").all()
    assert (pass_at_k(padded, {"logit": lens}, items, k=1)["vocab"] == "all").all()


def test_most_common_tokens_counts_word_tokens(llama):
    lens = LogitLens.for_model(llama)
    reading = read_prompt(llama, lens, "The capital of France is Paris. 12, 345 and 6789; #, @", top_k=10)
    mask = independent_word_mask(llama.tokenizer, llama.vocab_size)
    counts: dict[int, int] = {}
    for li, layer in enumerate(reading.layers):
        if layer == reading.output_layer:
            continue
        for pi in range(reading.n_positions):
            words = [t for t in reading.top_ids[li, pi].tolist() if mask[t]]
            if words:
                counts[words[0]] = counts.get(words[0], 0) + 1
    table = most_common_tokens(reading, vocab="word", top_n=10_000)
    assert dict(zip(table["token_id"], table["count"])) == counts
    read_word = read_prompt(llama, lens, "The capital of France is Paris.", top_k=3, vocab="word")
    assert mask[most_common_tokens(read_word, vocab="word")["token_id"].to_numpy()].all()


def test_bad_vocab_and_an_empty_word_vocabulary_are_one_sentence(llama):
    lens = LogitLens.for_model(llama)
    with pytest.raises(ValueError, match="Unknown vocab 'words'"):
        read_prompt(llama, lens, "abc", vocab="words")
    with pytest.raises(ValueError, match="Unknown vocab"):
        pass_at_k(llama, {"logit": lens}, [{"prompt": "a b", "intermediates": ["b"]}], vocab="Word")
    symbols = char_model(" .,+*=!?", padding=0)
    with pytest.raises(ValueError, match="vocab='word' leaves no token"):
        read_prompt(symbols, LogitLens.for_model(symbols), ". , +", vocab="word")
    read_prompt(symbols, LogitLens.for_model(symbols), ". , +")  # the full vocabulary still reads


def test_make_tokenizer_has_non_word_tokens():
    """The fixture tokenizer holds bytes, punctuation and special tokens, so the mask test above can fail."""
    tokenizer = make_tokenizer()
    mask = independent_word_mask(tokenizer, len(tokenizer))
    assert (~mask).sum() > 20 and not mask[tokenizer.bos_token_id]
