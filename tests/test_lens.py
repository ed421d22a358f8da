"""Lens objects (docs/method.md §4): transport, save/load, reference-library files, merge, clear file errors."""

from __future__ import annotations

import functools
import json
import warnings

import pytest
import torch
from conftest import LONG_TEXT, make_hf_model, make_tokenizer, tiny_config
from helpers import random_lens, tiny
from safetensors import safe_open
from safetensors.torch import save_file

from jlens_core import HFLensModel, JacobianLens, LensFileError, LogitLens, fit
from jlens_core.models.recorder import ActivationRecorder

PROMPTS = [LONG_TEXT, "The capital of Italy is Rome. Water boils at one hundred degrees, so they say."]


@functools.cache
def fitted() -> JacobianLens:
    return fit(tiny(), PROMPTS, skip_first=2, max_seq_len=16, dim_batch=16)


# A lens of no model: N(0, 1) matrices, 8 wide, layers 0-2, three prompts.
plain_lens = functools.partial(random_lens, d=8, eye=0, noise=1.0, n_prompts=3)


# -- reading ------------------------------------------------------------------------------------------
def test_transport_is_j_times_h_over_the_last_axis():
    lens = plain_lens()
    h = torch.randn(2, 5, 8)
    out = lens.transport(h, 1)
    assert out.shape == h.shape
    torch.testing.assert_close(out, torch.einsum("ij,bpj->bpi", lens.jacobians[1], h))
    torch.testing.assert_close(out[1, 3], lens.jacobians[1] @ h[1, 3])
    assert lens.transport(h.double(), 1).dtype == torch.float64
    assert torch.equal(lens.transport(h, 3), h)  # the target layer: identity
    assert lens.layers == [0, 1, 2, 3] and lens.source_layers == [0, 1, 2]
    with pytest.raises(KeyError, match=r"fitted at layers \[0, 1, 2\], not at layer 5"):
        lens.transport(h, 5)
    with pytest.raises(ValueError, match="width 7"):
        lens.transport(torch.randn(7), 0)


def test_shrinkage_moves_towards_the_identity():
    lens = plain_lens()
    half = lens.with_shrinkage(0.5)
    h = torch.randn(4, 8)
    torch.testing.assert_close(half.transport(h, 0), 0.5 * lens.transport(h, 0) + 0.5 * h)
    torch.testing.assert_close(lens.with_shrinkage(1.0).transport(h, 2), h)
    with pytest.raises(ValueError, match="alpha=1.5"):
        lens.with_shrinkage(1.5)


def test_logit_lens_is_the_identity():
    lens = LogitLens.for_model(tiny())
    h = torch.randn(3, 32)
    assert torch.equal(lens.transport(h, 0), h) and lens.layers == [0, 1, 2, 3]
    assert lens.target_layer == 3 and lens.d_model == 32


def test_constructor_checks_shapes():
    with pytest.raises(ValueError, match=r"layer 1 has shape \(8, 7\), expected \(8, 8\)"):
        JacobianLens({0: torch.eye(8), 1: torch.zeros(8, 7)}, 1, 8)
    with pytest.raises(ValueError, match="at least one layer"):
        JacobianLens({}, 1, 8)


def test_fitted_lens_decodes_through_unembed_and_is_the_model_at_the_target():
    model = tiny()
    lens = fitted()
    assert lens.source_layers == [0, 1, 2] and lens.target_layer == 3 and lens.n_prompts == 2
    ids = model.encode(LONG_TEXT, max_length=12)
    with torch.no_grad(), ActivationRecorder(model.layers, range(4)) as rec:
        logits = model.hf_model(input_ids=ids, use_cache=False).logits
    with torch.no_grad():
        at_target = model.unembed(lens.transport(rec.activations[3], 3))
        at_one = model.unembed(lens.transport(rec.activations[1], 1))
    torch.testing.assert_close(at_target, logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(at_one, model.unembed(rec.activations[1] @ lens.jacobians[1].T))


# -- files ----------------------------------------------------------------------------------------
def test_save_load_round_trip_fp32_is_exact(tmp_path):
    lens = fitted()
    path = lens.save(tmp_path / "sub" / "lens.safetensors")
    assert path.is_file() and list(path.parent.iterdir()) == [path]  # no temp file left behind
    back = JacobianLens.load(path)
    assert back.source_layers == lens.source_layers
    for layer in lens.source_layers:
        assert back.jacobians[layer].dtype == torch.float32
        assert torch.equal(back.jacobians[layer], lens.jacobians[layer])
    assert (back.n_prompts, back.d_model, back.target_layer, back.n_layers) == (2, 32, 3, 4)
    assert back.model_name == "tiny-llama"
    assert back.model_fingerprint == tiny().fingerprint()
    assert back.settings_dict() == json.loads(json.dumps(lens.settings_dict()))
    assert back.fit_settings == lens.fit_settings and back.record == lens.record
    assert back.skip_first == 2 and back.fit_settings.max_seq_len == 16
    assert back.diagnostics == lens.diagnostics and len(back.diagnostics) == 2 * 3
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["jlens"])
        # the lens's own matrices, its split halves under their prefix (docs/method.md §3.3) and the fit's canary (§4.2)
        assert sorted(k for k in f.keys() if not k.startswith("canary.")) == [  # noqa: SIM118
            "J.0", "J.1", "J.2", *[f"half.{h}.J.{k}" for h in ("even", "odd") for k in range(3)]]
        assert sorted(k for k in f.keys() if k.startswith("canary.")) == [  # noqa: SIM118
            "canary.jacobian", "canary.param_norms", "canary.probes", "canary.residuals"]
    assert meta["format"] == "jlens" and meta["format_version"] == 1
    assert meta["source_layers"] == [0, 1, 2] and meta["target_layer"] == 3
    JacobianLens.load(path, model=tiny())  # its own model is accepted


