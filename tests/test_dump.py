"""Hidden-state dumps and first-divergence diffs (issue #9)."""

from __future__ import annotations

import importlib
import json
import sys
import types

import numpy as np
import pytest
import torch
from conftest import make_hf_model, make_tiny, make_tokenizer

from jlens_core.debugging.diff import diff_dumps, divergence_curve
from jlens_core.debugging.dump import MANIFEST, RUN_FILE, dump_hidden_states, load_dump
from jlens_core.models.recorder import ActivationRecorder

PROMPT = "The capital of France is Paris. Once upon a time there was a small model."


def _n_hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.hf_model.modules())


@pytest.fixture(scope="module")
def base_dump(llama, tmp_path_factory):
    return dump_hidden_states(llama, PROMPT, tmp_path_factory.mktemp("dumps") / "base", ops="all")


# -- the format ----------------------------------------------------------------------------------

def test_dump_format_and_values(llama, tmp_path):
    before = _n_hooks(llama)
    out = dump_hidden_states(llama, PROMPT, tmp_path / "d", ops="residual,attn", layers=[1, -1],
                             extra_settings={"note": "x"})
    assert _n_hooks(llama) == before  # hooks exist only during the dump
    dump = load_dump(out)
    assert [(e.step, e.layer, e.op) for e in dump.entries] == [
        (0, -1, "embed"), (1, 1, "attn"), (2, 1, "residual"), (3, 3, "attn"), (4, 3, "residual"),
        (5, 4, "final_norm")]
    assert [e.file for e in dump.entries][:2] == ["0000_embed.f32", "0001_L001_attn.f32"]
    lines = [json.loads(line) for line in (out / MANIFEST).read_text().splitlines()]
    assert set(lines[1]) >= {"step", "layer", "op", "shape", "dtype", "bytes", "file", "sha256"}
    assert lines[1]["dtype"] == "float32" and lines[1]["bytes"] == 4 * np.prod(lines[1]["shape"])
    run = json.loads((out / RUN_FILE).read_text())
    ids = llama.encode(PROMPT)
    assert run["token_ids"] == ids[0].tolist() and run["text"] == PROMPT
    assert run["model"]["name"] == "tiny-llama" and run["model"]["fingerprint"] == llama.fingerprint()
    assert run["dtype"] == "float32" and run["device"] == "cpu" and run["extra"] == {"note": "x"}
    assert {"torch", "transformers", "jlens"} <= set(run["versions"])
    # values: the residual is the decoder layer's output, final_norm is what forward returns
    with torch.no_grad(), ActivationRecorder(llama.layers, [3]) as rec:
        final = llama.forward(ids)
    assert np.array_equal(dump.array(3, "residual"), rec.activations[3][0].numpy())
    assert np.array_equal(dump.array(4, "final_norm"), final[0].numpy())
    assert dump.array(1, "attn").shape == (ids.shape[1], llama.d_model)


def test_dump_token_ids_and_errors(llama, tmp_path):
    ids = llama.encode(PROMPT)[0].tolist()
    dump = load_dump(dump_hidden_states(llama, ids, tmp_path / "ids", ends=False, max_length=5))
    assert dump.token_ids == ids[:5] and dump.run["text"] is None
    assert {e.op for e in dump.entries} == {"residual"}
    with pytest.raises(ValueError, match="holds a dump"):
        dump_hidden_states(llama, ids, tmp_path / "ids")
    dump_hidden_states(llama, ids, tmp_path / "ids", layers=[0], overwrite=True)
    assert sorted(p.name for p in (tmp_path / "ids").glob("*.f32")) == [
        "0000_embed.f32", "0001_L000_residual.f32", "0002_final_norm.f32"]
    with pytest.raises(ValueError, match="Unknown op 'mpl'"):
        dump_hidden_states(llama, ids, tmp_path / "x", ops="residual,mpl")
    with pytest.raises(ValueError, match="Layer 9 is out of range"):
        dump_hidden_states(llama, ids, tmp_path / "x", layers=[9])
    with pytest.raises(ValueError, match=r"\[seq\] or \[1, seq\]"):
        dump_hidden_states(llama, torch.zeros(2, 3, dtype=torch.long), tmp_path / "x")


def test_hooks_removed_when_forward_fails(llama, tmp_path):
    def boom(module, args, output):
        raise RuntimeError("boom")

    before = _n_hooks(llama)
    handle = llama.layers[2].register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            dump_hidden_states(llama, PROMPT, tmp_path / "failed", ops="all")
    finally:
        handle.remove()
    assert _n_hooks(llama) == before
    assert not list((tmp_path / "failed").iterdir())  # no partial dump left behind


