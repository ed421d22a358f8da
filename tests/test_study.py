"""Studies over item sets (docs/method.md §8.1) on a tiny model with a character tokenizer: every rank against
ranks computed by hand from HF's own hidden states, the first/last/best columns, the by-layer fractions and
Wilson intervals, the band rule, the capability filter, unscored concepts, one forward per item, the paired
comparison, the study file and the page."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import identity_lens, random_lens
from test_passk import char_model

from jlens_core import LogitLens
from jlens_core.evaluation.study import StudyCancelled, band_of, load_study, study, study_sets
from jlens_core.interventions.intervals import wilson_interval

K = 20  # of a 48-token vocabulary: some concepts enter, some do not
PROMPTS = ["a cat sat on the mat", "the cat is", "one cat, two", "cat and mat, so", "x = 3 + 4 =", "we go to the"]


@pytest.fixture(scope="module")
def model():
    return char_model()


def hand_ranks(model, prompt: str, token_id: int) -> np.ndarray:
    """``[n_layers, seq]`` ranks of ``token_id`` under the logit lens, from HF's hidden states (last = output)."""
    ids = model.encode(prompt)
    with torch.no_grad():
        out = model.hf_model(ids, output_hidden_states=True)
    rows = []
    for layer in range(model.n_layers):
        logits = (out.logits[0] if layer == model.n_layers - 1
                  else model.hf_model.lm_head(model.final_norm(out.hidden_states[layer + 1][0]))).float()
        rows.append(((logits > logits[:, token_id:token_id + 1]).sum(-1) + 1).numpy())
    return np.stack(rows)