def test_save_fp16_is_within_2e_3_and_stored_as_fp16(tmp_path):
    lens = fitted()
    path = lens.save(tmp_path / "lens16.safetensors", dtype="float16")
    with safe_open(str(path), framework="pt") as f:
        assert f.get_tensor("J.0").dtype == torch.float16
    back = JacobianLens.load(path)
    for layer in lens.source_layers:
        assert back.jacobians[layer].dtype == torch.float32
        torch.testing.assert_close(back.jacobians[layer], lens.jacobians[layer], rtol=2e-3, atol=2e-3)
    bare = lens.with_shrinkage(0.0)
    bare = bare.replace(canary=None)  # the matrices' storage alone: a tiny model's canary is as large as its matrices
    assert (bare.save(tmp_path / "b16", dtype="float16").stat().st_size
            < 0.6 * bare.save(tmp_path / "b32").stat().st_size)


def test_save_fp16_overflow_falls_back_to_fp32_with_a_warning(tmp_path):
    mats = {0: torch.eye(4), 1: torch.eye(4) * 1e5}
    lens = JacobianLens(mats, 1, 4)
    with pytest.warns(UserWarning, match=r"beyond float16's range .*storing float32 instead"):
        path = lens.save(tmp_path / "big.safetensors", dtype=torch.float16)
    with safe_open(str(path), framework="pt") as f:
        assert f.get_tensor("J.1").dtype == torch.float32
    back = JacobianLens.load(path)
    assert torch.equal(back.jacobians[1], mats[1]) and torch.isfinite(back.jacobians[1]).all()
    # in range: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        JacobianLens({0: torch.eye(4) * 6e4}, 1, 4).save(tmp_path / "ok.safetensors", dtype="fp16")
    with pytest.raises(ValueError, match="not supported"):
        lens.save(tmp_path / "x.safetensors", dtype="bfloat16")


def test_load_reference_library_format_dict_and_stacked(tmp_path):
    gen = torch.Generator().manual_seed(3)
    mats = {1: torch.randn(6, 6, generator=gen), 3: torch.randn(6, 6, generator=gen)}
    torch.save({"J": mats, "n_prompts": 7, "source_layers": [1, 3], "d_model": 6}, tmp_path / "dict.pt")
    torch.save({"J": torch.stack([mats[1], mats[3]]), "n_prompts": 7, "source_layers": [1, 3], "d_model": 6},
               tmp_path / "stacked.pt")
    for name in ("dict.pt", "stacked.pt"):
        lens = JacobianLens.load(tmp_path / name)
        assert lens.source_layers == [1, 3] and lens.n_prompts == 7 and lens.d_model == 6
        for layer in (1, 3):
            assert torch.equal(lens.jacobians[layer], mats[layer])
        h = torch.randn(6)
        torch.testing.assert_close(lens.transport(h, 3), mats[3] @ h)
    # and it is a lens like any other: it saves to the jlens format
    back = JacobianLens.load(JacobianLens.load(tmp_path / "dict.pt").save(tmp_path / "converted.safetensors"))
    assert torch.equal(back.jacobians[3], mats[3])


def test_reference_file_is_loaded_with_weights_only(tmp_path):
    class Evil:  # unpickles by calling a function: weights_only must refuse it
        def __reduce__(self):
            return (sorted, ([2, 1],))

    torch.save({"J": {0: torch.eye(2)}, "n_prompts": 1, "source_layers": [0], "d_model": 2, "x": Evil()},
               tmp_path / "evil.pt")
    with pytest.raises(LensFileError, match="is a pickle that needs code to load .*weights_only=True only"):
        JacobianLens.load(tmp_path / "evil.pt")


