"""``jlens experiment`` on a tiny model saved to a folder: the files it writes match :func:`run_experiment` run
directly; bad input (a file in another format, a band outside the lens, an empty gate) is one sentence with exit 2."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from conftest import save_tiny
from helpers import random_lens

from jlens_core import JacobianLens, load_model
from jlens_core.cli.main import main
from jlens_core.experiments.core import clean_read, word_ids
from jlens_core.experiments.run import run_experiment

PROMPTS = ["The capital of France is", "Once upon a time there was", "def add(a, b):", "Numbers like 12, 345",
           "The quick brown fox", "Water boils at one"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-experiment")
    model_dir = root / "tiny"
    save_tiny(model_dir)
    model = load_model(str(model_dir), device="cpu")
    lens_path = random_lens(model, seed=3).save(root / "lens.safetensors")
    lens = JacobianLens.load(lens_path)
    items = []
    for i, prompt in enumerate(PROMPTS):  # answers the tiny model gives, so the items pass the gate
        word = model.decode([clean_read(model, lens, model.encode(prompt), []).greedy]).strip()
        if word and word_ids(model, word):
            items.append({"name": f"t{i}", "category": "ab"[i % 2], "prompt": prompt, "intermediate": "capital",
                          "answer": word, "swap_to": "time", "swap_answer": "one"})
    assert items
    path = root / "mine.json"
    path.write_text(json.dumps({"items": items}))
    return {"root": root, "model_dir": model_dir, "model": model, "lens": lens, "lens_path": lens_path,
            "items": path, "data": {"items": items}}


def test_experiment_writes_the_library_result(work, capsys):
    out = work["root"] / "out"
    code = main(["experiment", "probe-swap", "--model", str(work["model_dir"]), "--device", "cpu", "--items",
                 str(work["items"]), "--lens", str(work["lens_path"]), "--band", "1-2", "--no-depth", "--out",
                 str(out), "--html", "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "band 1-2 (given)" in printed and "J-lens swap" in printed
    direct = run_experiment(work["model"], work["lens"], "probe-swap", work["data"], band="1-2", depth=False)
    summary = pd.read_csv(out / "summary.csv")
    assert list(summary["arm"]) == list(direct.summary["arm"])
    assert summary["successes"].tolist() == direct.summary["successes"].tolist()
    assert json.loads((out / "result.json").read_text())["band"]["layers"] == [1, 2]
    assert (out / "result.html").exists() and len(pd.read_csv(out / "trials.csv")) == len(direct.trials)


@pytest.mark.parametrize(("args", "sentence"), [
    (["--items", "{verbal}"], "is not a probe-swap file: it lacks the fields items"),
    (["--band", "2-3"], "Layer 3 is outside the lens"),
    (["--items", "probe-swap"], "The model answers none of the"),
    (["--prefill", "Answer:"], "--prefill is for verbal-report and selectivity-language: probe-swap takes no prefill."),
])
def test_bad_input_is_one_sentence_with_exit_2(work, capsys, args, sentence):
    other = work["root"] / "verbal.json"
    other.write_text(json.dumps({"candidates": {"fruit": ["apple"]}}))
    args = [a.replace("{verbal}", str(other)) for a in args]
    code = main(["experiment", "probe-swap", "--model", str(work["model_dir"]), "--device", "cpu", "--lens",
                 str(work["lens_path"]), "--out", str(work["root"] / "bad"), "--no-progress", "--no-depth", *args])
    assert code == 2
    err = capsys.readouterr().err
    assert sentence in err and err.count("\n") <= 2
