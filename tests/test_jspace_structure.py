"""The J-space's structure by layer (docs/method.md §11.6) and the ``jlens decompose`` / ``jlens jspace-structure``
commands, on a tiny model: the medians are those of the decompositions of the sampled residuals, the bootstrap
interval brackets the median, the MLP gain of isotropic directions is about 1, and the CLI prints what the library
computes (one sentence and exit 2 on bad input)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import CORPUS

from jlens_core import load_lens
from jlens_core.cli.main import main
from jlens_core.jspace import decompose
from jlens_core.jspace.structure import bootstrap_median, jspace_structure, mlp_gain, sample_residuals
from jlens_core.reading.inputs import record_residuals


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_dir, tiny_model, lens_file):
    root = tmp_path_factory.mktemp("jspace")
    rng = random.Random(0)
    words = CORPUS.split()
    texts = [" ".join(rng.choice(words) for _ in range(30)) for _ in range(4)]
    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(texts) + "\n")
    return {"model_dir": tiny_dir, "corpus": corpus, "texts": texts, "model": tiny_model,
            "lens_path": lens_file, "lens": load_lens(lens_file)}


def test_bootstrap_median_brackets_the_median():
    gen = torch.Generator().manual_seed(0)
    values = torch.arange(101, dtype=torch.float32)
    median, lo, hi = bootstrap_median(values, 500, gen)
    assert median == 50.0 and lo < median < hi and 30 < lo and hi < 70


def test_structure_rows_are_medians_of_the_decompositions(work):
    model, lens, texts = work["model"], work["lens"], work["texts"]
    result = jspace_structure(model, lens, texts, layers=[1, 2], k=4, per_text=2, max_seq_len=24, n_boot=50,
                              mlp_directions=64, seed=1)
    assert [(r["layer"], r["gauge"]) for r in result.rows] == [(1, "centred"), (1, "raw"), (2, "centred"), (2, "raw")]
    skip = int(lens.skip_first or 1)
    residuals = sample_residuals(model, texts, [1, 2], per_text=2, skip_first=skip, max_seq_len=24, seed=1)
    for row in result.rows:
        dec = decompose(model, lens, residuals[row["layer"]], row["layer"], k=4, gauge=row["gauge"], seed=1)
        assert row["n"] == dec.n == 8
        assert row["explained"] == pytest.approx(float(dec.explained.double().median()), abs=1e-6)
        assert row["random_explained"] == pytest.approx(float(dec.random_explained.double().median()), abs=1e-6)
        assert row["occupancy"] == float(dec.occupancy.double().median())
        assert row["explained_lo"] <= row["explained"] <= row["explained_hi"]
    assert [g["layer"] for g in result.mlp_gain] == [1, 2]
    assert result.frame().shape[0] == 4 and set(result.mlp_frame().columns) >= {"jlens_gain", "neuron_gain"}


def test_the_sampled_positions_are_residuals_of_the_texts(work):
    model, texts = work["model"], work["texts"]
    got = sample_residuals(model, texts[:1], [1], per_text=3, skip_first=2, max_seq_len=20, seed=0)[1]
    full = record_residuals(model, model.encode(texts[0], max_length=20), [1])[1].float()
    matches = [int(torch.nonzero((full - row).abs().amax(-1) < 1e-6)[0]) for row in got]
    assert len(matches) == 3 and all(m >= 2 for m in matches) and matches == sorted(matches)


def test_mlp_gain_of_isotropic_directions_is_about_one(work):
    model, lens = work["model"], work["lens"]
    gain = mlp_gain(model, lens, 1, n_directions=400, seed=0)
    assert set(gain) >= {"jlens_gain", "neuron_gain", "jlens_gain_q1", "neuron_gain_q3"}
    # the baseline is the median over isotropic directions: a fresh isotropic set has a median gain near 1
    from jlens_core.jspace.structure import _mlp_output_norms, _mlp_parts

    norm, mlp, _ = _mlp_parts(model, 2)
    gen = torch.Generator().manual_seed(0)
    scale = model.d_model ** 0.5
    _ = torch.randperm(model.vocab_size, generator=gen), torch.randperm(64, generator=gen)
    a = _mlp_output_norms(norm, mlp, torch.randn(400, model.d_model, generator=gen), scale).median()
    b = _mlp_output_norms(norm, mlp, torch.randn(400, model.d_model, generator=gen), scale).median()
    assert 0.8 < float(a / b) < 1.25
    with pytest.raises(ValueError, match="is the last"):
        mlp_gain(model, lens, model.n_layers - 1)


def test_decompose_command_prints_the_library_result(work, capsys):
    model, lens = work["model"], work["lens"]
    prompt = "the quick brown fox"
    code = main(["decompose", "--model", str(work["model_dir"]), "--lens", work["lens_path"], "--prompt", prompt,
                 "--layers", "1", "--k", "3", "--format", "json", "--device", "cpu"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    ids = model.encode(prompt)
    h = record_residuals(model, ids, [1])[1].float()[1:]
    dec = decompose(model, lens, h, 1, k=3)
    assert [c["position"] for c in doc["cells"]] == list(range(1, ids.shape[-1]))
    for row, cell in enumerate(doc["cells"]):
        assert cell["explained"] == pytest.approx(float(dec.explained[row]), abs=1e-6)
        assert cell["random_explained"] == pytest.approx(float(dec.random_explained[row]), abs=1e-6)
        assert [a["id"] for a in cell["atoms"]] == [i for _, i, _ in dec.atoms(row)]
    code = main(["decompose", "--model", str(work["model_dir"]), "--lens", work["lens_path"], "--prompt", prompt,
                 "--layers", "1", "--k", "3", "--device", "cpu"])
    assert code == 0 and "random" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [(["--k", "0"], "--k 0"), (["--layers", "3"], "outside the lens"),
                                            (["--prompt", " "], "--prompt is empty")])
def test_decompose_command_refuses_bad_input_in_one_sentence(work, capsys, extra, message):
    base = ["decompose", "--model", str(work["model_dir"]), "--lens", work["lens_path"], "--prompt", "a b c",
            "--device", "cpu"]
    assert main(base + extra) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jlens decompose: error")]
    assert len(errors) == 1 and message in errors[0]


def test_structure_command_writes_its_files(work, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["jspace-structure", "--model", str(work["model_dir"]), "--lens", work["lens_path"], "--corpus",
                 str(work["corpus"]), "--split", "all", "--min-chars", "10", "--n-texts", "2", "--per-text", "2",
                 "--layers", "1", "--k", "3", "--n-boot", "20", "--mlp-directions", "32", "--out", str(out),
                 "--device", "cpu"])
    assert code == 0
    doc = json.loads((out / "structure.json").read_text())
    assert [r["gauge"] for r in doc["rows"]] == ["centred", "raw"] and doc["settings"]["k"] == 3
    assert (out / "structure.csv").exists() and (out / "mlp_gain.csv").exists()
    assert "random_explained" in capsys.readouterr().out
