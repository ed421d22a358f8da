"""The lens check (docs/method.md §4.2): a lens's forward canary catches a changed model and passes the same one."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import make_hf_model, make_tiny, make_tokenizer
from helpers import identity_lens, tiny

from jlens_core import JacobianLens, fit
from jlens_core.cli.main import main
from jlens_core.lenses.canary import CANARY_TEXT, check_lens, make_canary, read_canary, write_canary

PROMPTS = ["The capital of Italy is Rome. Water boils at one hundred degrees, and numbers like 12 appear.",
           "Numbers like 12, 345 and 6789 appear in text; so do symbols: #, @, %, & and *. The end."]
SETTINGS = {"skip_first": 2, "max_seq_len": 16, "dim_batch": 16}


@functools.cache
def fitted() -> JacobianLens:
    return fit(tiny(), PROMPTS, **SETTINGS)


def test_fit_attaches_a_canary_of_its_model():
    lens, model = fitted(), tiny()
    canary = lens.canary
    assert canary is not None and canary.token_ids == model.encode(CANARY_TEXT)[0].tolist()
    assert canary.residuals.shape == (model.n_layers, len(canary.positions), model.d_model)
    assert (canary.source_layer, canary.target_layer) == (lens.source_layers[0], lens.target_layer)
    assert canary.jacobian.shape == (canary.probes.shape[0], len(canary.positions), model.d_model)
    assert set(canary.versions) == {"transformers", "torch", "jlens"} and canary.dtype == "float32"
    # the residuals are the model's own hidden states (an independent path: HF's output_hidden_states)
    ids = torch.tensor([canary.token_ids])
    with torch.no_grad():
        hidden = model.hf_model(ids, output_hidden_states=True).hidden_states
    for layer in range(model.n_layers - 1):  # HF's last entry is after the final norm
        torch.testing.assert_close(canary.residuals[layer], hidden[layer + 1][0, canary.positions])


def test_canary_jacobian_is_the_probed_jacobian():
    model, canary = tiny(), fitted().canary
    ids = torch.tensor([canary.token_ids])
    s, t = canary.source_layer, canary.target_layer
    with torch.no_grad():
        hidden = model.hf_model(ids, output_hidden_states=True).hidden_states
    h_s = hidden[s + 1][0].clone().requires_grad_(True)  # [seq, d]

    def run_from_source(h):  # the layers above s by hand, HF's own modules
        positions = torch.arange(h.shape[0])[None]
        emb = model.hf_model.model.rotary_emb(h[None], positions)
        mask = torch.full((h.shape[0], h.shape[0]), float("-inf")).triu(1)[None, None]
        x = h[None]
        for layer in model.layers[s + 1: t + 1]:
            out = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=emb)
            x = out[0] if isinstance(out, tuple) else out
        return x[0]

    with torch.enable_grad():
        summed = run_from_source(h_s).sum(0)  # [d]
        for j in range(canary.probes.shape[0]):
            (grad,) = torch.autograd.grad(summed @ canary.probes[j], h_s, retain_graph=True)
            torch.testing.assert_close(canary.jacobian[j], grad[canary.positions], rtol=1e-4, atol=1e-6)


def test_unchanged_model_passes():
    result = check_lens(tiny(), fitted())
    assert result.status == "same" and result.ok and result.exit_code == 0
    assert all(part.difference == 0.0 for part in result.parts)
    assert result.message.startswith("Still the lens of tiny-llama")


def test_norm_weight_scaled_fails_naming_the_layer():
    model = make_tiny()
    with torch.no_grad():
        model.layers[2].input_layernorm.weight.mul_(1.01)
    result = check_lens(model, fitted())
    assert result.status == "changed" and result.exit_code == 1
    failed = {part.part: part for part in result.failed}
    assert failed["weights fingerprint"].first_layer == 2
    assert "model.layers.2.input_layernorm.weight" in failed["weights fingerprint"].detail
    assert failed["residuals"].first_layer == 2  # layers 0 and 1 are untouched
    assert "Jacobian" in failed
    assert "layer 2" in result.message and "Versions then" in result.message


def test_attention_output_perturbed_fails_naming_the_layer():
    model = make_tiny()
    attention = model.layers[1].self_attn
    handle = attention.register_forward_hook(lambda module, args, out: (out[0] * 1.01, *out[1:]))
    try:
        result = check_lens(model, fitted())
    finally:
        handle.remove()
    failed = {part.part: part for part in result.failed}
    assert result.status == "changed"
    assert "weights fingerprint" not in failed  # no weight changed: only the forward did
    assert failed["residuals"].first_layer == 1
    assert "residual first differs at layer 1" in result.message


def test_lens_without_canary_is_reported_not_failed(tmp_path):
    lens = identity_lens(tiny())
    result = check_lens(tiny(), lens, lens_name="old.safetensors")
    assert result.status == "no canary" and result.exit_code == 0
    assert "jlens check old.safetensors --write-canary" in result.message


def test_canary_survives_save_and_load(tmp_path):
    lens = fitted()
    path = lens.save(tmp_path / "lens.safetensors", dtype="float16")
    loaded = JacobianLens.load(path)
    assert loaded.canary is not None
    torch.testing.assert_close(loaded.canary.residuals, lens.canary.residuals, rtol=0, atol=0)
    assert loaded.canary.param_names == lens.canary.param_names
    assert check_lens(tiny(), loaded).status == "same"
    assert loaded.metadata() == JacobianLens.load(path).metadata()  # the lens's own metadata has no canary


def test_write_canary_keeps_the_matrices_bit_for_bit(tmp_path):
    from safetensors import safe_open

    plain = identity_lens(tiny())
    path = plain.save(tmp_path / "old.safetensors", dtype="float16")
    with safe_open(str(path), framework="pt") as f:
        before, meta_before = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118
    assert read_canary(path) is None
    write_canary(path, make_canary(tiny(), plain))
    with safe_open(str(path), framework="pt") as f:
        after, meta_after = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor)
    assert {k: v for k, v in meta_after.items() if k != "jlens_canary"} == meta_before
    assert check_lens(tiny(), JacobianLens.load(path)).status == "same"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny model folder, the same model with one norm weight x1.01, and a lens fitted on the first."""
    root = tmp_path_factory.mktemp("check")
    same, changed = root / "same", root / "changed"
    make_hf_model("llama").save_pretrained(same)
    make_tokenizer().save_pretrained(same)
    hf = make_hf_model("llama")
    with torch.no_grad():
        hf.model.layers[2].post_attention_layernorm.weight.mul_(1.01)
    hf.save_pretrained(changed)
    make_tokenizer().save_pretrained(changed)
    fitted().save(root / "lens.safetensors")
    identity_lens(tiny()).save(root / "old.safetensors")
    return root


