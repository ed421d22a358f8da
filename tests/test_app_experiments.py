"""The app's Experiments page (docs/experiments.md) under AppTest, on the tiny model: a set in the workspace runs and
shows the figure, the summary and the trials with the rates :func:`run_experiment` computes; the built-in set, which the tiny model cannot answer, gives the one-sentence empty-gate error."""

from __future__ import annotations

import json

import test_app
from test_app import button, chart, make_app, ok, values

from jlens_core import JacobianLens
from jlens_core.experiments.core import clean_read, word_ids
from jlens_core.experiments.run import run_experiment

runs_root = test_app.runs_root  # its fixture (tiny_model and lens_file come from conftest)
PROMPTS = ["The capital of France is", "Once upon a time there was", "def add(a, b):", "Numbers like 12, 345"]


def items_for(model, lens) -> list[dict]:
    """Items whose answer is the tiny model's own greedy next word (so they pass the gate)."""
    found = []
    for i, prompt in enumerate(PROMPTS):
        word = model.decode([clean_read(model, lens, model.encode(prompt), []).greedy]).strip()
        if word and word_ids(model, word):
            found.append({"name": f"t{i}", "category": "ab"[i % 2], "prompt": prompt, "intermediate": "capital",
                          "answer": word, "swap_to": "time", "swap_answer": "one"})
    assert found
    return found


def page_with_a_set(tiny_dir, tiny_model, lens_file, tmp_path):
    """``(app on the Experiments page, set to a probe-swap set in the workspace with a given band; lens; items)``."""
    lens = JacobianLens.load(lens_file)
    items = items_for(tiny_model, lens)
    path = tmp_path / "mine.json"  # inside the workspace (the tests' temporary folder)
    path.write_text(json.dumps({"items": items}))
    at = ok(make_app(model=tiny_dir, lens=lens_file).run())
    at.switch_page("views/experiments.py").run()
    at.selectbox(key="ex_name").set_value("probe-swap")
    at.selectbox(key="ex_lens").set_value("jacobian")
    at.text_input(key="ex_path").set_value(str(path))
    at.checkbox(key="ex_derive").set_value(False).run()
    return at, lens, items


def test_experiments_page_runs_a_set_from_the_workspace(tiny_dir, tiny_model, lens_file, tmp_path):
    at, lens, items = page_with_a_set(tiny_dir, tiny_model, lens_file, tmp_path)
    lo, hi = at.slider(key="ex_band").value
    button(ok(at), "Run experiment").click().run()
    spec = chart(ok(at), "ex_fig")
    direct = run_experiment(tiny_model, lens, "probe-swap", {"items": items}, band=f"{lo}-{hi}")
    bars = spec["data"][0]
    assert list(bars["x"]) == list(direct.summary[direct.summary["trials"] > 0]["arm"])
    assert list(values(bars["y"])) == list(direct.summary[direct.summary["trials"] > 0]["rate"])
    trials = next(d for d in at.dataframe if d.proto.id.endswith("-ex_trials"))
    assert len(trials.value) == len(direct.trials)


def test_experiments_page_empty_gate_is_one_sentence(tiny_dir, lens_file):
    at = ok(make_app(model=tiny_dir, lens=lens_file).run())
    at.switch_page("views/experiments.py").run()
    at.selectbox(key="ex_name").set_value("probe-swap").run()
    button(ok(at), "Run experiment").click().run()
    assert any("The model answers none of the" in e.value for e in at.error), [e.value for e in at.error]


def test_a_trial_opens_in_inspect_with_its_swap_applied(tiny_dir, tiny_model, lens_file, tmp_path):
    from urllib.parse import parse_qs, urlparse

    from jlens_core.experiments.links import EDIT_KEYS, TrialEdit, trial_edit

    at, lens, _ = page_with_a_set(tiny_dir, tiny_model, lens_file, tmp_path)
    button(ok(at), "Run experiment").click().run()
    result = at.session_state["ex_result"]["result"]
    row = next(i for i, arm in enumerate(result.trials["arm"]) if arm == "J-lens swap")
    at.session_state["ex_trials"] = {"selection": {"rows": [row], "columns": []}}  # what a click on the row sends
    link = next(b for b in ok(at.run()).get("link_button") if b.proto.label.startswith("Open the trial in Inspect"))
    query = {k: v[0] for k, v in parse_qs(urlparse(link.proto.url).query).items()}
    expected = trial_edit(tiny_model, result, result.trials.iloc[row].to_dict())
    assert TrialEdit.from_query(query) == expected and expected is not None
    inspect = ok(make_app(**query).run())
    swap = expected.build(tiny_model, lens)[0]
    assert chart(inspect, "heatmap")["layout"]["title"]["text"].startswith(f"Edited run ({swap!r})")
    assert any("Opened with an edit applied: " + str(expected) in i.value for i in inspect.info)
    assert not set(EDIT_KEYS) & set(inspect.query_params)  # applied once; the URL describes the panel from then on
    # the clean reading: the panel's toggle off
    inspect.toggle(key="iv_edited_heatmap").set_value(False).run()
    assert not chart(ok(inspect), "heatmap")["layout"]["title"]["text"].startswith("Edited run")


