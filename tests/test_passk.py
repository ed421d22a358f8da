"""pass@k (docs/method.md §8): its protocol on a tiny model with a character tokenizer (readout rules, complete
single-token spellings, synonyms and coverage), the frames on the tiny llama, each against ranks computed by
hand from HF's own hidden states; the evaluation sets, shipped and read from files."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import identity_lens, reference_logits

from jlens_core import HFLensModel, LensFileError, LogitLens
from jlens_core.evaluation.passk import (
    DETAIL_COLUMNS,
    EVAL_DIR,
    EVAL_SETS,
    PASS_COLUMNS,
    bootstrap_interval,
    decoy_items,
    load_eval_set,
    macro_mean,
    number_synonyms,
    pass_at_k,
    pass_at_k_detail,
    readout_position,
    summarize_pass_at_k,
    word_spellings,
)
from jlens_core.reading.tokens import spellings

CHARS = list("abcdefghijklmnopqrstuvwxyz .,\n+*=") + [str(d) for d in range(10)]
# " cat" is one token (made by merges); "dog" is three; "7" is one: "seven" scores only through it
MERGES = [(" ", "c"), (" c", "a"), (" ca", "t")]


def char_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<bos>", "<eos>"] + CHARS + ["".join(m) for m in MERGES])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>")


def char_model() -> HFLensModel:
    """A tiny random llama over the character tokenizer (seeded: the same model each call)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=1)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return HFLensModel(hf, tokenizer, name="tiny-chars")


@pytest.fixture(scope="module")
def model():
    return char_model()


def hand_best_rank(model, prompt: str, position: int, token_ids: list[int]) -> int:
    """Best 1-based rank of ``token_ids`` over every layer's logit lens (HF hidden states; last = the output)."""
    ids = model.encode(prompt)
    with torch.no_grad():
        out = model.hf_model(ids, output_hidden_states=True)
    best = None
    for layer in range(model.n_layers):
        if layer == model.n_layers - 1:
            logits = out.logits[0, position].float()
        else:
            logits = model.hf_model.lm_head(model.final_norm(out.hidden_states[layer + 1][0, position])).float()
        for t in token_ids:
            rank = int((logits > logits[t]).sum()) + 1
            best = rank if best is None else min(best, rank)
    return best


def test_spellings_whole_word_only(model):
    tok = model.tokenizer
    cat = tok.convert_tokens_to_ids(" cat")
    assert word_spellings(tok, "cat") == {" cat": cat}
    assert word_spellings(tok, "Cat") == {" cat": cat}  # lower-cased with a leading space
    assert word_spellings(tok, "dog") == {}  # three tokens: unscored, never by a prefix
    assert word_spellings(tok, "seven") == {}
    assert word_spellings(tok, "seven", synonyms="numbers_ops") == {"7": tok.convert_tokens_to_ids("7")}
    assert word_spellings(tok, "dog", spelling="first_token")  # the older rule scores its first letter
    assert number_synonyms("12") == ["12", "twelve"] and "+" in number_synonyms("plus")


def test_readout_rules(model):
    prompt = "a cat sat\nthe dog"
    ids = model.encode(prompt)
    tokens = [model.tokenizer.convert_ids_to_tokens(i) for i in ids[0].tolist()]
    assert readout_position(model, prompt, ids, "last") == len(tokens) - 1
    assert tokens[readout_position(model, prompt, ids, "last_newline")] == "\n"
    assert readout_position(model, prompt, ids, 2) == 2 and readout_position(model, prompt, ids, -3) == len(tokens) - 3
    before = readout_position(model, prompt, ids, {"before": "sat"})
    assert "".join(tokens[: before + 1]) == "a cat "
    with pytest.raises(ValueError, match="the prompt has no token with a newline"):
        readout_position(model, "a cat", model.encode("a cat"), "last_newline")
    with pytest.raises(ValueError, match="'cow' is not in the prompt"):
        readout_position(model, prompt, ids, {"before": "cow"})
    with pytest.raises(ValueError, match="no token of the prompt comes before 'a cat'"):
        readout_position(model, prompt, ids, {"before": "a cat"})
    with pytest.raises(ValueError, match="out of range"):
        readout_position(model, prompt, ids, 40)


