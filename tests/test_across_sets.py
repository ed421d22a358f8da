"""scripts/expert_weights_across_sets.py: every set read by weights learned without it (the grouping), and
bad input refused in one sentence."""
from __future__ import annotations

import pytest
from helpers import load_script


@pytest.fixture(scope="module")
def across_sets():
    return load_script("scripts/expert_weights_across_sets.py")


def test_groups_are_sorted_sets_dealt_round_robin_each_set_once(across_sets):
    from jlens_core.evaluation.passk import shipped_sets

    sets = sorted(shipped_sets(), reverse=True)
    groups = across_sets.deal(sets, 3)
    assert groups[0] == ["antonym_chain", "couplets", "translation_pivot"]  # the groups results.md reports
    assert sorted(s for g in groups for s in g) == sorted(sets) and all(groups)
    assert across_sets.deal(["c", "a", "b", "d"], 2) == [["a", "c"], ["b", "d"]]


@pytest.mark.parametrize("folds", [1, 10])
def test_a_fold_count_without_other_sets_or_with_empty_groups_is_refused(across_sets, folds):
    with pytest.raises(ValueError, match=f"--folds {folds} must lie between 2 and the 9 sets"):
        across_sets.deal([f"s{i}" for i in range(9)], folds)