def test_layout_without_mlp_path_is_skipped(tmp_path):
    dump = load_dump(dump_hidden_states(make_tiny("opt"), PROMPT, tmp_path / "opt", ops="all"))
    assert "mlp" not in {e.op for e in dump.entries} and dump.run["not_dumped"] == ["mlp"]
    assert {"attn", "residual", "embed", "final_norm"} == {e.op for e in dump.entries}


# -- diffs -----------------------------------------------------------------------------------------

def test_identical_runs_match(llama, base_dump, tmp_path):
    other = dump_hidden_states(llama, PROMPT, tmp_path / "again", ops="all")
    result = diff_dumps(other, base_dump, atol=0, rtol=0)
    assert result.matches and result.first_divergence is None
    assert (result.table["max_abs_err"] == 0).all() and result.table["first_bad_position"].isna().all()
    assert list(result.table["step"]) == sorted(result.table["step"])
    assert len(result.table) == 1 + 3 * llama.n_layers + 1
    assert "match: every tensor is within tolerance" in result.to_text()


def test_perturbed_layer_is_reported_first(base_dump, tmp_path):
    perturbed = make_tiny("llama")  # same seed: same weights as the fixture
    with torch.no_grad():
        perturbed.layers[2].mlp.down_proj.weight[:, :4] += 1e-2
    result = diff_dumps(dump_hidden_states(perturbed, PROMPT, tmp_path / "w", ops="all"), base_dump)
    div = result.first_divergence
    assert not result.matches and (div.layer, div.op) == (2, "mlp")
    before = result.table[result.table["step"] < div.step]
    assert before["within_tolerance"].all() and (before["max_abs_err"] == 0).all()
    assert not result.table.set_index(["layer", "op"]).loc[(2, "residual"), "within_tolerance"]

    # a hook adding a small value to one attention output, at the last position only
    def nudge(module, args, output):
        out = output[0].clone()
        out[:, -1] += 1e-3
        return (out,) + tuple(output[1:])

    model = make_tiny("llama")
    handle = model.layers[1].self_attn.register_forward_hook(nudge)
    try:
        out = dump_hidden_states(model, PROMPT, tmp_path / "h", ops="all")
    finally:
        handle.remove()
    result = diff_dumps(out, base_dump)
    n_tokens = result.n_tokens
    assert (result.first_divergence.layer, result.first_divergence.op) == (1, "attn")
    assert result.first_divergence.position == n_tokens - 1
    row = result.table.set_index(["layer", "op"]).loc[(1, "attn")]
    assert row["n_bad_positions"] == 1 and row["max_abs_err"] == pytest.approx(1e-3, rel=1e-2)


def test_fp32_vs_fp64_curve(tmp_path):
    model = make_tiny("llama", n_layers=6)
    a = dump_hidden_states(model, PROMPT, tmp_path / "fp32", ops="all")
    model.hf_model.double()
    b = dump_hidden_states(model, PROMPT, tmp_path / "fp64", ops="all")
    assert load_dump(b).run["dtype"] == "float64"
    strict = diff_dumps(a, b, atol=0, rtol=0)
    assert not strict.matches and strict.settings["dtype"] == ("float32", "float64")
    assert strict.table.set_index(["layer", "op"]).loc[(-1, "embed"), "max_abs_err"] == 0  # exact lookup
    curve = divergence_curve(strict)
    assert list(curve["layer"]) == list(range(6))
    errs = curve["max_abs_err"].to_numpy()
    assert (errs > 0).all() and (errs < 1e-5).all() and (curve["max_rel_err"] < 1e-5).all()
    assert errs[-1] >= errs[0]
    assert diff_dumps(a, b).matches  # within the default tolerance
    with pytest.raises(ValueError, match="no op 'mpl'"):
        divergence_curve(strict, op="mpl")


def test_different_tokens_is_a_clear_error(llama, base_dump, tmp_path):
    other = dump_hidden_states(llama, PROMPT.replace("Paris", "Rome"), tmp_path / "rome", ops="all")
    with pytest.raises(ValueError, match="not of the same tokens: they first differ at position"):
        diff_dumps(other, base_dump)
    short = dump_hidden_states(llama, PROMPT, tmp_path / "short", max_length=4)
    with pytest.raises(ValueError, match="prefix"):
        diff_dumps(short, base_dump)


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_damaged_dumps_give_clear_errors(base_dump, tmp_path):
    entry = load_dump(base_dump).entries[5]

    truncated = _copy(base_dump, tmp_path / "truncated")
    data = (truncated / entry.file).read_bytes()
    (truncated / entry.file).write_bytes(data[:-7])
    with pytest.raises(ValueError, match=rf"{entry.file}.*truncated"):
        diff_dumps(truncated, base_dump)

    altered = _copy(base_dump, tmp_path / "altered")
    (altered / entry.file).write_bytes(bytes([data[0] ^ 1]) + data[1:])
    with pytest.raises(ValueError, match=rf"{entry.file}.*sha256"):
        load_dump(altered)

    missing = _copy(base_dump, tmp_path / "missing")
    (missing / entry.file).unlink()
    with pytest.raises(ValueError, match=rf"{entry.file}.*missing"):
        load_dump(missing)

    cut = _copy(base_dump, tmp_path / "cut_manifest")
    lines = (cut / MANIFEST).read_text().splitlines(keepends=True)
    (cut / MANIFEST).write_text("".join(lines[:-1]))
    with pytest.raises(ValueError, match="truncated"):
        load_dump(cut)
    (cut / MANIFEST).write_text("".join(lines[:-1]) + lines[-1][:20])
    with pytest.raises(ValueError, match=rf"line {len(lines)} is not a valid manifest entry"):
        load_dump(cut)

    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a complete jlens dump"):
        load_dump(tmp_path / "empty")
    with pytest.raises(FileNotFoundError):
        load_dump(tmp_path / "nowhere")