def test_file_errors_are_clear(tmp_path):
    good = fitted().save(tmp_path / "good.safetensors")
    data = good.read_bytes()

    (tmp_path / "trunc.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(LensFileError, match="truncated or not safetensors"):
        JacobianLens.load(tmp_path / "trunc.safetensors")
    (tmp_path / "header-only.safetensors").write_bytes(data[:5])
    with pytest.raises(LensFileError, match="truncated or not safetensors"):
        JacobianLens.load(tmp_path / "header-only.safetensors")

    save_file({"weight": torch.zeros(3, 3)}, str(tmp_path / "foreign.safetensors"), metadata={"format": "pt"})
    with pytest.raises(LensFileError, match="a safetensors file but not a jlens lens"):
        JacobianLens.load(tmp_path / "foreign.safetensors")

    (tmp_path / "notes.txt").write_text("hello, not a lens at all\n")
    with pytest.raises(LensFileError, match="not a readable lens file"):
        JacobianLens.load(tmp_path / "notes.txt")

    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(LensFileError, match=r"in no lens layout jlens knows \(keys found: weights\)"):
        JacobianLens.load(tmp_path / "other.pt")
    ref = tmp_path / "ref.pt"
    torch.save({"J": {0: torch.eye(4)}, "n_prompts": 1, "source_layers": [0], "d_model": 4}, ref)
    (tmp_path / "ref-trunc.pt").write_bytes(ref.read_bytes()[:200])
    with pytest.raises(LensFileError, match="not a readable lens file"):
        JacobianLens.load(tmp_path / "ref-trunc.pt")

    with pytest.raises(FileNotFoundError, match="No lens file"):
        JacobianLens.load(tmp_path / "missing.safetensors")
    assert issubclass(LensFileError, ValueError)


def test_lens_for_another_model_is_refused(tmp_path):
    path = fitted().save(tmp_path / "lens.safetensors")
    other_seed = tiny("llama", seed=1)  # same shapes, another unembedding
    with pytest.raises(LensFileError, match=r"fitted on 'tiny-llama', whose unembedding differs"):
        JacobianLens.load(path, model=other_seed)
    wider = tiny("llama", d_model=48)
    with pytest.raises(LensFileError, match=r"d_model=32 .*has d_model=48"):
        JacobianLens.load(path, model=wider)
    shallower = tiny("llama", n_layers=3)
    with pytest.raises(LensFileError, match=r"target layer 3 .*3 layers"):
        JacobianLens.load(path, model=shallower)
    # the same weights in another dtype are the same model
    half = HFLensModel(make_hf_model("llama").half(), make_tokenizer(), name="tiny-llama")
    assert JacobianLens.load(path, model=half).n_prompts == 2
    assert tiny_config("llama").hidden_size == 32


# -- merge ----------------------------------------------------------------------------------------
def test_merge_is_the_n_prompts_weighted_mean():
    a, b = plain_lens(n_prompts=1, seed=0), plain_lens(n_prompts=3, seed=1)
    merged = JacobianLens.merge([a, b])
    assert merged.n_prompts == 4 and merged.source_layers == [0, 1, 2]
    for layer in (0, 1, 2):
        torch.testing.assert_close(merged.jacobians[layer], (a.jacobians[layer] + 3 * b.jacobians[layer]) / 4)
    single = JacobianLens.merge([a])
    assert torch.equal(single.jacobians[0], a.jacobians[0])


def test_merge_refuses_mismatched_lenses():
    base = plain_lens(settings={"skip_first": 2})
    with pytest.raises(ValueError, match="layers"):
        JacobianLens.merge([base, plain_lens(layers=(0, 1), settings={"skip_first": 2})])
    with pytest.raises(ValueError, match="widths 8 and 6"):
        JacobianLens.merge([base, plain_lens(d=6, settings={"skip_first": 2})])
    with pytest.raises(ValueError, match="different skip_first: 2 vs 4"):
        JacobianLens.merge([base, plain_lens(settings={"skip_first": 4})])
    with pytest.raises(ValueError, match="different models"):
        JacobianLens.merge([plain_lens(settings={"skip_first": 2}, model_fingerprint=tiny().fingerprint()),
                            plain_lens(settings={"skip_first": 2},
                                        model_fingerprint=tiny("llama", seed=1).fingerprint())])
    with pytest.raises(ValueError, match="at least one lens"):
        JacobianLens.merge([])
