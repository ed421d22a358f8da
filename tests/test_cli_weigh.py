"""``jlens weigh`` on a tiny model: the weighted expert lens and the combined lens it writes, its record and
table, and its one-sentence errors."""

from __future__ import annotations

import json

import pytest
import torch
from test_expert_weights import expert_lens, write_sets

from jlens_core import JacobianLens, load_model
from jlens_core.cli.main import main
from jlens_core.evaluation.labelled_items import read_labelled_items
from jlens_core.fitting.expert_weights import macro_pass_at_k, split_items
from jlens_core.lenses.experts import ExpertLens


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_dir):
    root = tmp_path_factory.mktemp("cli-weigh")
    write_sets(root)
    model = load_model(tiny_dir, device="cpu")
    lens_path = expert_lens(model).save(root / "experts.safetensors")
    sets = f"{root / 'alpha.json'},{root / 'beta.json'}"
    return {"root": root, "model_dir": tiny_dir, "model": model, "lens_path": lens_path, "sets": sets}


def weigh(work, *extra: str) -> int:
    return main(["weigh", str(work["lens_path"]), "--model", str(work["model_dir"]), "--device", "cpu",
                 "--sets", work["sets"], "--no-progress", *extra])


def test_weigh_writes_a_weighted_lens_that_loads_with_its_items(work, capsys):
    out, combined = work["root"] / "jpp.safetensors", work["root"] / "jpp-combined.safetensors"
    code = weigh(work, "--out", str(out), "--combined", str(combined), "--steps", "4", "--heldout-fraction", "0.4",
                 "--seed", "3", "--save-dtype", "float16")
    assert code == 0
    model = work["model"]
    lens = ExpertLens.load(out, model=model)
    assert lens.weights is not None and lens.kind == "jacobian++"
    items = read_labelled_items(model, work["sets"].split(","), lens.source_layers)
    train, heldout = split_items(items, 0.4, seed=3)
    assert lens.weight_items == [item.key for item in train if item.scored]
    assert not set(lens.weight_items) & {item.key for item in heldout}
    flat = JacobianLens.load(combined, model=model)
    for layer in lens.source_layers:
        assert torch.allclose(flat.matrix(layer), lens.matrix(layer), atol=5e-3, rtol=1e-2)  # fp16 storage
    assert list(flat.record.combined_from.weight_items) == lens.weight_items
    record = json.loads((work["root"] / "jpp.weigh.json").read_text())
    assert record["heldout_items"] == [item.key for item in heldout]
    assert record["n_train"] == len(train) and lens.record.weighting["seed"] == 3
    # the printed held-out row of the learned weights is the exact macro of the saved weights (fp32 in the file)
    mats = {layer: lens.expert_matrices(layer) for layer in lens.source_layers}
    expected = macro_pass_at_k(model, mats, heldout, lens.weights)
    assert record["macro"]["learned/held-out"] == {str(k): pytest.approx(v, abs=1e-6) for k, v in expected.items()}
    printed = capsys.readouterr().out
    assert "learned   held-out" in printed and "pooled    train" in printed and "pass@10" in printed


@pytest.mark.parametrize(("args", "message"), [
    (["--heldout-fraction", "1"], "--heldout-fraction 1.0 must lie strictly between 0 and 1."),
    (["--heldout-fraction", "0"], "--heldout-fraction 0.0 must lie strictly between 0 and 1."),
    (["--sets", "no_such_set"], "No evaluation set 'no_such_set'"),
    (["--sets", "UNSCORABLE"], "has no scorable item"),
    (["--lens", "PLAIN"], "is not an expert lens, so it has no experts to weigh"),
    (["--basis-memory", "lots"], "--basis-memory 'lots' is not a memory size"),
])
def test_weigh_errors_are_one_sentence(work, capsys, args, message):
    bad_set = work["root"] / "unscorable.json"
    bad_set.write_text(json.dumps({"items": [{"prompt": "The capital", "intermediates": ["zebra"]}]}))
    plain = work["root"] / "plain.safetensors"
    lens = ExpertLens.load(work["lens_path"])
    lens.pooled_lens().save(plain)
    args = [str(bad_set) if a == "UNSCORABLE" else a for a in args]
    lens_path = work["lens_path"]
    if args[0] == "--lens":
        lens_path, args = plain, []
    code = main(["weigh", str(lens_path), "--model", str(work["model_dir"]), "--device", "cpu", "--sets",
                 work["sets"], "--no-progress", "--out", str(work["root"] / "never.safetensors"), *args])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jlens weigh: error: ")]
    assert code == 2 and len(errors) == 1 and message in errors[0]
    assert not (work["root"] / "never.safetensors").exists()


def test_basis_memory_zero_takes_the_unembed_path_to_the_same_weights(work, caplog):
    """--basis-memory 0 refuses the precomputed logits (the log says so); the weights equal the fast path's."""
    import logging

    fast, slow = work["root"] / "fast.safetensors", work["root"] / "slow.safetensors"
    assert weigh(work, "--out", str(fast), "--steps", "3") == 0
    with caplog.at_level(logging.INFO, logger="jlens_core.fitting.expert_weights"):
        assert weigh(work, "--out", str(slow), "--steps", "3", "--basis-memory", "0") == 0
    assert any("every step unembeds" in r.getMessage() for r in caplog.records)
    a, b = ExpertLens.load(fast), ExpertLens.load(slow)
    for layer in a.source_layers:
        assert torch.allclose(a.layer_weights(layer), b.layer_weights(layer), atol=5e-3)
