"""``jlens eval`` / ``jlens inspect``, shipped-lens lookup, and the static plots, on a tiny model."""

from __future__ import annotations

import json
import random

import pandas as pd
import pytest
import torch
from conftest import CORPUS, save_tiny

from jlens_core import JacobianLens, LogitLens, evaluate, fit, load_lens, load_model
from jlens_core.cli.main import main
from jlens_core.figures.png_plots import plot_convergence
from jlens_core.fitting.diagnostics import convergence_frame, diagnostics_frame
from jlens_core.lenses.loading import default_lens
from jlens_core.lenses.shipped import shipped_lens_path


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-eval")
    model_dir = root / "tiny"
    save_tiny(model_dir)
    rng = random.Random(0)
    words = CORPUS.split()
    texts = [" ".join(rng.choice(words) for _ in range(30)) for _ in range(6)]
    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(texts) + "\n")
    model = load_model(str(model_dir), device="cpu")
    lens = fit(model, texts[:3], max_seq_len=24, skip_first=4)
    lens_path = lens.save(root / "lens.safetensors")
    return {"root": root, "model_dir": model_dir, "corpus": corpus, "texts": texts, "model": model,
            "lens": lens, "lens_path": lens_path}


def test_eval_writes_table_json_and_plot_matching_evaluate(work, capsys):
    out = work["root"] / "eval"
    code = main(["eval", "--model", str(work["model_dir"]), "--lens", "logit", "--lens", str(work["lens_path"]),
                 "--shrinkage", "0.5", "--corpus", str(work["corpus"]), "--split", "all", "--min-chars", "10",
                 "--max-seq-len", "24", "--out", str(out), "--no-progress"])
    assert code == 0
    table = pd.read_csv(out / "eval.csv")
    assert set(table["lens"]) == {"logit", "jacobian", "jacobian (shrink 0.5)"}
    model, lens = work["model"], work["lens"]
    expected = evaluate(model, {"logit": LogitLens.for_model(model), "jacobian": lens,
                                "jacobian (shrink 0.5)": lens.with_shrinkage(0.5)},
                        work["texts"], max_seq_len=24)
    merged = table.merge(expected, on=["lens", "layer"], suffixes=("", "_direct"))
    assert len(merged) == len(expected)
    assert (merged["kl_bits"] - merged["kl_bits_direct"]).abs().max() < 1e-4
    assert (merged["ce_bits"] - merged["ce_bits_direct"]).abs().max() < 1e-4
    data = json.loads((out / "eval.json").read_text())
    assert data["n_texts"] == 6 and len(data["per_layer"]) == len(table)
    assert (out / "eval.png").stat().st_size > 10_000
    assert "kl_bits" in capsys.readouterr().out


def test_eval_pass_at_k_on_a_shipped_set(work):
    out = work["root"] / "eval-pass"
    code = main(["eval", "--model", str(work["model_dir"]), "--lens", "logit", "--corpus", str(work["corpus"]),
                 "--split", "all", "--min-chars", "10", "--max-seq-len", "24", "--out", str(out),
                 "--pass-at-k", "two_hop", "--pass-at-k", "antonym_chain", "--k", "1", "300", "--no-progress",
                 "--spelling", "first_token"])
    assert code == 0
    passes = pd.read_csv(out / "pass_at_k.csv")
    assert set(passes["k"]) == {1, 300}
    assert passes["set"].tolist() == ["two_hop", "two_hop", "antonym_chain", "antonym_chain", "macro mean", "macro mean"]
    # k = the whole vocabulary: every intermediate passes (the first-token rule scores every word)
    assert (passes.loc[passes["k"] == 300, "pass_rate"] == 1.0).all()
    detail = pd.read_csv(out / "pass_at_k_detail.csv")
    assert set(detail["set"]) == {"two_hop", "antonym_chain"}
    # whole-word spellings: the tiny vocabulary has few whole words, and coverage says so
    main(["eval", "--model", str(work["model_dir"]), "--lens", "logit", "--n-texts", "0", "--out", str(out),
          "--pass-at-k", "two_hop", "--no-progress"])
    whole = pd.read_csv(out / "pass_at_k.csv")
    assert (whole["words_scored"] < whole["n_words"]).all() and (whole["n_words"] == 28).all()


