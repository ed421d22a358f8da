"""A trial's edit as URL keys (jlens_core.experiments.links): the link built from a trial reads back to the same
swap, and that swap, run again, gives the trial's own rank; bad URL values are one sentence each. Arms a URL cannot
describe keep their edits in the result (``trial_edits``), which replay to the trial's own rank, and a server holds
them under a token (HeldTrials)."""

from __future__ import annotations

import pytest
from helpers import identity_lens
from test_experiments import copying_model, flexible_data, probe_items

from jlens_core.experiments.core import edited_next_logits, ranks_of, word_ids
from jlens_core.experiments.links import (
    EDIT_KEYS,
    HeldRef,
    HeldTrials,
    TrialEdit,
    edit_request,
    held_label,
    trial_edit,
)
from jlens_core.experiments.run import run_experiment
from jlens_core.interventions.lens_edits import MAX_ALPHA
from jlens_core.lenses.lens import LogitLens


@pytest.fixture(scope="module")
def setup():
    model, _ = copying_model()
    return model, identity_lens(model)


def _prompt_of(result, trial) -> str:
    """The prompt a trial ran on: its own (a task's prompt), else its item's in the gate."""
    own = trial.get("prompt")
    return own if isinstance(own, str) else result.gate[result.gate["item"] == trial["item"]]["prompt"].iloc[0]


def _replayed_rank(model, lens, result, trial, target_ids) -> tuple[TrialEdit, int]:
    edit = trial_edit(model, result, trial)
    assert edit is not None
    back = TrialEdit.from_query(edit.query())
    assert back == edit and set(edit.query()) == set(EDIT_KEYS) - {"edit_trial"}
    along = LogitLens.for_model(model) if back.lens == "logit" else lens
    swaps = back.build(model, along)
    logits = edited_next_logits(model, model.encode(_prompt_of(result, trial)), [swaps])
    return back, ranks_of(logits[0], target_ids)


def test_probe_swap_links_round_trip_to_the_trials_swap(setup):
    model, lens = setup
    # a scale below the maximum, so that the arms' ranks differ and a wrong edit would show
    result = run_experiment(model, lens, "probe-swap", {"items": probe_items(model, lens)}, band="1-2", alpha=0.75,
                            depth=False, probes=False)
    seen = set()
    for trial in result.trials.to_dict("records"):
        if trial["arm"] == "random directions":
            assert trial_edit(model, result, trial) is None
            continue
        target = word_ids(model, trial["target"]).values()
        back, rank = _replayed_rank(model, lens, result, trial, target)
        # below the top two the tokens score ~1e-6 here (float noise, reordered by a batch of another size)
        assert rank == trial["rank"] if trial["rank"] <= 2 else rank > 2, (trial["arm"], trial["item"])
        if trial["arm"] == "unrelated swap":
            assert back.build(model, lens)[0].replacement_id == trial["null_id"]
        assert back.layers == (1, 2) and back.alpha == 0.75
        assert back.lens == ("logit" if trial["arm"] == "logit-lens swap" else str(lens.kind))
        seen.add(trial["arm"])
    assert (result.trials["rank"] == 1).sum() == 3 * len(result.gate)  # J-lens, logit-lens, answer swap: exact
    assert seen == {"J-lens swap", "logit-lens swap", "unrelated swap", "answer swap"}


def test_flexible_and_verbal_report_links_round_trip(setup):
    model, lens = setup
    result = run_experiment(model, lens, "flexible-generalization", flexible_data(), band="0-2", alpha=MAX_ALPHA)
    trial = result.trials[result.trials["arm"] == "J-lens swap"].iloc[0].to_dict()
    back, rank = _replayed_rank(model, lens, result, trial, word_ids(model, trial["target"]).values())
    assert rank == trial["rank"] == 1 and back.source.strip() == trial["source"]
    report = run_experiment(model, lens, "verbal-report", {"candidates": {"thing": ["time", "one", "and"]}},
                            band="1-2", alpha=MAX_ALPHA, prefill=" one", concepts=False)
    trial = report.trials[report.trials["arm"] == "logit-lens swap"].iloc[0].to_dict()
    back, rank = _replayed_rank(model, lens, report, trial, word_ids(model, trial["target"]).values())
    assert rank == trial["rank"] and back.source == " one" and back.lens == "logit"


