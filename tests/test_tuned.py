"""The tuned lens: reading, training, checkpoints, files (ours and tuned-lens's), interventions."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import CORPUS, LONG_TEXT, make_tiny

from jlens_core import LensFileError, LogitLens
from jlens_core.fitting.tuning import heldout_kl, train_tuned_lens
from jlens_core.interventions import token_direction
from jlens_core.lenses.loading import load_lens
from jlens_core.lenses.tuned import TunedLens
from jlens_core.reading.reader import read_prompt

TEXTS = [s for s in (CORPUS + LONG_TEXT).split(". ") if len(s) > 30] * 2
HELDOUT = [LONG_TEXT, CORPUS[:300]]


def random_tuned(model, seed=0) -> TunedLens:
    gen = torch.Generator().manual_seed(seed)
    d = model.d_model
    return TunedLens({layer: (0.2 * torch.randn(d, d, generator=gen), 0.1 * torch.randn(d, generator=gen))
                      for layer in range(model.n_layers - 1)}, d, target_layer=model.n_layers - 1,
                     model_name=model.name, model_fingerprint=model.fingerprint())


def test_zero_translators_read_exactly_as_the_logit_lens(llama):
    tuned = read_prompt(llama, TunedLens.zeros(llama), LONG_TEXT, top_k=5)
    logit = read_prompt(llama, LogitLens.for_model(llama), LONG_TEXT, top_k=5)
    assert tuned.lens_kind == "tuned"
    for attr in ("kl_bits", "entropy_bits", "ce_bits", "top_ids", "top_probs", "final_top1_rank"):
        np.testing.assert_array_equal(getattr(tuned, attr), getattr(logit, attr))


def test_transport_is_h_plus_Ah_plus_b(llama):
    lens = random_tuned(llama)
    h = torch.randn(5, llama.d_model)
    a, b = lens.translators[1]
    torch.testing.assert_close(lens.transport(h, 1), h + h @ a.T + b)
    assert lens.transport(h, lens.target_layer) is h
    with pytest.raises(ValueError, match="this lens is for d_model=32"):
        lens.transport(torch.randn(3, 8), 1)


def test_training_lowers_heldout_kl_at_every_layer(llama):
    logit = heldout_kl(llama, TunedLens.zeros(llama), HELDOUT, skip_first=4)
    lens = train_tuned_lens(llama, TEXTS, steps=30, tokens_per_step=64, lr=1e-3, skip_first=4, heldout_texts=HELDOUT)
    trained = {int(k): v for k, v in lens.metrics["heldout_kl_bits"].items()}
    assert trained == pytest.approx(heldout_kl(llama, lens, HELDOUT, skip_first=4), rel=1e-5)
    for layer in range(llama.n_layers - 1):
        assert trained[layer] < logit[layer], (layer, trained[layer], logit[layer])
    assert len(lens.metrics["history"]) == 30 and lens.settings["steps"] == 30


def test_checkpoint_and_resume_equal_an_uninterrupted_run(llama, tmp_path):
    kwargs = {"tokens_per_step": 48, "lr": 2e-3, "skip_first": 4}
    straight = train_tuned_lens(llama, TEXTS, steps=6, **kwargs)
    ckpt = tmp_path / "t.ckpt"

    def stop_at_3(p):
        if p.step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_tuned_lens(llama, TEXTS, steps=6, checkpoint_path=ckpt, checkpoint_every=100, progress=stop_at_3, **kwargs)
    assert torch.load(ckpt, weights_only=True)["step"] == 3  # Ctrl-C wrote the checkpoint
    resumed = train_tuned_lens(llama, TEXTS, steps=6, checkpoint_path=ckpt, **kwargs)
    for layer in straight.source_layers:
        for x, y in zip(straight.translators[layer], resumed.translators[layer]):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="was made with lr=0.002, this training asks for lr=0.001.*resume=False"):
        train_tuned_lens(llama, TEXTS, steps=8, checkpoint_path=ckpt, tokens_per_step=48, lr=1e-3, skip_first=4)


def test_bad_training_input(llama):
    with pytest.raises(ValueError, match="Zero training tokens"):
        train_tuned_lens(llama, ["hi", "yo"], steps=2)
    with pytest.raises(ValueError, match=r"Layer 7 is out of range: the model has 4 layers \(valid: -4..3\)"):
        train_tuned_lens(llama, TEXTS, steps=2, layers=[7])
    with pytest.raises(ValueError, match="Layer -1 \\(= 3\\) is not below the output layer 3"):
        train_tuned_lens(llama, TEXTS, steps=2, layers=[0, -1])


def test_file_round_trip_and_load_lens(llama, tmp_path):
    lens = random_tuned(llama).replace(metrics={"heldout_kl_bits": {"0": 1.5}})
    path = lens.save(tmp_path / "t.safetensors")
    back = load_lens(str(path), model=llama)
    assert isinstance(back, TunedLens) and back.source_layers == lens.source_layers
    for layer in lens.source_layers:
        assert all(torch.equal(x, y) for x, y in zip(lens.translators[layer], back.translators[layer]))
    assert back.metrics == {"heldout_kl_bits": {"0": 1.5}}
    half = TunedLens.load(lens.save(tmp_path / "h.safetensors", dtype="float16"))
    assert half.translators[0][0].dtype == torch.float32
    torch.testing.assert_close(half.translators[0][0], lens.translators[0][0], rtol=1e-3, atol=1e-4)
    assert (tmp_path / "h.safetensors").stat().st_size < 0.6 * path.stat().st_size
    other = make_tiny("llama", seed=1)
    with pytest.raises(LensFileError, match="unembedding differs"):
        TunedLens.load(path, model=other)
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(path.read_bytes()[:200])
    with pytest.raises(LensFileError, match="cannot be read as a tuned lens"):
        TunedLens.load(truncated)


def write_tuned_lens_folder(folder, model, seed=0):
    """A folder in tuned-lens's format, written here without jlens: ModuleList of Linear, index = hidden_states."""
    torch.manual_seed(seed)
    translators = torch.nn.ModuleList(torch.nn.Linear(model.d_model, model.d_model) for _ in range(model.n_layers))
    folder.mkdir()
    torch.save(translators.state_dict(), folder / "params.pt")
    (folder / "config.json").write_text(json.dumps({"base_model_name_or_path": "tiny", "d_model": model.d_model,
                                                    "num_hidden_layers": model.n_layers, "bias": True,
                                                    "lens_type": "linear_tuned_lens"}))
    return translators