def test_pass_at_k_against_hand_ranks(model):
    items = [
        {"name": "newline", "prompt": "a cat sat\nthe", "intermediates": ["cat", "dog"], "readout": "last_newline"},
        {"name": "before", "prompt": "one and six is seven", "intermediates": ["seven"], "readout": {"before": "is"},
         "synonyms": "numbers_ops"},
        {"name": "unscored", "prompt": "the dog ran", "intermediates": ["dog"]},
        {"name": "last", "prompt": "my cat is", "intermediates": ["Cat"], "target": "cat"},
    ]
    lens = {"logit": LogitLens.for_model(model)}
    summary, detail = pass_at_k(model, lens, items, k=(1, 5, 20), return_detail=True)
    tok = model.tokenizer
    cat, seven = tok.convert_tokens_to_ids(" cat"), tok.convert_tokens_to_ids("7")
    rows = detail.set_index(["name", "word"])
    expected = {("newline", "cat"): ("a cat sat\nthe", "last_newline", [cat]),
                ("before", "seven"): ("one and six is seven", {"before": "is"}, [seven]),
                ("last", "Cat"): ("my cat is", "last", [cat])}
    for key, (prompt, rule, cands) in expected.items():
        position = readout_position(model, prompt, model.encode(prompt), rule)
        row = rows.loc[key]
        assert row["scored"] and row["position"] == position and row["token_ids"] == cands
        assert row["best_rank"] == hand_best_rank(model, prompt, position, cands)
    assert not rows.loc[("newline", "dog"), "scored"] and not rows.loc[("unscored", "dog"), "scored"]
    assert np.isnan(rows.loc[("unscored", "dog"), "best_rank"])
    assert rows.loc[("last", "cat"), "role"] == "target"  # looked up, never scored in pass@k
    # unscored words leave the denominators: 3 items of 4 are scored, 3 words of 5
    for k in (1, 5, 20):
        got = summary[summary.k == k].iloc[0]
        assert got["items_scored"] == 3 and got["n_items"] == 4
        assert got["words_scored"] == 3 and got["n_words"] == 5
        hits = [rows.loc[key, "best_rank"] <= k for key in expected]
        assert got["pass_rate"] == pytest.approx(np.mean(hits))
        assert got["ci_low"] <= got["pass_rate"] <= got["ci_high"]


def test_readout_override_and_first_token_rule(model):
    items = [{"prompt": "a cat sat\nthe", "intermediates": ["cat"], "readout": "last_newline"}]
    lens = {"logit": LogitLens.for_model(model)}
    _, set_rule = pass_at_k(model, lens, items, k=1, return_detail=True)
    _, overridden = pass_at_k(model, lens, items, k=1, readout="last", return_detail=True)
    ids = model.encode(items[0]["prompt"])[0].tolist()
    assert set_rule["position"].iloc[0] == ids.index(model.tokenizer.convert_tokens_to_ids("\n"))
    assert overridden["position"].iloc[0] == len(ids) - 1
    _, first = pass_at_k(model, lens, [{"prompt": "the", "intermediates": ["dog"]}], k=1, spelling="first_token",
                         return_detail=True)
    # the first token of "dog" and of " dog" (a lone leading space is skipped): the letter d
    assert first["scored"].iloc[0] and first["token_ids"].iloc[0] == [model.tokenizer.convert_tokens_to_ids("d")]
    with pytest.raises(ValueError, match="Unknown spelling 'prefix'"):
        pass_at_k(model, lens, items, spelling="prefix")


def test_bootstrap_interval_contains_the_mean_and_narrows():
    few = [0.0, 1.0] * 5
    many = [0.0, 1.0] * 50
    lo_few, hi_few = bootstrap_interval(few)
    lo_many, hi_many = bootstrap_interval(many)
    assert lo_few <= 0.5 <= hi_few and lo_many <= 0.5 <= hi_many
    assert hi_many - lo_many < hi_few - lo_few
    assert all(np.isnan(bootstrap_interval([])))


def test_reference_format_file_and_macro_mean(model, tmp_path):
    path = tmp_path / "ref.json"
    path.write_text(json.dumps({"readout": "last_newline", "items": [
        {"name": "a", "prompt": "a cat\nb", "intermediates": ["cat"]},
        {"name": "b", "prompt": "the cat\nis", "intermediates": ["cat"], "target": "cat"}]}))
    summary = pass_at_k(model, {"logit": LogitLens.for_model(model)}, str(path), k=(1, 50))
    assert summary["n_items"].tolist() == [2, 2] and summary.loc[1, "pass_rate"] == 1.0  # vocab < 50
    both = summary.assign(set="x")
    other = summary.assign(set="y", pass_rate=[0.0, 0.5])
    import pandas as pd

    macro = macro_mean(pd.concat([both, other]))
    assert macro["pass_rate"].tolist() == [pytest.approx((summary.loc[0, "pass_rate"] + 0.0) / 2), 0.75]
    assert (macro["set"] == "macro mean").all()
    assert load_eval_set(path)[0]["readout"] == "last_newline"