def test_the_selectivity_language_swap_links_replay_its_task(setup):
    model, lens = setup
    data = {"task": {"name": "language", "explicit_q": " cap time", "automatic_q": " and cap"},
            "passages": [{"category": "timeish", "key": "p1", "text": "Numbers like 12"},
                         {"category": "oneish", "key": "p2", "text": "Once upon a"}],
            "intermediates": {"timeish": ["time"], "oneish": ["one"]}, "authors": {}}
    result = run_experiment(model, lens, "selectivity-language", data, band="1-2", prefill=" time",
                            automatic_prefill=" and")
    swaps = result.trials[result.trials["arm"].str.startswith("J-lens swap")]
    explicit = swaps[swaps["task"] == "explicit"].iloc[0].to_dict()
    back, rank = _replayed_rank(model, lens, result, explicit, word_ids(model, explicit["target"]).values())
    assert rank == explicit["rank"] == 1 and back.source.strip() == "time" and back.replacement.strip() == "one"
    automatic = swaps[swaps["task"] == "automatic"].iloc[0].to_dict()
    assert automatic["prompt"] != explicit["prompt"]  # each task's link opens its own prompt
    assert trial_edit(model, result, automatic) is not None
    randoms = result.trials[result.trials["arm"].str.startswith("random directions")]
    assert all(trial_edit(model, result, t) is None for t in randoms.to_dict("records"))


@pytest.mark.parametrize(("query", "message"), [
    ({"edit": "steer", "edit_a": "a", "edit_b": "b", "edit_layers": "1-2"}, "not one Inspect can apply"),
    ({"edit": "swap", "edit_b": "b", "edit_layers": "1-2"}, "edit_a is missing"),
    ({"edit": "swap", "edit_a": "a" * 500, "edit_b": "b", "edit_layers": "1-2"}, "edit_a is missing or too long"),
    ({"edit": "swap", "edit_a": "a", "edit_b": "b", "edit_layers": "2-1"}, "not a layer range"),
    ({"edit": "swap", "edit_a": "a", "edit_b": "b", "edit_layers": "../x"}, "not a layer range"),
    ({"edit": "swap", "edit_a": "a", "edit_b": "b", "edit_layers": "1-2", "edit_alpha": "nan"}, "not a scale"),
    ({"edit": "swap", "edit_a": "a", "edit_b": "b", "edit_layers": "1-2", "edit_alpha": "99"}, "not a scale"),
])
def test_bad_url_values_are_one_sentence(query, message):
    with pytest.raises(ValueError, match=message):
        TrialEdit.from_query(query)
    assert TrialEdit.from_query({"prompt": "x"}) is None


def test_a_token_or_band_the_model_lacks_fails_in_build(setup):
    model, lens = setup
    with pytest.raises(ValueError, match="The band 0-99 is outside the lens's source layers 0-2"):
        TrialEdit(" time", " one", (0, 99)).build(model, lens)
    with pytest.raises(ValueError, match="outside"):  # the lens's target layer is not a source layer
        TrialEdit(" time", " one", (3, 3)).build(model, lens)
    with pytest.raises(ValueError):
        TrialEdit("Parisianly unknown words", " one", (1, 2)).build(model, lens)


def _replay_held(model, result, row: int) -> int:
    trial = result.trials.iloc[row].to_dict()
    logits = edited_next_logits(model, model.encode(_prompt_of(result, trial)), [list(result.edits_of(row))])
    return ranks_of(logits[0], word_ids(model, trial["target"]).values())


