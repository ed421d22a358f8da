"""Swap success's controls (docs/method.md §7): the norm-matched token control against read-direction norms
computed here, centred swaps, the intervals in the report, and the CLI options (``--centred``,
``--swap-seed``)."""

from __future__ import annotations

import importlib
import json
import math

import pandas as pd
import pytest
import torch
from conftest import CORPUS
from helpers import random_lens

from jlens_core import JacobianLens, LogitLens, load_model
from jlens_core.cli.main import main
from jlens_core.interventions import Swap, swap_success
from jlens_core.interventions.intervals import clopper_pearson_interval, wilson_interval
from jlens_core.interventions.read_directions import read_vector
from jlens_core.interventions.swap_success import NORM_MATCHED, norm_matched_token
from jlens_core.reading.generation import generate
from jlens_core.reading.tokens import is_word_like, spellings
from jlens_core.seeds import derive_seed

# the module, not the function of the same name that the package exports
swap_module = importlib.import_module("jlens_core.interventions.swap_success")


# -- the norm-matched control ------------------------------------------------------------------------------
def test_norm_matched_token_draws_within_ten_percent_and_never_an_excluded_one():
    norms = torch.tensor([1.0, 2.0, 1.95, 2.1, 2.25, 1.79, 2.0, 5.0])
    picks = {norm_matched_token(norms, 1, {6}, torch.Generator().manual_seed(s)) for s in range(60)}
    assert picks == {2, 3}  # 2.25 and 1.79 are outside 10 % of 2.0; 1 is the target, 6 excluded
    again = [norm_matched_token(norms, 1, {6}, torch.Generator().manual_seed(s)) for s in range(10)]
    assert again == [norm_matched_token(norms, 1, {6}, torch.Generator().manual_seed(s)) for s in range(10)]
    assert norm_matched_token(norms, 7, set(), torch.Generator().manual_seed(0)) is None  # nothing near 5.0


def eligible_prompt(model) -> tuple[str, str]:
    """A prompt whose clean greedy next token is a word-like single token, and that token."""
    for sentence in CORPUS.split(". "):
        words = sentence.split()
        for n in range(3, len(words)):
            prompt = " ".join(words[:n])
            text = model.decode(generate(model, prompt, max_new_tokens=1, stop_at_eos=False).generated_ids.tolist())
            if is_word_like(text) and text.strip() and spellings(model.tokenizer, text).get(text) is not None:
                return prompt, text
    pytest.skip("no prompt whose next token is a word")


@pytest.fixture(scope="module")
def swap_case(llama):
    lens = random_lens(llama)
    prompt, answer = eligible_prompt(llama)
    item = {"name": "ok", "prompt": prompt, "source": "capital", "replacement": "time", "answer": answer.strip(),
            "swap_answer": "the"}
    return lens, item


@pytest.mark.parametrize("centred", [False, True])
def test_norm_matched_control_is_norm_matched_seeded_and_scored_on_the_target_answer(llama, swap_case, centred):
    lens, item = swap_case
    layers, seed = [1, 2], 7
    report = swap_success(llama, {"jacobian": lens}, [item], layers=layers, alphas=(1.0, 4.0), seed=seed,
                          centred=centred)
    assert report.seed == seed and report.centred is centred and report.control_lens == "jacobian"
    assert report.n_eligible == 1 and report.n_unmatched == 0
    row = report.items.iloc[0]
    assert row["seed"] == derive_seed(seed, 0) == seed * 1_000_003
    drawn = int(row["control_id"])
    assert row["control_token"] == llama.decode([drawn])

    def mean_norm(t: int) -> float:  # the read direction's norm averaged over the edited layers, computed here
        return sum(float(read_vector(llama, lens, layer, t, centred=centred).norm()) for layer in layers) / 2

    target = spellings(llama.tokenizer, " time")[" time"]
    assert abs(mean_norm(drawn) - mean_norm(target)) <= 0.1 * mean_norm(target) + 1e-6
    answers = set(spellings(llama.tokenizer, item["answer"]).values()) | set(spellings(llama.tokenizer, "the").values())
    assert drawn not in answers | {target, spellings(llama.tokenizer, " capital")[" capital"]}
    # the arm is a swap of the source with the drawn token, scored on the target's answer
    swap_ids = set(spellings(llama.tokenizer, "the").values())
    for alpha in (1.0, 4.0):
        swap = Swap(llama, lens, " capital", drawn, alpha, layers=layers, centred=centred)
        edited = generate(llama, item["prompt"], max_new_tokens=1, stop_at_eos=False, edits=[swap]).generated_ids
        assert row[f"{NORM_MATCHED}@{alpha:g} next"] == llama.decode(edited.tolist())
        assert bool(row[f"{NORM_MATCHED}@{alpha:g}"]) == (int(edited[0]) in swap_ids)
    # the lens arm swaps along the (centred) directions asked for
    lens_swap = Swap(llama, lens, " capital", " time", 4.0, layers=layers, centred=centred)
    edited = generate(llama, item["prompt"], max_new_tokens=1, stop_at_eos=False, edits=[lens_swap]).generated_ids
    assert row["jacobian@4 next"] == llama.decode(edited.tolist())
    summary = report.summary.set_index(["lens", "alpha"])
    assert summary.loc[(NORM_MATCHED, 4.0), "eligible"] == 1
    # the same seed draws the same token; the intervals are Clopper-Pearson, Wilson beside them
    assert swap_success(llama, {"jacobian": lens}, [item], layers=layers, alphas=(1.0,), seed=seed,
                        centred=centred, random_control=False).items.iloc[0]["control_token"] == row["control_token"]
    rec = summary.loc[("jacobian", 4.0)]
    expected = clopper_pearson_interval(int(rec["successes"]), 1)
    assert (rec["ci_low"], rec["ci_high"]) == pytest.approx(expected)
    assert (rec["wilson_low"], rec["wilson_high"]) == pytest.approx(wilson_interval(int(rec["successes"]), 1))