# -- on the tiny llama, and the evaluation sets --------------------------------------------------------
ITEMS = [
    {"prompt": "The capital of France is", "intermediates": ["France"], "target": "Paris"},
    {"prompt": "Water boils at one hundred", "intermediates": ["water", "boils"], "target": "degrees"},
    {"prompt": "def add(a, b):\n    return", "intermediates": "a", "target": "b"},
]


def test_pass_at_k_first_token_rule_frames_and_values(llama):
    """``spelling="first_token"``: the older rule, every word scored; checked against HF's own hidden states."""
    lenses = {"logit": LogitLens.for_model(llama), "jac": identity_lens(llama, layers=[1])}
    summary, detail = pass_at_k(llama, lenses, ITEMS, k=(1, 5, 50, 300), return_detail=True, spelling="first_token")
    assert list(summary.columns) == list(PASS_COLUMNS)
    assert list(detail.columns) == list(DETAIL_COLUMNS)
    assert summary[["lens", "k"]].values.tolist() == [[n, k] for n in ("logit", "jac") for k in (1, 5, 50, 300)]
    assert (summary["n_items"] == 3).all() and (summary["n_words"] == 4).all() and (summary["words_scored"] == 4).all()
    assert len(detail) == 2 * (4 + 3)
    # every rank is in the full vocabulary: k = vocab passes everything
    assert (summary[summary.k == 300]["pass_rate"] == 1.0).all()

    # independent best ranks for the logit lens
    for i, item in enumerate(ITEMS):
        ids = llama.encode(item["prompt"])
        last = torch.stack([logits[-1] for logits in reference_logits(llama, ids)])  # [n_layers, vocab]
        words = item["intermediates"] if isinstance(item["intermediates"], list) else [item["intermediates"]]
        for role, word in [("intermediate", w) for w in words] + [("target", item["target"])]:
            cands = list(spellings(llama.tokenizer, word, rule="first").values())
            ranks = torch.stack([(last > last[:, [c]]).sum(-1) + 1 for c in cands]).min(0).values  # [n_layers]
            row = detail[(detail.item == i) & (detail.lens == "logit") & (detail.word == word)].iloc[0]
            assert row.role == role and row.token_ids == cands
            assert row.best_rank == int(ranks.min()) and row.best_layer == int(torch.argmin(ranks))
            assert row.final_rank == int(ranks[-1])
            jrow = detail[(detail.item == i) & (detail.lens == "jac") & (detail.word == word)].iloc[0]
            assert jrow.best_rank == int(ranks[[1, 3]].min()) and jrow.best_layer in (1, 3)
    # the set's score: the mean over items of each item's share of intermediates found
    logit_inter = detail[(detail.lens == "logit") & (detail.role == "intermediate")]
    for k in (1, 5, 50):
        expected = float((logit_inter.best_rank <= k).groupby(logit_inter.item).mean().mean())
        got = summary[(summary.lens == "logit") & (summary.k == k)].pass_rate.item()
        assert got == pytest.approx(expected)
    again = summarize_pass_at_k(detail, 5)
    pd.testing.assert_frame_equal(again, summary[summary.k == 5].reset_index(drop=True))


def test_pass_at_k_bad_input(llama):
    lens = {"logit": LogitLens.for_model(llama)}
    with pytest.raises(ValueError, match="k=0"):
        pass_at_k(llama, lens, ITEMS, k=0)
    with pytest.raises(ValueError, match=r"item 0: missing field\(s\) \['intermediates'\]"):
        pass_at_k(llama, lens, [{"prompt": "x", "target": "y"}])
    with pytest.raises(ValueError, match=r"item 0: missing field\(s\) \['prompt'\]"):
        pass_at_k(llama, lens, [{"intermediates": ["y"]}])
    with pytest.raises(ValueError, match="item 0: 'intermediates' must be a list"):
        pass_at_k(llama, lens, [{"prompt": "x", "intermediates": [""], "target": "z"}])
    with pytest.raises(ValueError, match="items is empty"):
        pass_at_k(llama, lens, [])
    with pytest.raises(ValueError, match="unknown readout rule 'middle'"):
        pass_at_k(llama, lens, ITEMS, readout="middle")
    with pytest.raises(ValueError, match=r"item 0: readout \{'before': 'zebra'\}: 'zebra' is not in the prompt"):
        pass_at_k(llama, lens, ITEMS[:1], readout={"before": "zebra"})
    with pytest.raises(LensFileError):
        pass_at_k(llama, {"logit": LogitLens(llama.n_layers + 2, llama.d_model)}, ITEMS)


