"""Lenses compared under one protocol (jlens_core/evaluation/lens_comparison.py): macro pass@k against the
per-set summaries of jlens_core/evaluation/passk.py, paired intervals, held-out items and bad input."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from jlens_core.evaluation.lens_comparison import gap_comparison, heldout_items, macro_comparison
from jlens_core.evaluation.passk import load_eval_set, macro_mean, summarize_pass_at_k


def synthetic_detail(seed: int = 0, lenses=("jacobian", "logit", "relevance"), vocab: str = "all") -> pd.DataFrame:
    """Per-word rows of three sets: items with one to three intermediates, random ranks, a few copied."""
    rng = np.random.default_rng(seed)
    rows = []
    for set_name, n_items in (("a", 12), ("b", 7), ("c", 20)):
        for item in range(n_items):
            for word in range(int(rng.integers(1, 4))):
                copied = bool(rng.random() < 0.1)
                for lens in lenses:
                    rows.append({"set": set_name, "item": item, "lens": lens, "vocab": vocab, "role": "intermediate",
                                 "word": f"w{word}", "scored": True, "copied": copied,
                                 "best_rank": int(rng.integers(1, 30))})
                rows.append({"set": set_name, "item": item, "lens": lenses[0], "vocab": vocab, "role": "target",
                             "word": "t", "scored": True, "copied": False, "best_rank": 1})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("exclude_copied", [False, True])
def test_macro_equals_the_mean_of_per_set_pass_at_k(exclude_copied):
    detail = synthetic_detail()
    table = macro_comparison(detail, (1, 10), exclude_copied=exclude_copied, n_boot=200)
    per_set = pd.concat([summarize_pass_at_k(part, (1, 10), n_boot=1, exclude_copied=exclude_copied).assign(set=name)
                         for name, part in detail.groupby("set")], ignore_index=True)
    expected = macro_mean(per_set).set_index(["lens", "k"])["pass_rate"]
    for row in table.itertuples():
        assert row.macro == pytest.approx(expected[(row.lens, row.k)])
        assert row.ci_low <= row.macro <= row.ci_high
    copied = detail[(detail["role"] == "intermediate") & detail["copied"] & (detail["lens"] == "jacobian")]
    words = table[(table["lens"] == "jacobian") & (table["k"] == 1)]["words_scored"].iloc[0]
    n_words = int(((detail["role"] == "intermediate") & (detail["lens"] == "jacobian")).sum())
    assert words == n_words - (len(copied) if exclude_copied else 0)


def test_intervals_are_paired_a_single_flipped_item_is_a_tie_with_a_narrow_difference():
    detail = synthetic_detail(lenses=("jacobian",))
    twin = detail[detail["role"] == "intermediate"].assign(lens="twin")
    flip = twin.index[(twin["set"] == "a") & (twin["item"] == 0)]
    twin.loc[flip, "best_rank"] = 1  # one item always found by the twin
    table = macro_comparison(pd.concat([detail, twin]), 10, n_boot=500).set_index("lens")
    base, other = table.loc["jacobian"], table.loc["twin"]
    assert base["verdict"] == "baseline" and base["diff"] == 0 and base["ratio"] == 1
    assert other["diff"] >= 0 and other["verdict"] == "tie"
    # the pairing: the difference's interval is far narrower than either lens's own interval
    assert other["diff_high"] - other["diff_low"] < 0.5 * (base["ci_high"] - base["ci_low"])
    assert other["diff_low"] >= 0  # the twin is never worse on any resample


def test_a_lens_that_finds_every_word_wins_and_one_that_finds_none_loses():
    detail = synthetic_detail(lenses=("jacobian",))
    inter = detail[detail["role"] == "intermediate"]
    best = inter.assign(lens="oracle", best_rank=1)
    worst = inter.assign(lens="blind", best_rank=10_000)
    table = macro_comparison(pd.concat([detail, best, worst]), 5, n_boot=300).set_index("lens")
    assert table.loc["oracle", "macro"] == 1.0 and table.loc["oracle", "verdict"] == "win"
    assert table.loc["blind", "macro"] == 0.0 and table.loc["blind", "verdict"] == "loss"
    assert table.loc["oracle", "ratio"] == pytest.approx(1 / table.loc["jacobian", "macro"])


def test_readouts_are_separate_variants_and_the_baseline_can_be_one():
    detail = pd.concat([synthetic_detail(vocab="all"), synthetic_detail(seed=1, vocab="word")])
    table = macro_comparison(detail, 10, baseline=("jacobian", "word"), n_boot=100)
    assert len(table) == 6 and set(table["vocab"]) == {"all", "word"}
    base = table[table["verdict"] == "baseline"]
    assert list(zip(base["lens"], base["vocab"])) == [("jacobian", "word")]


def test_keep_restricts_to_the_items_given():
    detail = synthetic_detail()
    keep = {("a", i) for i in range(5)} | {("c", 3)}
    table = macro_comparison(detail, 10, keep=keep, n_boot=100)
    assert set(table["n_sets"]) == {2} and set(table["items_scored"]) == {6}
    only = detail[[(s, i) in keep for s, i in zip(detail["set"], detail["item"])]]
    assert table["macro"].tolist() == macro_comparison(only, 10, n_boot=100)["macro"].tolist()


def test_heldout_items_match_the_weight_split():
    from jlens_core.fitting.expert_weights import heldout_score

    held = heldout_items(["two_hop", "typos"], 0.5, seed=3)
    for name in ("two_hop", "typos"):
        items = load_eval_set(name)
        expected = {(name, i) for i, item in enumerate(items) if heldout_score(str(item["prompt"]), 3) < 0.5}
        assert {pair for pair in held if pair[0] == name} == expected
        assert 0 < len(expected) < len(items)


def test_bad_input_is_one_sentence():
    detail = synthetic_detail()
    with pytest.raises(ValueError, match="baseline 'tuned' .* is not in the detail table, which holds"):
        macro_comparison(detail, 10, baseline="tuned")
    with pytest.raises(ValueError, match=r"k=\[0\] must be"):
        macro_comparison(detail, [0])
    with pytest.raises(ValueError, match="lacks columns \\['best_rank'\\]"):
        macro_comparison(detail.drop(columns="best_rank"), 10)
    with pytest.raises(ValueError, match="No scored intermediate is left"):
        macro_comparison(detail, 10, keep=set())
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        heldout_items(["two_hop"], 1.0)


def decoy_detail(detail: pd.DataFrame, seed: int = 7) -> pd.DataFrame:
    """The decoy run of ``detail``: the same items and lenses, other ranks."""
    rng = np.random.default_rng(seed)
    return detail.assign(best_rank=rng.integers(1, 30, size=len(detail)))


def test_gap_is_real_minus_decoy_macro_and_its_difference_is_against_the_baseline_gap():
    real = synthetic_detail()
    decoy = decoy_detail(real)
    table = gap_comparison(real, decoy, 10, n_boot=300).set_index("lens")
    real_macro = macro_comparison(real, 10, n_boot=1).set_index("lens")["macro"]
    decoy_macro = macro_comparison(decoy, 10, n_boot=1).set_index("lens")["macro"]
    for lens in ("jacobian", "logit", "relevance"):
        row = table.loc[lens]
        assert row["real"] == pytest.approx(real_macro[lens]) and row["decoy"] == pytest.approx(decoy_macro[lens])
        # every item has both scores, so the macro of item gaps is the difference of the macros
        assert row["gap"] == pytest.approx(real_macro[lens] - decoy_macro[lens])
        assert row["gap_low"] <= row["gap"] <= row["gap_high"]
        expected = (real_macro[lens] - decoy_macro[lens]) - (real_macro["jacobian"] - decoy_macro["jacobian"])
        assert row["gap_diff"] == pytest.approx(expected)
        assert row["items_scored"] == 39
    base = table.loc["jacobian"]
    assert base["verdict"] == "baseline" and base["gap_diff"] == 0 == base["gap_diff_low"] == base["gap_diff_high"]


def test_a_lens_that_reads_the_step_wins_on_the_gap_one_that_favours_a_kind_of_word_does_not():
    real = synthetic_detail(lenses=("jacobian",))
    decoy = decoy_detail(real)
    inter = real[real["role"] == "intermediate"]
    reads = inter.assign(lens="reads", best_rank=1)  # finds the item's own words, not another item's
    kind = inter.assign(lens="kind", best_rank=1)  # finds every word of the kind, its own or not
    table = gap_comparison(pd.concat([real, reads, kind]),
                           pd.concat([decoy, reads.assign(best_rank=10_000), kind]), 10, n_boot=300).set_index("lens")
    assert table.loc["reads", "gap"] == 1.0 and table.loc["reads", "verdict"] == "win"
    assert table.loc["kind", "real"] == 1.0 and table.loc["kind", "gap"] == 0.0
    assert table.loc["kind", "gap_low"] == table.loc["kind", "gap_high"] == 0.0  # no item gap to resample


def test_gap_comparison_refuses_bad_input_in_one_sentence():
    real = synthetic_detail()
    decoy = decoy_detail(real)
    with pytest.raises(ValueError, match="baseline 'jacobian' must be in both the real and the decoy table"):
        gap_comparison(real, decoy[decoy["lens"] != "jacobian"], 10)
    with pytest.raises(ValueError, match="k=0 must be"):
        gap_comparison(real, decoy, 0)
    with pytest.raises(ValueError, match="decoy table lacks columns \\['scored'\\]"):
        gap_comparison(real, decoy.drop(columns="scored"), 10)
    with pytest.raises(ValueError, match="No scored intermediate is left"):
        gap_comparison(real, decoy, 10, keep=set())
