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


def test_experiments_page_runs_a_set_from_the_workspace(tiny_dir, tiny_model, lens_file, tmp_path):
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