def test_shipped_eval_sets(llama):
    shipped = sorted(p.stem for p in EVAL_DIR.glob("*.json"))
    assert shipped == sorted(EVAL_SETS) and "two_hop" in shipped
    for name in shipped:
        items = load_eval_set(name)
        assert len(items) >= 20, name
        names = [item["name"] for item in items]
        assert len(set(names)) == len(names), name
        for item in items:
            assert item["prompt"].strip()
            assert item["intermediates"] and all(isinstance(w, str) and w.strip() for w in item["intermediates"])
            assert item["readout"] in ("last", "last_newline")
    two_hop = load_eval_set("two_hop")
    assert two_hop[0]["intermediates"] == ["France"] and two_hop[0]["target"] == "Paris"
    assert load_eval_set("arithmetic_chain")[0]["synonyms"] == "numbers_ops"
    summary = pass_at_k(llama, {"logit": LogitLens.for_model(llama)}, "antonym_chain", k=(1, 10))
    assert summary["n_items"].tolist() == [28, 28]


def test_load_eval_set_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="two_hop"):
        load_eval_set("no_such_set")
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"prompt": "a", "intermediates": ["b"], "target": "c"}) + "\n\n{oops\n")
    with pytest.raises(ValueError, match=r"mine.jsonl:3: not valid JSON"):
        load_eval_set(path)
    path.write_text(json.dumps({"prompt": "a", "intermediates": "b", "target": "c", "note": "kept"}) + "\n")
    assert load_eval_set(str(path)) == [{"prompt": "a", "intermediates": ["b"], "target": "c", "note": "kept"}]
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"sets": []}))
    with pytest.raises(ValueError, match="has no 'items' list"):
        load_eval_set(ref)
    ref.write_text(json.dumps({"items": [{"name": "x", "prompt": "p"}]}))
    with pytest.raises(ValueError, match=r"ref.json item 1 \(x\): missing field\(s\) \['intermediates'\]"):
        load_eval_set(ref)
    ref.write_text(json.dumps({"readout": "sideways", "items": [{"prompt": "p", "intermediates": ["q"]}]}))
    with pytest.raises(ValueError, match="unknown readout rule 'sideways'"):
        load_eval_set(ref)
    ref.write_text(json.dumps({"readout": "last_newline", "synonyms": "numbers_ops",
                               "items": [{"prompt": "p", "intermediates": ["q"]},
                                         {"prompt": "p", "intermediates": ["q"], "readout": -2}]}))
    items = load_eval_set(ref)
    assert items[0]["readout"] == "last_newline" and items[1]["readout"] == -2
    assert items[0]["synonyms"] == "numbers_ops" and "target" not in items[0]



def test_decoy_items_take_another_items_words_absent_from_the_prompt(llama):
    items = [{"name": "a", "prompt": "x 2 + 3 then", "intermediates": ["5"], "target": "10"},
             {"name": "b", "prompt": "y 4 + 1 then", "intermediates": ["5"], "target": "15"},  # same word as a: skipped
             {"name": "c", "prompt": "z 2 * 3 then", "intermediates": ["6"], "target": "12"},
             {"name": "d", "prompt": "w 6 + 6 then", "intermediates": ["12"], "target": "6"}]
    decoys = decoy_items(items)
    assert [(d["name"], d["intermediates"], d["decoy_of"], d["index"]) for d in decoys] == [
        ("a", ["6"], "c", 0), ("b", ["6"], "c", 1), ("c", ["5"], "a", 2), ("d", ["5"], "a", 3)]
    assert all(d["prompt"] == items[d["index"]]["prompt"] and d["target"] == items[d["index"]]["target"] for d in decoys)
    # an item every other item's words are in (or its own): left out
    assert decoy_items([{"prompt": "one two", "intermediates": ["one"]}, {"prompt": "two one", "intermediates": ["two"]}]) == []
    # scored under the real items' indices (where an item without a decoy is left out), so results pair
    detail = pass_at_k_detail(llama, {"logit": LogitLens.for_model(llama)}, decoys[1:])
    assert sorted(set(detail["item"])) == [1, 2, 3]
    assert set(detail.loc[detail["role"] == "intermediate", "word"]) == {"6", "5"}