# -- the CLI ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-model")
    make_hf_model("llama").save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def cli_main():
    """``jlens_core.cli.main.main``, with a folder-only stand-in for ``load_model`` while loading.py is missing."""
    from jlens_core.cli.main import main

    with pytest.MonkeyPatch.context() as mp:
        try:
            importlib.import_module("jlens_core.models.loading")
        except ModuleNotFoundError:
            def load_model(spec, *, device=None, dtype=None):
                from transformers import AutoModelForCausalLM, AutoTokenizer

                from jlens_core import HFLensModel

                hf = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype or torch.float32)
                return HFLensModel(hf.to(device or "cpu"), AutoTokenizer.from_pretrained(spec))

            mp.setitem(sys.modules, "jlens_core.models.loading", types.SimpleNamespace(load_model=load_model))
        yield main


@pytest.fixture(scope="module")
def cli_dumps(cli_main, model_dir, tmp_path_factory):
    """Two CLI dumps of different prompts: ``a`` (PROMPT) and ``rome``."""
    tmp = tmp_path_factory.mktemp("cli-dumps")
    common = ["--model", str(model_dir), "--out"]
    assert cli_main(["dump", *common, str(tmp / "a"), "--prompt", PROMPT]) == 0
    assert cli_main(["dump", *common, str(tmp / "rome"), "--prompt", PROMPT.replace("Paris", "Rome")]) == 0
    return tmp


def test_cli_dump_and_diff(cli_main, model_dir, tmp_path, capsys):
    base = ["--model", str(model_dir), "--prompt", PROMPT, "--ops", "all"]
    assert cli_main(["dump", *base, "--out", str(tmp_path / "a")]) == 0
    assert "Wrote 14 tensors" in capsys.readouterr().out
    assert cli_main(["dump", *base, "--out", str(tmp_path / "b"), "--layers", "0:4"]) == 0
    assert cli_main(["dump", *base, "--out", str(tmp_path / "c"), "--dtype", "float64"]) == 0
    run = json.loads((tmp_path / "c" / RUN_FILE).read_text())
    assert run["dtype"] == "float64" and run["extra"]["cli"]["model"] == str(model_dir)
    capsys.readouterr()

    assert cli_main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "match: every tensor is within tolerance" in capsys.readouterr().out
    report = tmp_path / "diff.json"
    assert cli_main(["diff", str(tmp_path / "a"), str(tmp_path / "c"), "--atol", "0", "--rtol", "0",
                     "--json", str(report)]) == 1
    out = capsys.readouterr().out
    assert "first divergence: step 1, layer 0 attn" in out and "dtype: A=float32  B=float64" in out
    data = json.loads(report.read_text())
    assert data["matches"] is False and data["first_divergence"]["op"] == "attn" and len(data["rows"]) == 14


@pytest.mark.parametrize("argv", [
    ["diff", "{tmp}/a", "{tmp}/nowhere"],
    ["diff", "{tmp}/a", "{tmp}/rome"],
    ["dump", "--model", "{model}", "--prompt", "hi", "--out", "{tmp}/x", "--layers", "0:9"],
    ["dump", "--model", "{model}", "--prompt", "hi", "--out", "{tmp}/x", "--layers", "zero"],
    ["dump", "--model", "{model}", "--prompt", "hi", "--out", "{tmp}/x", "--ops", "resid"],
    ["dump", "--model", "{model}", "--prompt", "hi", "--out", "{tmp}/a"],
])
def test_cli_bad_input_exits_2_without_traceback(cli_main, cli_dumps, model_dir, tmp_path, capsys, argv):
    capsys.readouterr()
    argv = [a.format(tmp=cli_dumps, model=model_dir) for a in argv]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # (a loader may draw a progress bar above it)
    assert "Traceback" not in err and last.startswith(f"jlens {argv[0]}: error: ")
