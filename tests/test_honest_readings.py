"""Honest readings (docs/method.md §8, §9.1): intermediates the prompt already holds (``copied``,
``exclude_copied``) and positions a lens was never fitted at (``fitted``), in the library and the CLI."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import identity_lens
from test_word_readout import char_model

from jlens_core import LogitLens, TunedLens, load_model, pass_at_k, read_prompt, read_prompts
from jlens_core.cli.main import main
from jlens_core.evaluation.passk import appears_in_prompt, pass_at_k_detail, summarize_pass_at_k


@pytest.mark.parametrize(("prompt", "word", "synonyms", "expected"), [
    ("The capital of France is", "France", None, True),
    ("The capital of FRANCE is", " france", None, True),  # case and surrounding whitespace ignored
    ("A Parisian cafe", "Paris", None, False),  # not a whole word
    ("in Paris.", "Paris", None, True),
    ("3+4 =", "+", None, True),  # a symbol needs no word boundary
    ("3 plus 4", "+", None, False),
    ("3 plus 4", "+", "numbers_ops", True),  # a synonym in the prompt counts
    ("seven apples", "7", "numbers_ops", True),
    ("seventy apples", "seven", None, False),
])
def test_appears_in_prompt(prompt, word, synonyms, expected):
    assert appears_in_prompt(prompt, word, synonyms=synonyms) is expected


@pytest.fixture(scope="module")
def chars():
    return char_model("abcdefghij .,+*=!?0123456789")


ITEMS = [
    {"prompt": "a b c dd e", "intermediates": ["a", "C", "d", "f"]},  # a, C copied; d only inside "dd"
    {"prompt": "f g h", "intermediates": ["f", "g"]},  # every intermediate copied
    {"prompt": "i j", "intermediates": ["a", "b"], "target": "i"},  # none copied (the target is not counted)
]
COPIED = {(0, "a"), (0, "C"), (1, "f"), (1, "g")}


def independent_summary(detail: pd.DataFrame, k: int, *, exclude: bool) -> dict:
    """pass@k of one lens from the detail's ranks, by the definition, with the copied words known here."""
    rows = detail[detail["role"] == "intermediate"]
    scored = rows[rows["scored"]]
    copied = [(int(i), w) in COPIED for i, w in zip(scored["item"], scored["word"])]
    kept = scored[[not c for c in copied]] if exclude else scored
    per_item = [float(np.mean(part["best_rank"] <= k)) for _, part in kept.groupby("item")]
    return {"pass_rate": float(np.mean(per_item)) if per_item else float("nan"), "items_scored": len(per_item),
            "words_scored": len(kept), "copied": int(sum(copied)), "n_words": len(rows)}


def test_copied_count_and_exclusion_update_the_coverage(chars):
    lens = {"logit": LogitLens.for_model(chars)}
    detail = pass_at_k_detail(chars, lens, ITEMS)
    inter = detail[detail["role"] == "intermediate"]
    assert {(int(i), w) for i, w, c in zip(inter["item"], inter["word"], inter["copied"]) if c} == COPIED
    assert detail["scored"].all()
    for exclude in (False, True):
        summary = summarize_pass_at_k(detail, (1, 5), exclude_copied=exclude)
        for _, row in summary.iterrows():
            expected = independent_summary(detail, int(row["k"]), exclude=exclude)
            assert row["pass_rate"] == pytest.approx(expected["pass_rate"], nan_ok=True)
            for column in ("items_scored", "words_scored", "copied", "n_words"):
                assert row[column] == expected[column], column
            assert bool(row["copied_excluded"]) == exclude
    excluded = pass_at_k(chars, lens, ITEMS, k=1, exclude_copied=True)
    assert excluded["items_scored"].iloc[0] == 2 and excluded["words_scored"].iloc[0] == 4  # item 1 drops out
    assert excluded["copied"].iloc[0] == 4


