"""The readout protocol as one value (jlens_core.reading.readout_protocol.Readout, issue #48 §5): reading, pass@k
and the study take a Readout, and the older keywords give the same results one by one."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from helpers import random_lens, tiny

from jlens_core import pass_at_k, read_prompt, study
from jlens_core.reading.readout_protocol import Readout

PROMPTS = ["The cat sat on the mat and the dog ran", "A dog and a cat play in the garden today"]


def items() -> list[dict]:
    return [{"name": f"p{i}", "prompt": p, "intermediates": ["cat", "dog"], "readout": -2} for i, p in enumerate(PROMPTS)]


def test_a_reading_with_a_readout_is_the_reading_with_its_keywords():
    model, lens = tiny(), random_lens(tiny(), seed=2)
    by_value = read_prompt(model, lens, PROMPTS[0], Readout(k=3, vocab="word"))
    by_keywords = read_prompt(model, lens, PROMPTS[0], top_k=3, vocab="word")
    default = read_prompt(model, lens, PROMPTS[0])
    assert by_value.top_ids.shape[-1] == 3 and default.top_ids.shape[-1] == 10
    np.testing.assert_array_equal(by_value.top_ids, by_keywords.top_ids)
    np.testing.assert_array_equal(by_value.top_probs, by_keywords.top_probs)
    assert not np.array_equal(by_value.top_ids, default.top_ids[..., :3])  # the word readout changes the top-3
    # a keyword wins over the readout's field
    np.testing.assert_array_equal(read_prompt(model, lens, PROMPTS[0], Readout(k=5), top_k=3).top_ids,
                                  read_prompt(model, lens, PROMPTS[0], top_k=3).top_ids)
    with pytest.raises(TypeError, match="unexpected keyword argument 'topk'"):
        read_prompt(model, lens, PROMPTS[0], topk=3)


def test_pass_at_k_and_the_study_take_a_readout():
    model, lens = tiny(), {"J": random_lens(tiny(), seed=3)}
    protocol = Readout(position="last", spelling="first_token", vocab="word", k=(1, 5))
    by_value = pass_at_k(model, lens, items(), protocol, n_boot=20)
    by_keywords = pass_at_k(model, lens, items(), readout="last", spelling="first_token", vocab="word", k=(1, 5),
                            n_boot=20)
    pd.testing.assert_frame_equal(by_value, by_keywords)
    assert list(by_value["k"]) == [1, 5] and set(by_value["vocab"]) == {"word"}
    # the readout's position overrides the items' own rule (-2): the detail's positions say so
    _, detail = pass_at_k(model, lens, items(), protocol, n_boot=20, return_detail=True)
    _, own = pass_at_k(model, lens, items(), Readout(spelling="first_token"), n_boot=20, return_detail=True)
    assert (detail["position"] == own["position"] + 1).all()
    one = study(model, lens, items(), Readout(position="last", vocab="word", k=5), n_boot=20, answered_only=False)
    other = study(model, lens, items(), readout="last", vocab="word", k=5, n_boot=20, answered_only=False)
    pd.testing.assert_frame_equal(one.table, other.table)
    assert one.info["k"] == 5 and one.info["vocab"] == "word" and one.info["readout"] == "last"
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        study(model, lens, items(), n_bootstrap=3)


def test_pass_at_k_over_sets_is_each_set_and_their_macro_mean():
    """``pass_at_k_sets`` (jlens eval, the app): per set the set's own pass@k with ``set`` first, then the macro
    mean of the sets; the details carry their set; progress starts each set at 0 and ends it at its size."""
    from jlens_core.evaluation.passk import macro_mean, pass_at_k_sets

    model, lens = tiny(), {"J": random_lens(tiny(), seed=3)}
    sets = [("a", items()), ("b", items()[:1])]
    calls: list[tuple[str, int, int]] = []
    summary, detail = pass_at_k_sets(model, lens, sets, progress=lambda *c: calls.append(c), k=(1, 5), n_boot=20)
    parts = []
    for name, its in sets:
        part = pass_at_k(model, lens, its, k=(1, 5), n_boot=20)
        part.insert(0, "set", name)
        parts.append(part)
    expected = pd.concat(parts, ignore_index=True)
    expected = pd.concat([expected, macro_mean(expected)], ignore_index=True)
    pd.testing.assert_frame_equal(summary, expected)
    assert list(summary.columns[:1]) == ["set"] and summary["set"].iloc[-1] == "macro mean"
    assert detail.groupby("set").size().to_dict() == {"a": 4, "b": 2}  # items x words x lenses
    assert calls == [("a", 0, 2), ("a", 1, 2), ("a", 2, 2), ("b", 0, 1), ("b", 1, 1)]
    with pytest.raises(ValueError, match="No evaluation sets"):
        pass_at_k_sets(model, lens, [])
