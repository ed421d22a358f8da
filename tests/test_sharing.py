"""Sharing lenses (docs/sharing.md): exports read back by independent readers written here, round trips, J++ files
and reference checkpoints in, and the bad input each path refuses."""

from __future__ import annotations

import csv
import functools

import pytest
import torch
import yaml
from conftest import CORPUS, make_tiny
from helpers import tiny

from jlens_core import JacobianLens
from jlens_core.cli.main import main
from jlens_core.fitting.estimator import jacobian_for_prompt
from jlens_core.fitting.fit import fit
from jlens_core.fitting.reference_checkpoints import checkpoint_from_reference
from jlens_core.lenses.export import REFERENCE_KEYS, export_lens
from jlens_core.lenses.header import LensFileError
from jlens_core.lenses.kinds import lens_kind
from jlens_core.lenses.loading import load_lens
from jlens_core.lenses.tuned import TunedLens

PROMPTS = [CORPUS[i * 37: i * 37 + 260] for i in range(6)]
FIT = {"skip_first": 2, "max_seq_len": 40}


@functools.cache
def fitted() -> JacobianLens:
    """A J lens of the tiny llama, fitted here (halves, canary, diagnostics, provenance)."""
    return fit(tiny("llama"), PROMPTS, **FIT)


@functools.cache
def expert() -> object:
    """A J++ lens of the tiny llama: two experts, learned-looking weights."""
    lens = fit(tiny("llama"), PROMPTS, experts=2, cluster_prompts=3, **FIT)
    return lens.with_weights({layer: torch.tensor([0.6, -0.8]) for layer in lens.source_layers}, items=["x"])


def residuals(model, layer: int) -> torch.Tensor:
    """Layer ``layer``'s output residuals ``[seq, d]`` for a prompt, from HF's own hidden states."""
    ids = model.encode(PROMPTS[0], max_length=24)
    with torch.no_grad():
        return model.hf_model(ids, output_hidden_states=True).hidden_states[layer + 1][0].float()