def test_fitted_marks_positions_before_skip_first(llama):
    text = "The capital of France is Paris. Water boils"
    n = int(llama.encode(text).shape[1])
    jacobian = identity_lens(llama, settings={"skip_first": 3})
    tuned = TunedLens.zeros(llama, settings={"skip_first": 5})
    unfitted_file = identity_lens(llama)  # a lens with no skip_first in its settings
    readings = read_prompts(llama, {"logit": LogitLens.for_model(llama), "jacobian": jacobian, "tuned": tuned,
                                    "other": unfitted_file}, text)
    positions = np.arange(n)
    assert readings["logit"].fitted.all() and readings["logit"].skip_first == 0
    assert readings["other"].fitted.all()
    assert np.array_equal(readings["jacobian"].fitted, positions >= 3)
    assert np.array_equal(readings["tuned"].fitted, positions >= 5) and readings["tuned"].skip_first == 5
    frame = readings["jacobian"].frame
    assert frame["fitted"].dtype == bool
    assert (frame["fitted"] == (frame["position"] >= 3)).all()
    cell = readings["jacobian"].cell(readings["jacobian"].layers[0], 2)
    assert cell["fitted"] is False
    alone = read_prompt(llama, jacobian, text, positions=[1, 4])
    assert alone.fitted.tolist() == [False, True]


@pytest.fixture(scope="module")
def cli_work(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("honest-cli")
    model = load_model(tiny_dir, device="cpu")
    lens_path = identity_lens(model, settings={"skip_first": 4}).save(root / "lens.safetensors")
    items = [{"prompt": "The capital of France is", "intermediates": ["France", "Paris"]},
             {"prompt": "Water boils at one", "intermediates": ["hundred", "water", "."]}]
    set_path = root / "set.json"
    set_path.write_text(json.dumps({"items": items}))
    return {"root": root, "model": model, "lens_path": lens_path, "set": set_path, "items": items}


def test_cli_eval_vocab_and_exclude_copied(tiny_dir, cli_work, capsys):
    out = cli_work["root"] / "eval"
    code = main(["eval", "--model", tiny_dir, "--lens", "logit", "--n-texts", "0", "--pass-at-k",
                 str(cli_work["set"]), "--vocab", "word", "--exclude-copied", "--k", "1", "5", "--out", str(out),
                 "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "vocab=word" in printed and "copied intermediates excluded" in printed
    table = pd.read_csv(out / "pass_at_k.csv")
    assert (table["vocab"] == "word").all() and table["copied_excluded"].all()
    model = cli_work["model"]
    expected = pass_at_k(model, {"logit": LogitLens.for_model(model)}, cli_work["items"], k=(1, 5), vocab="word",
                         exclude_copied=True)
    for column in ("pass_rate", "words_scored", "items_scored", "copied"):
        assert np.allclose(table[column].to_numpy(float), expected[column].to_numpy(float), equal_nan=True)
    detail = pd.read_csv(out / "pass_at_k_detail.csv")
    assert set(detail["vocab"]) == {"word"} and detail["copied"].astype(bool).any()


def test_cli_inspect_marks_unfitted_positions(tiny_dir, cli_work, capsys):
    code = main(["inspect", "--model", tiny_dir, "--lens", str(cli_work["lens_path"]), "--prompt",
                 "The capital of France is Paris", "--vocab", "word"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "vocab=word" in printed and "skip_first=4" in printed
    assert "(unfit)" in printed


def test_word_readout_leaves_distributions_alone_on_the_unfitted_positions_too(llama):
    """vocab and fitted are independent: a word reading of a lens with skip_first marks the same positions."""
    jacobian = identity_lens(llama, settings={"skip_first": 2})
    text = "Once upon a time there was"
    word = read_prompt(llama, jacobian, text, vocab="word")
    full = read_prompt(llama, jacobian, text)
    assert np.array_equal(word.fitted, full.fitted)
    assert torch.allclose(torch.as_tensor(word.kl_bits), torch.as_tensor(full.kl_bits))