def test_eval_decoys_score_each_item_on_another_items_words(work, capsys):
    out = work["root"] / "eval-decoys"
    base = ["eval", "--model", str(work["model_dir"]), "--lens", "logit", "--n-texts", "0", "--no-progress",
            "--spelling", "first_token"]
    assert main([*base, "--out", str(out / "real"), "--pass-at-k", "two_hop"]) == 0
    assert main([*base, "--out", str(out / "decoy"), "--pass-at-k", "two_hop", "--decoys"]) == 0
    real, decoy = (pd.read_csv(out / sub / "pass_at_k_detail.csv") for sub in ("real", "decoy"))
    inter = [d[d["role"] == "intermediate"].set_index("item") for d in (real, decoy)]
    both = inter[1].index
    assert len(both) > 0 and set(both) <= set(inter[0].index)
    assert (inter[0].loc[both, "word"] != inter[1]["word"]).all()  # another item's word, at the same prompt
    assert (inter[0].loc[both, "position"] == inter[1]["position"]).all()
    lone = work["root"] / "lone.jsonl"
    lone.write_text('{"prompt": "The capital of France is", "intermediates": ["Paris"]}\n')
    assert main([*base, "--out", str(out / "x"), "--pass-at-k", str(lone), "--decoys"]) == 2
    assert "--decoys: no item of" in capsys.readouterr().err


