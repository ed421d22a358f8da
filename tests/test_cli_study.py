"""``jlens study`` on a tiny model saved to a folder: the files it writes match :func:`study` run directly; bad
input is one sentence with exit code 2."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from conftest import save_tiny
from helpers import random_lens

from jlens_core import LogitLens, load_model
from jlens_core.cli.main import main
from jlens_core.evaluation.study import load_study, study

ITEMS = [{"name": f"i{n}", "prompt": p, "intermediates": ["capital", "Paris"], "target": "one"}
         for n, p in enumerate(["The capital of France is", "Once upon a time there", "Water boils at"])]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-study")
    model_dir = root / "tiny"
    save_tiny(model_dir)
    model = load_model(str(model_dir), device="cpu")
    lens_path = random_lens(model, seed=3).save(root / "lens.safetensors")
    items = root / "mine.jsonl"
    items.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    return {"root": root, "model_dir": model_dir, "model": model, "lens_path": lens_path, "items": items}


def test_study_writes_tables_file_and_page_matching_the_library(work, capsys):
    out, page = work["root"] / "out", work["root"] / "page.html"
    code = main(["study", "--model", str(work["model_dir"]), "--device", "cpu", "--items", str(work["items"]),
                 "--lens", "logit", "--lens", str(work["lens_path"]), "--k", "30", "--no-filter", "--all-positions",
                 "--n-boot", "50", "--out", str(out), "--html", str(page), "--no-progress"])
    assert code == 0
    captured = capsys.readouterr()
    assert "onset" in captured.out and "items/s" in captured.err
    model = work["model"]
    direct = study(model, {"logit": LogitLens.for_model(model), "jacobian": random_lens(model, seed=3)},
                   {"mine": ITEMS}, k=30, answered_only=False, all_positions=True, n_boot=50)
    saved = load_study(out / "study.json")
    pd.testing.assert_frame_equal(saved.table, direct.table)
    pd.testing.assert_frame_equal(saved.summary, direct.summary)
    table = pd.read_csv(out / "table.csv")
    assert len(table) == len(direct.table) and (table["rank"].to_numpy() == direct.table["rank"].to_numpy()).all()
    assert set(pd.read_csv(out / "summary.csv")["lens"]) == {"logit", "jacobian"}
    assert len(pd.read_csv(out / "comparisons.csv")) == 1
    assert "plotly-packed" in page.read_text(encoding="utf-8")


@pytest.mark.parametrize(("argv", "message"), [
    (["--k", "0"], "--k 0 must be >= 1"),
    ([], "Give the items"),
    (["--set", "no_such_set"], "No evaluation set 'no_such_set'"),
])
def test_study_bad_input_is_one_sentence(work, capsys, argv, message):
    code = main(["study", "--model", str(work["model_dir"]), "--out", str(work["root"] / "bad"), *argv])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