def test_tuned_lens_folder_reads_the_same_numbers(llama, tmp_path):
    translators = write_tuned_lens_folder(tmp_path / "lens", llama)
    lens = load_lens(str(tmp_path / "lens"), model=llama)
    reading = read_prompt(llama, lens, LONG_TEXT, top_k=3)
    ids = llama.encode(LONG_TEXT)
    with torch.no_grad():
        hidden = llama.hf_model(ids, output_hidden_states=True).hidden_states
        for layer in range(llama.n_layers - 1):
            h = hidden[layer + 1][0]  # layer's output = hidden_states[layer + 1] -> translator layer + 1
            logits = llama.unembed(h + translators[layer + 1](h)).float()
            top = logits.topk(3, dim=-1)
            li = reading.layers.index(layer)
            np.testing.assert_array_equal(reading.top_ids[li], top.indices.numpy())
            np.testing.assert_allclose(reading.top_probs[li], logits.softmax(-1).gather(-1, top.indices).numpy(),
                                       rtol=1e-4, atol=1e-6)


def test_tuned_lens_folder_errors(llama, tmp_path):
    other = make_tiny("llama", d_model=64)
    write_tuned_lens_folder(tmp_path / "wide", other)
    with pytest.raises(LensFileError, match="is for 'tiny' \\(d_model 64, 4 layers\\)"):
        TunedLens.load(tmp_path / "wide", model=llama)
    write_tuned_lens_folder(tmp_path / "bad", llama)
    (tmp_path / "bad" / "params.pt").write_bytes(b"not a torch file")
    with pytest.raises(LensFileError, match="is corrupt or not a tuned-lens params file"):
        TunedLens.load(tmp_path / "bad", model=llama)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LensFileError, match="needs config.json and params.pt"):
        TunedLens.load(tmp_path / "empty")


def test_read_direction_of_the_tuned_lens(llama):
    lens = random_tuned(llama)
    token = " capital"
    tid = llama.tokenizer.convert_tokens_to_ids("Ġcapital")
    gamma = llama.hf_model.model.norm.weight.detach()
    u = llama.hf_model.lm_head.weight[tid].detach()
    v = lens.matrix(2).T @ (gamma * u)
    torch.testing.assert_close(token_direction(llama, lens, 2, token), v / v.norm(), rtol=1e-5, atol=1e-6)