def test_inspect_prints_a_grid_with_the_output_row(work, capsys):
    code = main(["inspect", "--model", str(work["model_dir"]), "--lens", str(work["lens_path"]),
                 "--prompt", work["texts"][0], "--layers", "0,2", "--last", "4", "--max-seq-len", "24"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split()[0] for line in lines[3:]]
    assert rows == ["0", "2", "out"]
    assert "jacobian lens" in lines[0]


def test_inspect_generate_prints_the_continuation_and_reads_it(work, capsys):
    from jlens_core.reading.generation import generate

    prompt = work["texts"][0][:60]
    code = main(["inspect", "--model", str(work["model_dir"]), "--lens", "logit", "--prompt", prompt,
                 "--generate", "5", "--no-progress", "--width", "12"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    expected = generate(work["model"], prompt, max_new_tokens=5)
    assert lines[0] == (f"continuation ({expected.n_generated} tokens, {expected.stop_reason}): "
                        f"{expected.continuation!r}")
    # columns: the prompt's last token, then the continuation, marked (gen)
    marks = lines[3].split()
    assert marks == ["(gen)"] * expected.n_generated
    rows = [line.split()[0] for line in lines[5:]]
    assert rows == [str(layer) for layer in range(work["model"].n_layers - 1)] + ["out"]


@pytest.mark.parametrize("argv, message", [
    (["inspect", "--prompt", ""], "--prompt is empty"),
    (["eval", "--lens", "logit", "--out", "x", "--pass-at-k", "no_such_set"], "No evaluation set 'no_such_set'"),
    (["eval", "--lens", "logit", "--out", "x", "--pass-at-k", "two_hop", "--readout", "middle"],
     "unknown readout rule 'middle'"),
    (["inspect", "--prompt", "hi", "--layers", "zero"], "zero"),
    (["inspect", "--prompt", "hi", "--generate", "5000"], "max_new_tokens=5000 is out of range"),
    (["inspect", "--prompt", "hi", "--generate", "3", "--temperature", "-1"], "temperature=-1.0 must be"),
])
def test_bad_input_is_one_sentence(work, argv, message, capsys):
    argv = [argv[0], "--model", str(work["model_dir"])] + argv[1:]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_default_lens_needs_a_shipped_lens(work, capsys):
    assert default_lens(work["model"]) is None  # a tiny model has no shipped lens
    assert main(["inspect", "--model", str(work["model_dir"]), "--lens", "default", "--prompt", "hi"]) == 2
    assert "No shipped lens" in capsys.readouterr().err


def test_load_lens_by_path_and_errors(work):
    lens = load_lens(str(work["lens_path"]), model=work["model"])
    assert isinstance(lens, JacobianLens) and lens.n_prompts == 3
    with pytest.raises(FileNotFoundError, match="no shipped lens by that name"):
        load_lens("no-such-model")


def test_shipped_lens_when_present_belongs_to_the_default_model():
    path = shipped_lens_path("smollm2-135m")
    if path is None:
        pytest.skip("no shipped lens in assets/lenses/ yet")
    lens = JacobianLens.load(path)
    assert lens.model_name == "smollm2-135m" and lens.d_model == 576 and lens.target_layer == 29
    assert lens.source_layers == list(range(29)) and lens.fit_settings.max_seq_len == 128
    assert lens.n_prompts >= 100 and lens.skip_first == 16
    assert len(lens.diagnostics) == lens.n_prompts * 29


def test_convergence_plot_and_frame(work, tmp_path):
    frame = diagnostics_frame(work["lens"].diagnostics)
    assert sorted(frame["n_prompts"].unique()) == [1, 2, 3]
    assert frame.loc[frame["n_prompts"] == 1, "rel_change"].isna().all()
    assert sorted(convergence_frame(frame)["n_prompts"].unique()) == [2, 3]  # undefined for the first prompt
    out = plot_convergence(work["lens"].diagnostics, tmp_path / "conv.png")
    assert out.stat().st_size > 10_000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conv.png"]  # written atomically: no temp file left
    with pytest.raises(ValueError, match="no fit diagnostics"):
        plot_convergence([], tmp_path / "none.png")


# -- jlens intervene / jlens eval --swap -------------------------------------------------------------
def test_intervene_prints_clean_and_edited_runs(work, capsys):
    from jlens_core.interventions import Swap
    from jlens_core.reading.generation import generate

    model, prompt = work["model"], work["texts"][1][:80]
    code = main(["intervene", "--model", str(work["model_dir"]), "--lens", str(work["lens_path"]),
                 "--prompt", prompt, "--swap", " capital: time", "--alpha", "4", "--layers", "1:3",
                 "--max-new-tokens", "6"])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    lens = JacobianLens.load(work["lens_path"])
    swap = Swap(model, lens, " capital", " time", 4.0, layers=[1, 2])
    clean = generate(model, prompt, max_new_tokens=6)
    edited = generate(model, prompt, max_new_tokens=6, edits=[swap])
    assert lines[0] == f"edit: {swap!r}"
    assert f"clean : {clean.continuation!r}" in lines and f"edited: {edited.continuation!r}" in lines
    top = lines[2].split()
    assert top[0] == "1" and top[-1] == f"{edited.top_probs[0][0]:.1%}"


@pytest.mark.parametrize("extra, message", [
    (["--ablate", "capital city"], "'capital city' is not a single vocabulary token"),
    (["--steer", " capital:9"], "Steering strength 9.0 is out of range"),
    (["--swap", " capital: capital"], "Cannot swap ' capital' with itself"),
    (["--swap", " capital: time", "--layers", "3"], "Layer 3 is outside the lens"),
    ([], "No edit given"),
])
def test_intervene_bad_input_is_one_sentence(work, extra, message, capsys):
    argv = ["intervene", "--model", str(work["model_dir"]), "--lens", str(work["lens_path"]), "--prompt", "hi there"]
    assert main(argv + extra) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_eval_swap_writes_swap_success_csv(work, tmp_path, capsys):
    items = [{"name": f"i{n}", "prompt": text[:60], "source": " capital", "replacement": " time",
              "answer": "The", "swap_answer": "time"} for n, text in enumerate(work["texts"][:3])]
    set_file = tmp_path / "mine.jsonl"
    set_file.write_text("\n".join(json.dumps(item) for item in items) + "\n")
    out = tmp_path / "eval"
    code = main(["eval", "--model", str(work["model_dir"]), "--lens", str(work["lens_path"]), "--n-texts", "0",
                 "--swap", str(set_file), "--alpha", "1", "4", "--out", str(out), "--no-progress"])
    assert code == 0
    table = pd.read_csv(out / "swap_success.csv")
    assert set(table["lens"]) == {"jacobian", "logit", "random", "norm-matched"} and set(table["alpha"]) == {1.0, 4.0}
    assert (table["set"] == "mine").all() and (table["items"] == 3).all()
    per_item = pd.read_csv(out / "swap_items.csv")
    assert len(per_item) == 3 and not (out / "eval.csv").exists()  # --n-texts 0: no per-layer evaluation
    assert json.loads((out / "eval.json").read_text())["swap_success"]


# -- jlens tune ---------------------------------------------------------------------------------------
def test_tune_then_eval_three_lenses(work, tmp_path, capsys):
    out = tmp_path / "tuned.safetensors"
    code = main(["tune", "--model", str(work["model_dir"]), "--corpus", str(work["corpus"]), "--split", "all",
                 "--min-chars", "10", "--heldout-texts", "0", "--steps", "4", "--tokens-per-step", "16",
                 "--skip-first", "4", "--out", str(out), "--no-progress"])
    assert code == 0 and out.is_file() and out.with_suffix(".ckpt").is_file()
    from jlens_core.lenses.tuned import TunedLens

    lens = TunedLens.load(out, model=work["model"])
    assert lens.settings["steps"] == 4 and lens.settings["corpus"] == str(work["corpus"])
    # rerun: resumes from the finished checkpoint, same lens
    assert main(["tune", "--model", str(work["model_dir"]), "--corpus", str(work["corpus"]), "--split", "all",
                 "--min-chars", "10", "--heldout-texts", "0", "--steps", "4", "--tokens-per-step", "16",
                 "--skip-first", "4", "--out", str(out), "--no-progress"]) == 0
    again = TunedLens.load(out)
    assert all(torch.equal(a, b) for layer in lens.source_layers
               for a, b in zip(lens.translators[layer], again.translators[layer]))
    eval_out = tmp_path / "eval"
    assert main(["eval", "--model", str(work["model_dir"]), "--lens", str(out), "--lens", str(work["lens_path"]),
                 "--lens", "logit", "--corpus", str(work["corpus"]), "--split", "all", "--min-chars", "10",
                 "--n-texts", "2", "--max-seq-len", "24", "--out", str(eval_out), "--no-progress"]) == 0
    frame = pd.read_csv(eval_out / "eval.csv")
    assert set(frame["lens"]) == {"tuned", "jacobian", "logit"}
    capsys.readouterr()
    assert main(["tune", "--model", str(work["model_dir"]), "--corpus", str(work["corpus"]), "--split", "all",
                 "--min-chars", "10", "--heldout-texts", "0", "--steps", "4", "--tokens-per-step", "16",
                 "--skip-first", "4", "--lr", "0.5", "--out", str(out), "--no-progress"]) == 2
    assert "was made with lr=0.001, this training asks for lr=0.5" in capsys.readouterr().err


def test_eval_names_a_combined_expert_file_by_its_kind(work):
    """A combined J++ file (ExpertLens.to_jacobian_lens) is a plain Jacobian lens on disk; eval names it
    ``jacobian++``, beside a plain J lens named ``jacobian``."""
    model, texts = work["model"], work["texts"]
    experts = fit(model, texts[:3], max_seq_len=24, skip_first=4, experts=2, cluster_prompts=3)
    weights = {layer: torch.tensor([1.0, -0.5]) for layer in experts.source_layers}
    combined = experts.with_weights(weights, ["x:0"]).to_jacobian_lens()
    path = combined.save(work["root"] / "jpp.safetensors")
    out = work["root"] / "eval-jpp"
    code = main(["eval", "--model", str(work["model_dir"]), "--lens", str(work["lens_path"]), "--lens", str(path),
                 "--corpus", str(work["corpus"]), "--split", "all", "--min-chars", "10", "--max-seq-len", "24",
                 "--n-texts", "2", "--out", str(out), "--no-progress"])
    assert code == 0
    table = pd.read_csv(out / "eval.csv")
    assert set(table["lens"]) == {"jacobian", "jacobian++"}
    direct = evaluate(model, {"jacobian++": JacobianLens.load(path)}, texts[:2], max_seq_len=24)
    mine = table[table["lens"] == "jacobian++"].merge(direct, on=["lens", "layer"], suffixes=("", "_direct"))
    assert len(mine) == len(direct) and (mine["kl_bits"] - mine["kl_bits_direct"]).abs().max() < 1e-4