def items_of(prompts=PROMPTS):
    return [{"name": f"p{i}", "prompt": p, "intermediates": ["cat", "dog"]} for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def lenses(model):
    return {"logit": LogitLens.for_model(model), "jacobian": random_lens(model, seed=1)}


@pytest.fixture(scope="module")
def result(model, lenses):
    return study(model, lenses, items_of(), k=K, all_positions=True, n_boot=200)


def test_ranks_first_last_best_against_hand_ranks(model, result):
    cat = model.tokenizer.convert_tokens_to_ids(" cat")
    table, items = result.table, result.items
    for i, prompt in enumerate(PROMPTS):
        ranks = hand_ranks(model, prompt, cat)  # [layers, seq]
        got = table[(table["item"] == i) & (table["lens"] == "logit") & (table["concept"] == "cat")]
        assert len(got) == ranks.size  # every layer x every position
        for row in got.itertuples():
            assert row.rank == ranks[row.layer, row.position]
        at_readout = ranks[:, -1]
        row = items[(items["item"] == i) & (items["lens"] == "logit") & (items["concept"] == "cat")].iloc[0]
        assert row["best_rank"] == at_readout.min() and row["best_layer"] == int(np.argmin(at_readout))
        assert row["final_rank"] == at_readout[-1] and row["position"] == len(model.encode(prompt)[0]) - 1
        inside = np.flatnonzero(at_readout <= K)
        if inside.size == 0:
            assert math.isnan(row["first_layer"]) and math.isnan(row["last_layer"])
        else:
            first, last = inside[0], inside[0]
            while last + 1 < len(at_readout) and at_readout[last + 1] <= K:
                last += 1
            assert (row["first_layer"], row["last_layer"]) == (first, last)
    assert result.items["first_layer"].notna().any() and result.items["first_layer"].isna().any()


def test_unscored_concepts_are_listed_not_scored(result):
    unscored = result.unscored()
    assert set(unscored["concept"]) == {"dog"} and len(unscored) == len(PROMPTS)  # "dog" is three tokens
    assert not (result.table["concept"] == "dog").any()
    assert (result.summary["unscored"] == len(PROMPTS)).all() and (result.summary["units"] == len(PROMPTS)).all()


def test_by_layer_fraction_interval_histogram_and_band(result):
    for lens in result.lenses:
        rows = result.items[(result.items["lens"] == lens) & result.items["scored"]]
        curve = result.curve("items", lens)
        sub = result.table[(result.table["lens"] == lens) & result.table["readout"]]
        for r in curve.itertuples():
            hits = int((sub[sub["layer"] == r.layer]["rank"] <= K).sum())
            assert (r.hits, r.units) == (hits, len(rows))
            assert (r.ci_low, r.ci_high) == pytest.approx(wilson_interval(hits, len(rows)))
            assert r.first_here == int((rows["first_layer"] == r.layer).sum())
            assert r.cumulative == pytest.approx(float((rows["first_layer"] <= r.layer).mean()))
        summary = result.summary.set_index("lens").loc[lens]
        assert summary["ever"] == pytest.approx(rows["first_layer"].notna().mean())
        band = band_of(curve["fraction"])
        if band is None:
            assert math.isnan(summary["onset"])
        else:
            assert (summary["onset"], summary["end"]) == (curve["layer"][band[0]], curve["layer"][band[1]])
            assert summary["onset_low"] <= summary["onset"] + 1e-9 or math.isnan(summary["onset_low"])


def test_band_rule():
    assert band_of([0, 0.1, 0.3, 0.6, 0.5, 0.2, 0.4]) == (2, 4)  # half of 0.6: from 0.3 on, until it drops
    assert band_of([0.8, 0.0, 0.8]) == (0, 0)
    assert band_of([0, 0, 0]) is None


def test_one_forward_per_item_for_every_lens(model, lenses):
    calls = []
    handle = model.layers[0].register_forward_hook(lambda *a: calls.append(1))  # the first layer runs once a forward
    try:
        out = study(model, {**lenses, "identity": identity_lens(model)}, items_of(), k=K, n_boot=50)
    finally:
        handle.remove()
    assert len(calls) == len(PROMPTS) == out.info["forwards"]
    assert set(out.items["lens"]) == {"logit", "jacobian", "identity"}


def test_capability_filter_keeps_answered_items(model, lenses):
    texts = model.tokenizer.convert_ids_to_tokens(list(range(len(model.tokenizer))))
    answered, wrong = [], []
    for prompt in PROMPTS:
        with torch.no_grad():
            greedy = int(model.hf_model(model.encode(prompt)).logits[0, -1].argmax())
        text = texts[greedy].replace("Ġ", " ").strip()
        if text.isalnum():
            answered.append({"prompt": prompt, "intermediates": ["cat"], "target": text})
            other = next(c for c in "qzxjv" if c != text)
            wrong.append({"prompt": prompt, "intermediates": ["cat"], "answer": other})
    assert answered, "no prompt whose greedy token is a letter or digit: pick others"
    out = study(model, lenses, {"mixed": answered + wrong}, k=K, n_boot=50)
    counts = out.info["sets"]["mixed"]
    assert (counts["kept"], counts["dropped"], counts["filter"]) == (len(answered), len(wrong), True)
    assert out.items[out.items["kept"]]["answered"].all() and not out.items[~out.items["kept"]]["answered"].any()
    assert (out.summary["units"] == len(answered)).all()
    off = study(model, lenses, {"mixed": answered + wrong}, k=K, answered_only=False, n_boot=50)
    assert (off.summary["units"] == len(answered) + len(wrong)).all()
    with pytest.raises(ValueError, match="No item is left after the capability filter.*no-filter"):
        study(model, lenses, wrong, k=K)
    both = study(model, lenses, {"good": answered, "bad": wrong}, k=K, n_boot=50)
    assert len(both.notes) == 1 and "'bad'" in both.notes[0]


def test_compare_is_paired_and_a_lens_ties_itself(model):
    logit = LogitLens.for_model(model)
    out = study(model, {"logit": logit, "same": identity_lens(model, layers=range(model.n_layers))}, items_of(),
                k=K, n_boot=200)
    row = out.compare("same", "logit").iloc[0]
    assert row["ever_diff"] == 0 and (row["ever_diff_low"], row["ever_diff_high"]) == (0, 0)
    if not math.isnan(row["onset"]):
        assert row["onset_diff"] == 0 and (row["onset_diff_low"], row["onset_diff_high"]) == (0, 0)
        assert row["verdict"] == "tie"
    with pytest.raises(ValueError, match="no lens 'nope'"):
        out.compare("nope", "logit")


def test_study_file_round_trip_and_page(result, tmp_path):
    path = result.save(tmp_path / "s.study.json")
    back = load_study(path)
    pd.testing.assert_frame_equal(back.table, result.table)
    pd.testing.assert_frame_equal(back.items, result.items)
    pd.testing.assert_frame_equal(back.summary, result.summary)
    pd.testing.assert_frame_equal(back.by_layer, result.by_layer)
    page = result.to_html(tmp_path / "s.html")
    assert (tmp_path / "s.html").read_text(encoding="utf-8") == page
    assert "plotly-packed" in page and "<h3>items</h3>" in page and "dog" in page
    names = page.split('<script id="study-names" type="application/json">')[1].split("</script>")[0]
    assert json.loads(names) == ["items"]  # what the page's script parses (script text is not HTML-decoded)
    assert "<table" in result._repr_html_() and "onset" in result._repr_html_()
    (tmp_path / "bad.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a study file"):
        load_study(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="No study file"):
        load_study(tmp_path / "missing.json")


def test_figure_has_a_line_per_lens_and_the_band(result):
    fig = result.figure()
    names = [t.name for t in fig.data if t.showlegend is not False]
    assert names == ["Logit lens", "Jacobian lens"]
    bands = [result.band("items", lens) for lens in result.lenses]
    assert len([s for s in fig.layout.shapes if s.type == "rect"]) == 2 * sum(b is not None for b in bands)


def test_stop_and_bad_input(model, lenses):
    with pytest.raises(StudyCancelled):
        study(model, lenses, items_of(), k=K, stop=lambda: True)
    with pytest.raises(ValueError, match="k=0"):
        study(model, lenses, items_of(), k=0)
    with pytest.raises(ValueError, match="role='x'"):
        study(model, lenses, items_of(), role="x")
    with pytest.raises(FileNotFoundError, match="No evaluation set"):
        study_sets("no_such_set")
    assert list(study_sets("two_hop")) == ["two_hop"] and len(study_sets("two_hop")["two_hop"]) == 28


def test_roles_choose_the_concepts(model, lenses):
    items = [{"prompt": p, "intermediates": ["cat"], "target": "7"} for p in PROMPTS[:3]]
    both = study(model, lenses, items, k=K, role="both", answered_only=False, n_boot=20)
    assert set(zip(both.items["role"], both.items["concept"])) == {("intermediate", "cat"), ("target", "7")}
    target = study(model, lenses, items, k=K, role="target", answered_only=False, n_boot=20)
    assert set(target.table["concept"]) == {"7"}
    seven = model.tokenizer.convert_tokens_to_ids("7")
    for i, prompt in enumerate(PROMPTS[:3]):  # the target's ranks, by hand, at the readout position
        ranks = hand_ranks(model, prompt, seven)[:, -1]
        got = target.table[(target.table["item"] == i) & (target.table["lens"] == "logit")].sort_values("layer")
        assert got["rank"].tolist() == ranks.tolist()