def test_every_arm_keeps_its_edits_and_they_replay_to_the_trials_rank(setup):
    model, lens = setup
    # the probe split (J-space vectors, clamps, random probes) and the random directions: arms with no URL form
    result = run_experiment(model, lens, "probe-swap", {"items": probe_items(model, lens)}, band="1-2", alpha=0.75,
                            depth=False)
    assert len(result.trial_edits) == len(result.trials)
    arms = set()
    for row, trial in enumerate(result.trials.to_dict("records")):
        assert result.edits_of(row), trial["arm"]
        rank = _replay_held(model, result, row)
        assert rank == trial["rank"] if trial["rank"] <= 2 else rank > 2, (trial["arm"], trial["item"])
        arms.add(trial["arm"])
    assert {"random directions", "probe J part", "probe non-J part", "probe non-J + J clamp"} <= arms
    # the edits are the experiment's own objects: the clamp arm holds a clamp beside its swap
    clamp_row = next(i for i, a in enumerate(result.trials["arm"]) if a == "probe non-J + J clamp")
    assert len(result.edits_of(clamp_row)) == 2
    assert result.edits_of(len(result.trials)) == () and result.edits_of(-1) == ()


def test_introspection_and_ablation_trials_keep_their_edits(setup):
    from test_experiments import PROSE

    from jlens_core.experiments.introspection import Inject
    from jlens_core.interventions.jspace_edits import AblateJSpace

    model, lens = setup
    data = {"intro_prompt": [{"role": "user", "content": "Do you notice one time?"}],
            "prefills": {"quote": "The word is \""}, "concepts": [{"name": "capital", "surface": "capital"}]}
    result = run_experiment(model, lens, "verbal-introspection", data, band="1-2", strengths=(0.0, 4.0))
    norms = result.extras["mean_residual_norm"]
    for row, trial in enumerate(result.trials.to_dict("records")):
        (inject,) = result.edits_of(row)
        assert isinstance(inject, Inject) and inject.layers == [1, 2]
        assert all(abs(inject.scales[layer] - trial["strength"] * norms[str(layer)]) < 1e-3 * (1 + norms[str(layer)])
                   for layer in (1, 2))
        assert _replay_held(model, result, row) == trial["rank"]
    battery = run_experiment(model, lens, "ablation-battery", {"items": probe_items(model, lens)}, band="1-2",
                             strengths=(1.0,), n_texts=1, prose=[PROSE])
    assert len(battery.trial_edits) == len(battery.trials)
    for row, arm in enumerate(battery.trials["arm"]):
        edits = battery.edits_of(row)
        assert (arm == "clean") == (edits == ())
        assert all(isinstance(e, AblateJSpace) for e in edits)


def test_a_server_holds_trials_by_token():
    edits_a, edits_b = (object(), object()), (object(),)
    held = HeldTrials(max_entries=2)
    ref = held.hold("model-1", edits_a, "probe-swap: the probe J part arm on i1")
    assert held.hold("model-1", edits_a, "again") == ref and len(held) == 1  # a redrawn page: the same token
    assert edit_request(ref.query()) == ref
    got = held.get(ref, "model-1")
    assert got.edits == edits_a and str(got) == "probe-swap: the probe J part arm on i1"
    with pytest.raises(ValueError, match="made on another model"):
        held.get(ref, "model-2")
    with pytest.raises(ValueError, match="no longer holds the trial's edits"):
        held.get(HeldRef("x" * 24), "model-1")
    with pytest.raises(ValueError, match="ran no edit"):
        held.hold("model-1", (), "nothing")
    # the oldest goes first
    second = held.hold("model-1", edits_b, "b")
    held.hold("model-1", (object(),), "c")
    with pytest.raises(ValueError, match="no longer holds"):
        held.get(ref, "model-1")
    assert held.get(second, "model-1").edits == edits_b


@pytest.mark.parametrize("token", [None, "", "short", "../../etc/passwd/../../xx", "a" * 65, "bad token with spaces!"])
def test_a_malformed_held_token_is_one_sentence(token):
    query = {"edit": "held"} | ({"edit_trial": token} if token is not None else {})
    with pytest.raises(ValueError, match="edit_trial is missing or malformed"):
        edit_request(query)
    assert edit_request({"prompt": "x"}) is None


def test_held_label_names_the_experiment_arm_item_and_band(setup):
    model, lens = setup
    result = run_experiment(model, lens, "probe-swap", {"items": probe_items(model, lens)}, band="1-2",
                            depth=False, probes=False)
    trial = result.trials[result.trials["arm"] == "random directions"].iloc[0].to_dict()
    assert held_label(result, trial) == (f"probe-swap: the random directions arm on {trial['item']} "
                                         f"(target {trial['target'].strip()!r}), band 1-2")