def test_a_random_directions_trial_opens_in_inspect_with_its_own_edits(tiny_dir, tiny_model, lens_file, tmp_path):
    from urllib.parse import parse_qs, urlparse

    from jlens_core.experiments.links import EDIT_KEYS, HeldRef, held_label

    at, _, _ = page_with_a_set(tiny_dir, tiny_model, lens_file, tmp_path)
    button(ok(at), "Run experiment").click().run()
    result = at.session_state["ex_result"]["result"]
    row = next(i for i, arm in enumerate(result.trials["arm"]) if arm == "random directions")
    at.session_state["ex_trials"] = {"selection": {"rows": [row], "columns": []}}
    link = next(b for b in ok(at.run()).get("link_button") if b.proto.label.startswith("Open the trial in Inspect"))
    assert link.proto.label.endswith("with its edit")
    query = {k: v[0] for k, v in parse_qs(urlparse(link.proto.url).query).items()}
    assert query["edit"] == "held" and not {"edit_a", "edit_b"} & set(query)  # the vectors stay on the server
    label = held_label(result, result.trials.iloc[row].to_dict())
    inspect = ok(make_app(**query).run())
    edits = result.edits_of(row)
    title = chart(inspect, "heatmap")["layout"]["title"]["text"]
    assert title.startswith(f"Edited run ({'; '.join(repr(e) for e in edits)})")
    assert any("Opened with an edit applied: " + label in i.value for i in inspect.info)
    assert any("The edit is the experiment trial's own: " + label in i.value for i in inspect.info)
    assert not set(EDIT_KEYS) & set(inspect.query_params)
    # the panel's own controls again: the trial's edit leaves the heatmap
    button(inspect, "Edit with the panel instead").click().run()
    assert not chart(ok(inspect), "heatmap")["layout"]["title"]["text"].startswith("Edited run")
    # a token this server does not hold: one sentence, a clean heatmap
    stale = ok(make_app(**{**query, **HeldRef("z" * 24).query()}).run())
    assert any("no longer holds the trial's edits" in e.value for e in stale.error), [e.value for e in stale.error]
    assert not chart(stale, "heatmap")["layout"]["title"]["text"].startswith("Edited run")


def test_a_bad_edit_link_is_one_sentence_and_the_heatmap_stays_clean(tiny_dir, lens_file):
    base = {"model": tiny_dir, "lens": lens_file, "edit": "swap", "edit_b": " time", "edit_lens": "jacobian"}
    for bad, message in (({"edit_a": "zzzqqqxxxyyy", "edit_layers": "1-2"}, "The link's edit cannot be applied"),
                         ({"edit_a": " one", "edit_layers": "0-40"}, "The band 0-40 is outside the lens's source layers"),
                         ({"edit_a": " one", "edit_layers": "../../etc"}, "not a layer range"),
                         ({"edit_a": " one", "edit_layers": "1-2", "edit_lens": "nope"}, "lens 'nope' is not loaded")):
        at = ok(make_app(**{**base, **bad}).run())
        assert any(message in e.value for e in at.error), (bad, [e.value for e in at.error])
        assert not chart(at, "heatmap")["layout"]["title"]["text"].startswith("Edited run")


def test_the_reference_size_set_is_a_built_in_choice(tiny_dir, lens_file):
    at = ok(make_app(model=tiny_dir, lens=lens_file).run())
    at.switch_page("views/experiments.py").run()
    at.selectbox(key="ex_name").set_value("probe-swap").run()
    at.radio(key="ex_builtin").set_value("reference size").run()
    button(ok(at), "Run experiment").click().run()
    # the tiny model answers none of them: the sentence counts the reference-size set's 90 items
    assert any("The model answers none of the 90 probe-swap items" in e.value for e in at.error), [
        e.value for e in at.error]