def test_cli_check(folders, capsys):
    lens, old = str(folders / "lens.safetensors"), str(folders / "old.safetensors")
    assert main(["check", lens, "--model", str(folders / "same")]) == 0
    assert "Still the lens of" in capsys.readouterr().out
    assert main(["check", lens, "--model", str(folders / "changed")]) == 1
    out = capsys.readouterr().out
    assert "post_attention_layernorm" in out and "layer 2" in out and "Versions then" in out
    assert main(["check", old, "--model", str(folders / "same")]) == 0
    assert f"jlens check {old} --write-canary" in capsys.readouterr().out
    assert main(["check", old, "--model", str(folders / "same"), "--write-canary"]) == 0
    capsys.readouterr()
    assert main(["check", old, "--model", str(folders / "changed")]) == 1
    assert main(["check", "logit", "--model", str(folders / "same")]) == 2


def test_merge_keeps_a_canary():
    lens = fitted()
    bare = lens.with_shrinkage(0.0)
    bare = bare.replace(canary=None)  # a slice saved before canaries existed
    merged = JacobianLens.merge([bare, lens])
    assert merged.canary is lens.canary
    assert check_lens(tiny(), merged).status == "same"


def test_a_parameter_on_one_side_only_is_left_out():
    import dataclasses

    canary = fitted().canary
    fewer = dataclasses.replace(canary, param_names=canary.param_names[1:], param_layers=canary.param_layers[1:],
                                param_norms=canary.param_norms[1:])  # as if offloaded (meta) at fit time
    lens = fitted().with_shrinkage(0.0)
    lens = lens.replace(canary=fewer)
    result = check_lens(tiny(), lens)
    weights = next(p for p in result.parts if p.part == "weights fingerprint")
    assert result.status == "same" and "1 parameter(s) on one side only" in weights.detail


def test_a_16_bit_check_is_coarse_but_catches_edited_weights():
    model = make_tiny()
    model.hf_model.to(torch.bfloat16)
    result = check_lens(model, fitted())  # a float32 canary
    assert result.status == "same" and "coarse check in bfloat16" in result.message
    with torch.no_grad():
        model.layers[2].input_layernorm.weight.mul_(1.01)
    failed = {p.part: p for p in check_lens(model, fitted()).failed}
    assert failed["weights fingerprint"].first_layer == 2