def reader_logits(model, matrix: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The reference's readout, written here: final norm, then head, of ``J h``."""
    hf = model.hf_model
    with torch.no_grad():
        return hf.lm_head(hf.model.norm(h @ matrix.float().T)).float()


def our_logits(model, lens, h: torch.Tensor, layer: int) -> torch.Tensor:
    with torch.no_grad():
        return model.unembed(lens.transport(h, layer)).float()


def exported_matrices(fmt: str, data: dict) -> dict[int, torch.Tensor]:
    return data["parameters"]["jacobians"] if fmt == "jpp" else data["J"]


@pytest.mark.parametrize("fmt", ["reference", "transformer-lens", "neuronpedia"])
def test_exports_read_by_an_independent_reader_match_our_readings(tmp_path, fmt):
    model, lens = tiny("llama"), fitted()
    result = lens.export(tmp_path, fmt)
    data = torch.load(result.path, map_location="cpu", weights_only=True)  # no code of ours needed
    extra = {"reference": set(), "transformer-lens": {"metadata"}, "neuronpedia": {"provenance"}}[fmt]
    assert set(data) == set(REFERENCE_KEYS) | extra
    assert data["source_layers"] == lens.source_layers and data["d_model"] == lens.d_model
    assert data["n_prompts"] == lens.n_prompts
    for layer in lens.source_layers:
        matrix = data["J"][layer]
        assert matrix.dtype == torch.float16 and tuple(matrix.shape) == (lens.d_model, lens.d_model)
        h = residuals(model, layer)
        theirs, ours = reader_logits(model, matrix, h), our_logits(model, lens, h, layer)
        scale = float(ours.abs().max())
        assert float((theirs - ours).abs().max()) <= 2e-3 * scale  # fp16 rounding of J, nothing more
    assert result.left_out is not None and "split halves" in result.left_out and "canary" in result.left_out


def test_neuronpedia_export_is_the_hub_layout_with_provenance(tmp_path):
    lens = fitted()
    result = lens.export(tmp_path, "neuronpedia", model_id="tiny", dataset="toy-corpus")
    folder = tmp_path / "tiny" / "jlens" / "toy-corpus"
    assert [p.relative_to(folder).as_posix() for p in result.files] == [
        "tiny-llama_jacobian_lens.pt", "tiny-llama_convergence.csv", "config.yaml"]
    provenance = torch.load(result.path, weights_only=True)["provenance"]
    assert provenance["capture_point"] == "block_output" and provenance["stream_reduce"] == "none"
    assert provenance["stream_index"] is None
    import transformers

    assert provenance["jlens"]["provenance"]["transformers"] == transformers.__version__
    with open(folder / "tiny-llama_convergence.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == lens.n_prompts * len(lens.source_layers)  # one row per prompt x layer, from the diagnostics
    assert int(rows[-1]["n_prompts"]) == lens.n_prompts and rows[0]["rel_change"] == ""
    config = yaml.safe_load((folder / "config.yaml").read_text())
    assert config["lens"]["file"] == "tiny-llama_jacobian_lens.pt" and config["fit"]["n_prompts"] == lens.n_prompts
    assert config["lens"]["capture_point"] == "block_output"


@pytest.mark.parametrize("fmt", ["reference", "transformer-lens", "neuronpedia"])
def test_round_trip_export_load_gives_identical_readings(tmp_path, fmt):
    model, lens = tiny("llama"), fitted()
    back = JacobianLens.load(lens.export(tmp_path, fmt).path, model=model)
    rounded = JacobianLens({l: lens.matrix(l).half().float() for l in lens.source_layers}, lens.n_prompts,
                           lens.d_model, target_layer=lens.target_layer)
    for layer in lens.source_layers:
        h = residuals(model, layer)
        assert torch.equal(our_logits(model, back, h, layer), our_logits(model, rounded, h, layer))
    if fmt != "reference":  # these keep our identity: model, target, settings, provenance
        assert back.model_fingerprint == lens.model_fingerprint and back.n_layers == lens.n_layers
        assert back.record.provenance["provenance"] == lens.record.provenance["provenance"]
        assert back.fit_settings.skip_first == FIT["skip_first"]


def test_jpp_export_and_import_round_trip(tmp_path):
    model, lens = tiny("llama"), expert()
    assert lens.kind == "jacobian++"
    result = lens.export(tmp_path / "jpp.pt", "jpp")
    data = torch.load(result.path, weights_only=True)
    assert set(data) == {"parameters", "source_layers", "config"}
    config = data["config"]
    assert config["d_model"] == lens.d_model and config["num_prompts_trained_on"] == lens.n_prompts
    assert config["lrp_mode"] is None and config["relative_end_transport_layer"] == -1
    for layer in lens.source_layers:
        matrix = data["parameters"]["jacobians"][layer]
        assert matrix.dtype == torch.float32 and torch.equal(matrix, lens.matrix(layer))  # fp32: exact
        h = residuals(model, layer)
        torch.testing.assert_close(reader_logits(model, matrix, h), our_logits(model, lens, h, layer))
    assert "expert matrices, clustering and weights" in result.left_out
    back = load_lens(str(result.path), model=model)
    assert lens_kind(back) == "jacobian++" and "cannot be re-weighted" in back.record.provenance["import_note"]
    for layer in lens.source_layers:
        h = residuals(model, layer)
        assert torch.equal(our_logits(model, back, h, layer), our_logits(model, lens, h, layer))


def published_jpp(path, model, *, lrp_mode=None) -> dict[int, torch.Tensor]:
    """A J++ file as published (fp32 maps under parameters.jacobians and the fit's config), written here."""
    gen = torch.Generator().manual_seed(5)
    maps = {layer: torch.randn(model.d_model, model.d_model, generator=gen) for layer in range(model.n_layers - 1)}
    torch.save({"parameters": {"jacobians": maps}, "source_layers": sorted(maps),
                "config": {"d_model": model.d_model, "num_prompts_trained_on": 11, "hf_model_name": "org/tiny",
                           "max_seq_len": 64, "skip_first_n_positions": 4, "lrp_mode": lrp_mode,
                           "relative_end_transport_layer": -1}}, path)
    return maps


def test_a_published_jpp_file_loads_by_path_and_hub_address(tmp_path, monkeypatch):
    from huggingface_hub import constants

    model = tiny("llama")
    maps = published_jpp(tmp_path / "lens.pt", model)
    lens = load_lens(str(tmp_path / "lens.pt"), model=model)
    assert lens_kind(lens) == "jacobian++" and lens.n_prompts == 11 and lens.source_layers == sorted(maps)
    assert lens.fit_settings.skip_first == 4 and lens.fit_settings.max_seq_len == 64
    assert torch.equal(lens.matrix(1), maps[1])
    published_jpp(tmp_path / "r.pt", model, lrp_mode="lrp")
    assert lens_kind(load_lens(str(tmp_path / "r.pt"))) == "relevance++"
    # the same file on the Hub: hf://owner/repo/path, from the cache (offline)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "hub" / "models--koayon--jpp"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("c" * 40)
    (repo / "snapshots" / ("c" * 40) / "tiny").mkdir(parents=True)
    (repo / "snapshots" / ("c" * 40) / "tiny" / "lens.pt").write_bytes((tmp_path / "lens.pt").read_bytes())
    from_hub = load_lens("hf://koayon/jpp/tiny/lens.pt", model=model)
    assert lens_kind(from_hub) == "jacobian++" and torch.equal(from_hub.matrix(2), maps[2])


def test_what_a_format_cannot_hold_is_named_or_refused(tmp_path):
    model, lens = tiny("llama"), fitted()
    with pytest.raises(ValueError, match="The J\\+\\+ layout holds J\\+\\+ and R\\+\\+ lenses.*this is a Jacobian lens"):
        lens.export(tmp_path, "jpp")
    uniform = expert().with_weights(None)
    with pytest.raises(ValueError, match="this is a J-experts lens"):
        uniform.export(tmp_path, "jpp")
    with pytest.raises(ValueError, match="has no fitted matrices J_l"):
        export_lens(TunedLens.zeros(model), tmp_path, "reference")
    with pytest.raises(ValueError, match="Unknown export format 'onnx'"):
        lens.export(tmp_path, "onnx")
    relevance = JacobianLens(lens.jacobians, lens.n_prompts, lens.d_model, target_layer=lens.target_layer,
                             rules="relevance")
    assert "R-lens rules" in relevance.export(tmp_path, "reference").left_out
    short = JacobianLens(lens.jacobians, 1, lens.d_model, target_layer=3, n_layers=6)
    with pytest.raises(ValueError, match="reads every lens as carried to the last layer \\(5\\)"):
        short.export(tmp_path, "reference")
    assert short.export(tmp_path, "transformer-lens").left_out is None  # it records its target
    assert JacobianLens.load(tmp_path / "model_jacobian_lens.tl.pt").target_layer == 3


def test_bad_pt_files_are_refused_in_one_sentence(tmp_path):
    torch.save({"state": torch.zeros(2), "step": 3}, tmp_path / "unknown.pt")
    with pytest.raises(LensFileError, match=r"keys found: state, step\); the layouts known are reference: J, "
                                            r"n_prompts.*jpp: parameters.jacobians.*reference checkpoint"):
        load_lens(str(tmp_path / "unknown.pt"))

    class Code:  # needs a function to unpickle: weights_only refuses it, and so do we
        def __reduce__(self):
            return (print, ("ran",))

    torch.save({"J": {0: torch.eye(2)}, "d_model": 2, "n_prompts": 1, "hook": Code()}, tmp_path / "code.pt")
    with pytest.raises(LensFileError, match="is a pickle that needs code to load .*does not run it"):
        load_lens(str(tmp_path / "code.pt"))
    torch.save({"jacobian_sum": {0: torch.eye(2)}, "n_done": 1, "next_idx": 1}, tmp_path / "ckpt.pt")
    with pytest.raises(LensFileError, match="is a reference fit checkpoint, not a lens: continue it with `jlens fit "
                                            "--resume-from"):
        load_lens(str(tmp_path / "ckpt.pt"))


def test_a_lens_of_another_model_is_refused_by_its_fingerprint(tmp_path):
    other = make_tiny("llama", seed=1)  # same shapes, other weights
    path = fitted().export(tmp_path, "transformer-lens").path
    with pytest.raises(LensFileError, match="whose unembedding differs from that of"):
        JacobianLens.load(path, model=other)
    with pytest.raises(LensFileError, match="whose unembedding differs"):
        fitted().export(tmp_path, "reference", model=other)


# -- reference checkpoints ---------------------------------------------------------------------------------

def reference_checkpoint(path, model, prompts, *, n: int, skip_first: int, max_seq_len: int) -> None:
    """The reference library's fit loop and checkpoint, reimplemented: fp32 sums of each prompt's J_l over the
    first ``n`` prompts, then ``torch.save`` of its six keys."""
    layers, target = list(range(model.n_layers - 1)), model.n_layers - 1
    sums = {layer: torch.zeros(model.d_model, model.d_model) for layer in layers}
    for prompt in prompts[:n]:
        result = jacobian_for_prompt(model, prompt, source_layers=layers, target_layer=target, skip_first=skip_first,
                                     max_seq_len=max_seq_len)
        for layer in layers:
            sums[layer] += result.jacobians[layer].float()
    torch.save({"jacobian_sum": sums, "n_done": n, "next_idx": n, "source_layers": layers, "target_layer": target,
                "skip_first": skip_first}, path)


def test_a_reference_checkpoint_resumes_to_the_uninterrupted_fit(tmp_path):
    from jlens_core.lenses.fit_settings import FitSettings

    model = tiny("llama")
    reference_checkpoint(tmp_path / "ref.pt", model, PROMPTS, n=3, **FIT)
    settings = FitSettings(**FIT)
    assert checkpoint_from_reference(tmp_path / "ref.pt", tmp_path / "fit.ckpt", model, PROMPTS, settings) == 3
    resumed = fit(model, PROMPTS, settings, checkpoint_path=tmp_path / "fit.ckpt")
    whole = fitted()
    assert resumed.n_prompts == whole.n_prompts == len(PROMPTS)
    assert min(r["prompt_index"] for r in resumed.diagnostics) == 3  # the first 3 came from the checkpoint
    for layer in whole.source_layers:
        torch.testing.assert_close(resumed.matrix(layer), whole.matrix(layer), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="was made with skip_first=2, this fit asks for skip_first=3"):
        checkpoint_from_reference(tmp_path / "ref.pt", tmp_path / "b.ckpt", model, PROMPTS, FitSettings(skip_first=3))
    with pytest.raises(ValueError, match="went on at prompt 3 .* this fit has 2 prompts"):
        checkpoint_from_reference(tmp_path / "ref.pt", tmp_path / "c.ckpt", model, PROMPTS[:2], settings)


def test_jlens_fit_resume_from_continues_a_reference_checkpoint(tmp_path, tiny_dir):
    from jlens_core.models.loading import load_model

    model = load_model(tiny_dir, device="cpu")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(PROMPTS))
    reference_checkpoint(tmp_path / "ref.pt", model, PROMPTS, n=2, **FIT)
    common = ["fit", "--model", tiny_dir, "--corpus", str(corpus), "--min-chars", "10", "--split", "all",
              "--skip-first", "2", "--max-seq-len", "40", "--no-progress"]
    assert main([*common, "--out", str(tmp_path / "whole.safetensors")]) == 0
    assert main([*common, "--out", str(tmp_path / "resumed.safetensors"), "--resume-from", str(tmp_path / "ref.pt")]) == 0
    whole, resumed = (JacobianLens.load(tmp_path / f"{name}.safetensors") for name in ("whole", "resumed"))
    assert resumed.n_prompts == whole.n_prompts == len(PROMPTS) and resumed.halves() is None
    assert min(r["prompt_index"] for r in resumed.diagnostics) == 2  # went on from the reference checkpoint
    for layer in whole.source_layers:
        torch.testing.assert_close(resumed.matrix(layer), whole.matrix(layer), rtol=1e-5, atol=1e-6)
    assert whole.record.provenance["provenance"]["capture_point"] == "block_output"
    assert whole.record.provenance["split"] == "all" and whole.record.corpus == str(corpus)


def test_jlens_export_writes_every_format(tmp_path, capsys):
    lens_file = fitted().save(tmp_path / "lens.safetensors")
    for fmt in ("reference", "transformer-lens", "neuronpedia"):
        assert main(["export", str(lens_file), "--format", fmt, "--out", str(tmp_path / fmt), "--model-id", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "tiny-llama_jacobian_lens.pt" in out and "tiny-llama_jacobian_lens.tl.pt" in out and "config.yaml" in out
    assert (tmp_path / "neuronpedia" / "tiny" / "jlens" / "unknown-corpus" / "tiny-llama_convergence.csv").is_file()
    assert main(["export", str(lens_file), "--format", "jpp", "--out", str(tmp_path / "jpp")]) == 2  # one sentence
    assert "The J++ layout holds J++ and R++ lenses" in capsys.readouterr().err
