"""The workspace experiments (docs/experiments.md) on a tiny model where the outcome is known.

The tiny llama of these tests copies its last token: every block's attention and MLP outputs are zeroed, and the
embedding and head rows of a set ``S`` of word tokens are the same orthonormal vectors (the other head rows are
zero). The residual at every layer is the last token's embedding, so the greedy next token is the last token, and
the identity lens reads each layer exactly as the model's output (the embedding of ' one' also leans on the other
words with known weights, which orders them after it). A coordinate swap ``A -> B`` of two tokens of
``S`` at the largest scale then makes ``B`` the top token for certain: ``B``'s coordinate ends above ``A``'s clean
one, the other tokens of ``S`` are orthogonal to the edit, and the rest score zero.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import make_tiny
from helpers import identity_lens

from jlens_core.experiments.core import (
    ExperimentResult,
    NoChatTemplateError,
    clean_read,
    clustered_bootstrap,
    edited_next_logits,
    parse_band,
    ranks_of,
    render_prompt,
    word_ids,
)
from jlens_core.experiments.formats import built_in_sets, detect_format, load_experiment_items
from jlens_core.experiments.run import run_experiment
from jlens_core.interventions.lens_edits import MAX_ALPHA, Swap
from jlens_core.reading.edit_hooks import EditRunner

WORDS = ["capital", "time", "one", "and", "cap", "The"]
PROSE = "The capital of France is Paris, and the capital of Italy is Rome; one time, one capital."


def copying_model():
    """The copying tiny llama (see the module docstring) and the ids of ``S``."""
    model = make_tiny("llama", seed=1)
    texts = model.tokenizer.convert_ids_to_tokens(list(range(model.vocab_size)))
    chosen = [next(iter(word_ids(model, w).values())) for w in WORDS]
    chosen += [i for i, t in enumerate(texts) if len(t) == 1 and t.isalpha() and i not in chosen]
    chosen = chosen[:model.d_model]
    basis, _ = torch.linalg.qr(torch.randn(model.d_model, model.d_model, generator=torch.Generator().manual_seed(0)))
    with torch.no_grad():
        for block in model.layers:
            block.self_attn.o_proj.weight.zero_()
            block.mlp.down_proj.weight.zero_()
        model.hf_model.lm_head.weight.zero_()
        model.hf_model.lm_head.weight[chosen] = basis[:len(chosen)] * 4
        model.embed.weight[chosen] = basis[:len(chosen)] * 4
        # ' one' also leans on the other words, in a known order: the verbal report's candidates get distinct ranks
        model.embed.weight[chosen[2]] += 4 * sum(w * basis[i] for i, w in ((0, 0.4), (1, 0.5), (3, 0.3), (4, 0.2),
                                                                           (5, 0.1)))
    return model, chosen


@pytest.fixture(scope="module")
def setup():
    model, _ = copying_model()
    return model, identity_lens(model)


def probe_items(model, lens) -> list[dict]:
    """Prompts ending on a word of ``S`` (so the model answers that word) and swaps to other words of ``S``."""
    items = []
    for i, word in enumerate(WORDS[:5]):
        swap_answer = WORDS[(i + 1) % 5]
        items.append({"name": f"p{i}", "category": "ab"[i % 2], "prompt": f"Numbers like 12 and {word}",
                      "intermediate": word, "answer": word, "swap_to": swap_answer, "swap_answer": swap_answer})
    return items


# -- formats ---------------------------------------------------------------------------------------------------
def test_built_in_sets_load_in_their_formats():
    sets = built_in_sets()
    for name in ("probe-swap", "verbal-report", "flexible-generalization"):
        found, data = load_experiment_items(sets[name])
        assert found == name and data
        assert detect_format(json.loads(sets[name].read_text())) == name


def test_a_file_in_no_format_names_the_closest_experiment_and_its_missing_fields(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"intro_prompt": [], "prefills": {}}))
    with pytest.raises(ValueError, match=r"closest to 'verbal-introspection', whose fields concepts it lacks"):
        load_experiment_items(path)
    path.write_text(json.dumps({"items": [{"name": "a", "prompt": "x"}]}))
    with pytest.raises(ValueError, match=r"entry 0 \('a'\) of 'items' lacks the probe-swap fields category, "
                                         r"intermediate, answer, swap_to, swap_answer"):
        load_experiment_items(path)
    with pytest.raises(ValueError, match="is not a verbal-report file: it lacks the fields candidates"):
        load_experiment_items(built_in_sets()["probe-swap"], "verbal-report")


def test_band_text_and_a_band_outside_the_lens(setup):
    model, lens = setup
    assert parse_band("1-2") == [1, 2] and parse_band("2") == [2] and parse_band(None) is None
    with pytest.raises(ValueError, match="runs backwards"):
        parse_band("3-1")
    with pytest.raises(ValueError, match="Layer 3 is outside the lens: it reads layers 0..2"):
        run_experiment(model, lens, "probe-swap", {"items": probe_items(model, lens)}, band="2-3", depth=False)


# -- the machinery ---------------------------------------------------------------------------------------------
def test_batched_rows_match_the_edit_runner_one_at_a_time():
    model = make_tiny("llama", seed=1)  # a model that computes: every block works
    lens = identity_lens(model)
    ids = model.encode("The capital of France is")
    rows = [[Swap(model, lens, "capital", "time", alpha, layers=[1, 2])] for alpha in (0.0, 1.0, 3.0)]
    batched = edited_next_logits(model, ids, rows, chunk=2)
    for row, got in zip(rows, batched):
        runner = EditRunner(model, row, int(ids.shape[1]))
        with torch.no_grad():
            want = runner.run(lambda: model.hf_model(input_ids=ids).logits[0, -1], torch.arange(ids.shape[1]),
                              clean_forward=lambda: model.hf_model(input_ids=ids))
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4)


def test_ranks_and_clustered_bootstrap_against_hand_counts():
    logits = torch.tensor([0.5, 3.0, 1.0, 3.0, -1.0])
    assert ranks_of(logits, [2]) == 3 and ranks_of(logits, [4, 0]) == 4 and ranks_of(logits, [1]) == 1
    # one category: every resample is the whole set, so the interval is the rate itself
    assert clustered_bootstrap(np.array([1, 0, 1, 1]), np.array(["a"] * 4)) == (0.75, 0.75)
    # two categories at rates 1 and 0 with equal sizes: resampled rates are 0, 0.5 or 1
    low, high = clustered_bootstrap(np.array([1, 1, 0, 0]), np.array(["a", "a", "b", "b"]), seed=1)
    assert low == 0.0 and high == 1.0


def test_turns_need_a_chat_template(setup):
    model, _ = setup
    text = render_prompt(model, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Answer:"}])
    assert text.endswith("assistant\nAnswer:")
    bare = make_tiny("llama", seed=1)
    bare.tokenizer.chat_template = None
    with pytest.raises(NoChatTemplateError, match="has no chat template, so the turns of verbal-report cannot be "
                                                  "rendered: use a chat"):
        run_experiment(bare, identity_lens(bare), "verbal-report", {"candidates": {"x": ["time"]}})


# -- experiment 1 ------------------------------------------------------------------------------------------------
def test_probe_swap_gate_unscored_ceiling_and_depth(setup):
    model, lens = setup
    items = probe_items(model, lens)
    wrong = dict(items[1], name="wrong", answer="capital")  # the model says ' time' there
    multi = dict(items[0], name="multi", swap_to="Parisian")  # not one token in the tiny vocabulary
    result = run_experiment(model, lens, "probe-swap", {"items": [*items, wrong, multi]}, band="1-2",
                            alpha=MAX_ALPHA, depth_step=1)
    gate = result.gate.set_index("item")
    assert gate.loc["wrong", "reason"] == "gated out: the model says ' time'" and not gate.loc["wrong", "passed"]
    assert gate.loc["multi", "reason"] == "unscored: not one token here: swap_to 'Parisian'"
    assert result.n_gated == len(items) and result.band.layers == (1, 2) and result.band.rule == "given"
    # the intermediate is the answer and swap_to the swap answer: the J-lens swap is the ceiling, certain here
    for arm in ("J-lens swap", "logit-lens swap", "answer swap"):
        assert result.rate(arm) == 1.0, arm
    assert result.summary.set_index("arm").loc["answer swap", "trials"] == len(items)
    # the null swaps the intermediate for another token: the swap answer's coordinate is untouched
    assert result.rate("unrelated swap") == 0.0
    depth = result.extras["depth"]
    assert set(depth["start"]) == {0, 1, 2} and (depth["rate"] == 1.0).all()
    assert result.extras["depth_onset"]["answer"] == result.extras["depth_onset"]["intermediate"] == 2.0


def test_probe_swap_at_zero_scale_is_the_clean_run(setup):
    model, lens = setup
    items = probe_items(model, lens)
    result = run_experiment(model, lens, "probe-swap", {"items": items}, band="1-2", alpha=0.0, depth=False,
                            probes=False)  # alpha scales the coordinate swaps; the probe split has its own test
    for item in items:
        clean = clean_read(model, lens, model.encode(item["prompt"]), []).greedy
        assert (result.trials[result.trials["item"] == item["name"]]["says"] == model.decode([clean])).all()
    assert result.summary["successes"].sum() == 0 and not result.notes


def test_an_empty_gate_is_one_sentence(setup):
    model, lens = setup
    items = [dict(item, answer="Q") for item in probe_items(model, lens)]
    with pytest.raises(ValueError, match=r"The model answers none of the 5 probe-swap items, so nothing can be "
                                         r"scored \(most often: gated out: the model says"):
        run_experiment(model, lens, "probe-swap", {"items": items}, band="1-2")


def test_derived_band_follows_the_study_rule(setup):
    model, lens = setup
    items = probe_items(model, lens)
    items[0]["intermediate"] = "Q"  # not read at the last position: 4 of 5 items read their intermediate
    result = run_experiment(model, lens, "probe-swap", {"items": items}, depth=False)
    assert result.band.curve == {0: 0.8, 1: 0.8, 2: 0.8}
    assert result.band.layers == (0, 1, 2) and "study's band rule" in result.band.rule


# -- experiment 2 ------------------------------------------------------------------------------------------------
def test_verbal_report_swaps_and_report_correlation(setup):
    model, lens = setup
    candidates = {"thing": ["time", "one", "and", "cap", "capital", "Parisian"], "other": ["The", "and", "one"]}
    result = run_experiment(model, lens, "verbal-report", {"candidates": candidates}, band="1-2",
                            alpha=MAX_ALPHA, prefill=" one", concepts=False)
    assert result.n_gated == 2 and set(result.gate["model_says"]) == {" one"}
    # the default gate keeps a category only when the model answers one of its candidates
    with pytest.raises(ValueError, match="most often: gated out: the model answers ' one', not one of the candidates"):
        run_experiment(model, lens, "verbal-report", {"candidates": {"thing": ["time", "and"]}}, band="1-2",
                       prefill=" one", concepts=False)
    assert list(result.extras["unscored_words"]["word"]) == ["Parisian"]
    j = result.trials[result.trials["arm"] == "J-lens swap"]
    assert sorted(j["target"]) == sorted(["time", "and", "cap", "capital", "The", "and"])  # the answer left out
    assert result.rate("J-lens swap") == 1.0 and result.rate("logit-lens swap") == 1.0
    # the identity lens reads every layer as the output: lens ranks are output ranks
    corr = result.extras["report_correlation"].set_index("layer")
    assert corr["spearman"].tolist() == pytest.approx([1.0, 1.0, 1.0])


# -- experiment 3 ------------------------------------------------------------------------------------------------
def flexible_data(args=("time", "one", "and", "capital")) -> dict:
    funcs = [{"name": name, "template": template, "answers": {a: a for a in args}}
             for name, template in (("f", "Numbers like {arg}"), ("g", "Once upon a {arg}"))]
    return {"categories": [{"name": "tiny", "args": list(args), "funcs": funcs}]}


def test_flexible_generalization_grid_and_broadcast(setup):
    model, lens = setup
    data = flexible_data()
    data["categories"][0]["funcs"][1]["answers"]["and"] = "Q"  # the model says ' and': this cell is gated out
    result = run_experiment(model, lens, "flexible-generalization", data, band="0-2", alpha=MAX_ALPHA)
    assert result.gate.set_index("item").loc["g(and)", "reason"] == "gated out: the model says ' and'"
    j = result.trials[result.trials["arm"] == "J-lens swap"]
    assert len(j) == 12 + 6 and result.rate("J-lens swap") == 1.0
    grid = result.extras["grids"]["tiny/g"].set_index("in prompt")
    assert grid.shape == (4, 4) and np.isnan(grid.loc["and"]).all() and np.isnan(grid["and"]).all()
    assert grid.loc["time", "one"] == 1.0
    rate = result.extras["broadcast_rate"]
    assert rate["swaps"] == 6 and rate["rate"] == 1.0  # the swaps between time, one, capital reach both functions


def test_flexible_generalization_at_zero_scale_redirects_nothing(setup):
    model, lens = setup
    result = run_experiment(model, lens, "flexible-generalization", flexible_data(), band="0-2", alpha=0.0)
    assert len(result.trials) and result.summary["successes"].sum() == 0
    assert result.extras["broadcast_rate"]["rate"] == 0.0


def test_result_saves_json_csv_and_a_page(setup, tmp_path):
    pytest.importorskip("plotly")
    model, lens = setup
    result = run_experiment(model, lens, "probe-swap", {"items": probe_items(model, lens)}, band="2", depth=False)
    assert isinstance(result, ExperimentResult)
    written = result.save(tmp_path, html=True)
    data = json.loads((tmp_path / "result.json").read_text())
    assert data["experiment"] == "probe-swap" and data["band"]["layers"] == [2]
    assert len(pd.read_csv(tmp_path / "trials.csv")) == len(result.trials)
    page = (tmp_path / "result.html").read_text()
    assert "<script" in page and "answer swap" in page and not math.isnan(result.rate("answer swap"))
    assert len(written) == 5 and len(result.figure().data) == 1  # the band was given: no curve panel


def test_cancel_stops_between_steps(setup):
    from jlens_core.experiments.core import ExperimentCancelled

    model, lens = setup
    seen = []
    with pytest.raises(ExperimentCancelled, match="stopped after 2 of"):
        run_experiment(model, lens, "probe-swap", {"items": probe_items(model, lens)}, band="2",
                       progress=lambda done, total: seen.append(done), stop=lambda: len(seen) >= 2)


def test_probe_split_arms_on_the_j_space(setup):
    model, lens = setup
    items = probe_items(model, lens)
    result = run_experiment(model, lens, "probe-swap", {"items": items}, band="2", depth=False)
    arms = set(result.trials["arm"])
    assert {"probe full", "probe J part", "probe non-J part", "probe non-J + J clamp", "probe random"} <= arms
    # one prompt per intermediate: the probe difference is the difference of the two last tokens' embeddings, so the
    # full probe swap turns the last residual into swap_to's embedding, which the model copies
    assert result.rate("probe full") == 1.0
    assert not result.notes


# -- experiment 6: the ablation battery --------------------------------------------------------------------------
def test_ablation_battery_tasks_clean_accuracy_and_zero_strength(setup):
    model, lens = setup
    result = run_experiment(model, lens, "ablation-battery", {"items": probe_items(model, lens)}, band="1-2",
                            strengths=(0.0, 1.0), n_texts=1, prose=[PROSE])
    trials = result.trials
    assert set(trials["task"]) == {"two-hop", "copying", "induction", "prose"}
    clean = trials[trials["arm"] == "clean"].set_index("item")
    assert (clean.loc[clean["task"] == "two-hop", "accuracy"] == 1.0).all()  # the gated items: the model answers
    # strength 0 is the identity: every ablation row equals the clean row of its item
    for arm in ("J-space ablation", "random ablation"):
        zero = trials[(trials["arm"] == arm) & (trials["strength"] == 0.0)].set_index("item")
        assert (zero["correct"] == clean.loc[zero.index, "correct"]).all()
    # the clean accuracy on the prose, counted from the model's own output (positions 1 .. seq-2 predict 2 .. seq-1)
    prose = clean[clean["task"] == "prose"].iloc[0]
    ids = model.encode(PROSE, max_length=32)
    with torch.no_grad():
        greedy = model.hf_model(input_ids=ids).logits[0].argmax(-1)
    assert prose["correct"] == int((greedy[1:-1] == ids[0, 2:]).sum()) and prose["positions"] == ids.shape[1] - 2
    table = result.extras["selective_damage"]
    assert {"task", "strength", "clean", "J-space ablation", "random ablation"} <= set(table.columns)


@pytest.mark.parametrize("magnitude", ["natural", "norm_matched"])
def test_cached_part_swaps_add_what_vector_swap_adds(setup, magnitude):
    from jlens_core.experiments.jspace_arms import SplitArms
    from jlens_core.interventions.jspace_edits import VectorSwap

    model, lens = setup
    gen = torch.Generator().manual_seed(5)
    vectors = {name: {layer: torch.randn(model.d_model, generator=gen) for layer in (1, 2)} for name in "ab"}
    arms = SplitArms(model, lens, vectors, [1, 2], 0, "concept", magnitude=magnitude, clamp=False)
    built = arms.arms_for("a", "b")
    for arm, part in (("concept J part", "j"), ("concept non-J part", "non_j")):
        direct = VectorSwap(model, lens, vectors["a"], vectors["b"], part=part, magnitude=magnitude, layers=[1, 2])
        for layer in (1, 2):
            torch.testing.assert_close(built[arm][0].deltas[layer], direct.deltas[layer], rtol=1e-5, atol=1e-5)


# -- experiment 4 ------------------------------------------------------------------------------------------------
def test_verbal_introspection_injects_on_the_user_turn_only(setup):
    from jlens_core.experiments.introspection import user_positions

    model, lens = setup
    data = {"intro_prompt": [{"role": "user", "content": "Do you notice one time?"}],
            "prefills": {"quote": "The word is \""},
            "concepts": [{"name": "capital", "surface": "capital"}, {"name": "long", "surface": "Parisian"}]}
    result = run_experiment(model, lens, "verbal-introspection", data, band="1-2", strengths=(0.0, 4.0))
    gate = result.gate.set_index("item")
    assert gate.loc["long · quote", "reason"] == "unscored: not one token here: surface 'Parisian'"
    text = gate.loc["capital · quote", "prompt"]
    positions = user_positions(model, text, "Do you notice one time?")
    pieces = model.tokenizer.convert_ids_to_tokens(model.encode(text)[0].tolist())
    assert "".join(pieces[i] for i in positions).replace("Ġ", " ") == "Do you notice one time?"
    # the copying model has no attention: what is added on the user turn never reaches the open quote
    clean = gate.loc["capital · quote", "clean_rank"]
    assert (result.trials["rank"] == clean).all() and len(result.trials) == 4
    by = result.extras["by_strength"]
    assert set(by["vector"]) == {"J-lens vector", "random direction"} and set(by["strength"]) == {0.0, 4.0}


# -- experiment 5 ------------------------------------------------------------------------------------------------
def test_directed_modulation_hits_over_the_carrier_span(setup):
    model, lens = setup
    data = {"phrasings": [{"name": "think", "group": "f", "text": "Think about {x}."},
                          {"name": "avoid", "group": "s", "text": "Do not think about {x}."},
                          {"name": "plain", "group": "c", "text": "Write {x} later."}],
            "group_kind": {"f": "focus", "s": "suppress", "c": "control"},
            "carrier_sentences": [" one time and", " cap and The"],
            "math_problems": [{"expr": "two plus two", "answer": "four", "tier": 1},
                              {"expr": "one", "answer": "one", "tier": 1}],
            "topic_categories": [{"name": "words", "members": ["time", "capital", "Parisian"]}]}
    result = run_experiment(model, lens, "directed-modulation", data, band="1-2")
    gate = result.gate.set_index("item")
    assert gate.loc["Parisian", "reason"] == "unscored: not one token here: target 'Parisian'"
    assert gate.loc["two plus two", "reason"].startswith("unscored") and gate.loc["one", "reason"].startswith("gated out")
    # the copying model's lens reads each carrier token as itself: ' time' is read in the first carrier only, and
    # ' capital' in neither (' one' leans on it, but below rank 1), whatever the instruction
    trials = result.trials
    assert set(trials["arm"]) == {"baseline", "focus", "suppress", "control"}
    hits = trials.groupby(["item", "carrier"])["top1"].agg(["min", "max"])
    assert hits.loc[("time", 0)].tolist() == [True, True] and hits.loc[("time", 1)].tolist() == [False, False]
    assert not hits.loc["capital"]["max"].any()
    assert (result.summary["rate"] == 0.25).all()


# -- experiment 6: selectivity -------------------------------------------------------------------------------------
def test_selectivity_label_hits_and_the_language_swap(setup):
    model, lens = setup
    # the questions are words of S only, so every question position is read as its own token
    data = {"task": {"name": "language", "explicit_q": " cap time", "automatic_q": " and cap"},
            "passages": [{"category": "timeish", "key": "p1", "text": "Numbers like 12"},
                         {"category": "oneish", "key": "p2", "text": "Once upon a"},
                         {"category": "longish", "key": "p3", "text": "Parisian"}],
            "intermediates": {"timeish": ["time"], "oneish": ["one"], "longish": ["Parisian"]},
            "authors": {"timeish": ["cap"]}}
    result = run_experiment(model, lens, "selectivity-language", data, band="1-2", prefill=" time",
                            automatic_prefill=" and")
    gate = result.gate.set_index("item")
    assert gate.loc["p3", "reason"] == "unscored: no label of 'longish' is one token here"
    # the copying model answers the prefill's ' time': it names p1's language, not p2's
    assert gate.loc["p1", "passed"] and gate.loc["p2", "reason"].startswith("gated out")
    rates = result.summary.set_index("arm")["rate"]
    # the explicit question holds ' time' (p1's label, read as itself), the automatic one no label
    assert rates["label hits · explicit"] == 0.5 and rates["label hits · automatic"] == 0.0
    assert result.extras["selectivity"]["explicit_minus_automatic"] == 0.5
    # the swap time -> one: the report follows (p1); the automatic reply copies ' and', which neither label's
    # coordinates touch, so it keeps (p1: time -> one; p2: one -> time)
    assert rates["J-lens swap · explicit: report follows"] == 1.0
    assert rates["J-lens swap · automatic: continuation keeps"] == 1.0
    assert result.summary.set_index("arm").loc["J-lens swap · automatic: continuation keeps", "trials"] == 2