def test_an_item_without_a_norm_matched_token_is_counted_not_failed(llama, swap_case, monkeypatch):
    lens, item = swap_case
    # norms 25 % apart: no token is within 10 % of any other
    monkeypatch.setattr(swap_module, "_mean_norms",
                        lambda model, *_: 1.25 ** torch.arange(model.vocab_size, dtype=torch.float64))
    report = swap_success(llama, {"jacobian": lens}, [item, {**item, "name": "again"}], layers=[1], alphas=(1.0,))
    assert report.n_eligible == 2 and report.n_unmatched == 2
    assert report.items["control_token"].isna().all() and report.items["control_id"].isna().all()
    matched = report.summary[report.summary["lens"] == NORM_MATCHED].iloc[0]
    assert matched["eligible"] == 0 and math.isnan(matched["rate"])
    jac = report.summary[report.summary["lens"] == "jacobian"].iloc[0]
    assert jac["eligible"] == 2  # the other arms still score both items


# -- the CLI -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lens_file(tiny_dir, tmp_path_factory) -> str:
    model = load_model(tiny_dir, device="cpu")
    return str(random_lens(model).save(tmp_path_factory.mktemp("lens") / "lens.safetensors"))


def test_intervene_centred(tiny_dir, lens_file, capsys):
    model = load_model(tiny_dir, device="cpu")
    prompt = "The capital of France is"
    code = main(["intervene", "--model", tiny_dir, "--lens", lens_file, "--prompt", prompt, "--swap", " capital: time",
                 "--alpha", "4", "--layers", "1:3", "--max-new-tokens", "4", "--centred"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    swap = Swap(model, JacobianLens.load(lens_file), " capital", " time", 4.0, layers=[1, 2], centred=True)
    assert lines[0] == f"edit: {swap!r}" and "centred directions" in lines[0]
    edited = generate(model, prompt, max_new_tokens=4, edits=[swap])
    assert f"edited: {edited.continuation!r}" in lines


def test_eval_swap_centred_records_seed_and_controls(tiny_dir, lens_file, tmp_path, capsys):
    model = load_model(tiny_dir, device="cpu")
    prompt, answer = eligible_prompt(model)
    set_file = tmp_path / "mine.jsonl"
    set_file.write_text(json.dumps({"prompt": prompt, "source": "capital", "replacement": "time",
                                    "answer": answer.strip(), "swap_answer": "the"}) + "\n")
    out = tmp_path / "eval"
    code = main(["eval", "--model", tiny_dir, "--lens", lens_file, "--n-texts", "0", "--swap", str(set_file),
                 "--alpha", "1", "--centred", "--swap-seed", "3", "--out", str(out), "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "centred read directions" in printed and "Clopper-Pearson" in printed
    table = pd.read_csv(out / "swap_success.csv")
    assert set(table["lens"]) == {"jacobian", "logit", "random", NORM_MATCHED}
    assert table["centred"].all() and (table["seed"] == 3).all() and (table["unmatched"] == 0).all()
    assert {"ci_low", "ci_high", "wilson_low", "wilson_high"} <= set(table.columns)
    items = pd.read_csv(out / "swap_items.csv")
    assert items["seed"].iloc[0] == derive_seed(3, 0) and isinstance(items["control_token"].iloc[0], str)


def test_controls_each_draws_a_norm_matched_token_per_lens_in_its_own_geometry(llama, swap_case):
    lens, item = swap_case
    other = random_lens(llama, seed=5)
    layers, seed = [1, 2], 7
    lenses = {"jacobian": lens, "other": other}
    report = swap_success(llama, lenses, [item], layers=layers, alphas=(1.0,), seed=seed, controls="each")
    arms = list(dict.fromkeys(report.summary["lens"]))
    assert arms == ["jacobian", "other", "logit", "random", f"{NORM_MATCHED} (jacobian)", f"{NORM_MATCHED} (other)",
                    f"{NORM_MATCHED} (logit)"]
    row = report.items.iloc[0]
    target = spellings(llama.tokenizer, " time")[" time"]
    for name, id_column in (("jacobian", "control_id"), ("other", "control_id (other)"),
                            ("logit", "control_id (logit)")):
        used = lenses.get(name) or LogitLens.for_model(llama)
        drawn = int(row[id_column])

        def mean_norm(t: int, used=used) -> float:  # this lens's own read-direction norms, computed here
            return sum(float(read_vector(llama, used, layer, t).norm()) for layer in layers) / 2

        assert abs(mean_norm(drawn) - mean_norm(target)) <= 0.1 * mean_norm(target) + 1e-6
        swap = Swap(llama, used, " capital", drawn, 1.0, layers=layers)
        edited = generate(llama, item["prompt"], max_new_tokens=1, stop_at_eos=False, edits=[swap]).generated_ids
        assert row[f"{NORM_MATCHED} ({name})@1 next"] == llama.decode(edited.tolist())
    # the first lens's draw is the one controls="first" makes
    first = swap_success(llama, lenses, [item], layers=layers, alphas=(1.0,), seed=seed).items.iloc[0]
    assert int(first["control_id"]) == int(row["control_id"])
    with pytest.raises(ValueError, match="controls='some' is not one of first, each"):
        swap_success(llama, lenses, [item], layers=layers, alphas=(1.0,), controls="some")
