"""The model adapter (docs/method.md §5): layouts, unembed, eval/frozen, chat, fingerprint."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, LONG_TEXT, make_hf_model, make_tokenizer
from helpers import tiny
from torch import nn

from jlens_core import HFLensModel, LensModel
from jlens_core.models.layouts import LAYOUTS, ModelLayout
from jlens_core.models.model import same_fingerprint
from jlens_core.models.recorder import ActivationRecorder

EXPECTED_LAYOUT = {"llama": "llama-like", "qwen2": "llama-like", "qwen3": "llama-like", "mistral": "llama-like",
                   "gemma": "llama-like", "gemma2": "llama-like", "olmo": "llama-like", "phi": "phi",
                   "gpt2": "gpt2", "gpt_neox": "gpt-neox", "opt": "opt"}


@pytest.mark.parametrize("family", FAMILIES)
def test_unembed_of_last_layer_output_is_the_logits(family):
    model = tiny(family)
    assert model.layout.name == EXPECTED_LAYOUT[family]
    assert (model.n_layers, model.d_model, model.vocab_size) == (4, 32, 300)
    assert len(model.layers) == 4
    ids = model.encode(LONG_TEXT, max_length=20)
    with torch.no_grad(), ActivationRecorder(model.layers, [model.n_layers - 1]) as rec:
        logits = model.hf_model(input_ids=ids, use_cache=False).logits
    last = rec.activations[model.n_layers - 1]
    assert last.shape == (1, 20, 32)
    with torch.no_grad():
        got = model.unembed(last)
    assert got.shape == logits.shape
    torch.testing.assert_close(got, logits, rtol=1e-5, atol=1e-5)
    # forward() is the decoder stack without the head: the head reads it
    with torch.no_grad():
        hidden = model.forward(ids)
    assert hidden.shape == (1, 20, 32)
    if model.softcap is None:
        torch.testing.assert_close(model.head(hidden), logits, rtol=1e-5, atol=1e-5)


def test_gemma2_soft_capping_is_applied():
    model = tiny("gemma2")
    assert model.softcap == 30.0
    h = torch.randn(3, 32) * 50
    with torch.no_grad():
        logits = model.unembed(h)
        raw = model.head(model.final_norm(h))
    assert logits.abs().max() < 30.0
    torch.testing.assert_close(logits, 30.0 * torch.tanh(raw / 30.0))


def test_unembed_casts_to_the_model_dtype():
    model = tiny("llama")
    out = model.unembed(torch.randn(2, 32, dtype=torch.float64))
    assert out.dtype == torch.float32 and out.shape == (2, 300)


def test_model_is_put_in_eval_mode_with_frozen_parameters():
    hf = make_hf_model("llama")
    hf.train()
    hf.requires_grad_(True)
    model = HFLensModel(hf, make_tokenizer())
    assert not hf.training and not any(m.training for m in hf.modules())
    assert not any(p.requires_grad for p in hf.parameters())
    assert "eval mode" in HFLensModel.__doc__ and "frozen" in HFLensModel.__doc__
    assert isinstance(model, LensModel)


def test_unknown_layout_error_lists_what_was_looked_for():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4, 4)])
            self.out = nn.Linear(4, 10)

    with pytest.raises(ValueError, match="Cannot find the decoder layers") as info:
        HFLensModel(Odd(), None)
    message = str(info.value)
    assert "Odd" in message and "layout=ModelLayout" in message
    for layout in LAYOUTS:
        assert layout.name in message and layout.layers in message and layout.head in message


def test_explicit_layout_and_language_model_wrapper():
    inner = make_hf_model("llama")

    class Wrapper(nn.Module):  # a multimodal model: the text part sits under model.language_model
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.language_model = inner.model
            self.lm_head = inner.lm_head
            self.config = inner.config

    wrapped = HFLensModel(Wrapper(), make_tokenizer(), name="wrapped")
    assert wrapped.layout.name == "multimodal-language-model"
    assert wrapped.layers == list(inner.model.layers) and wrapped.final_norm is inner.model.norm
    # the same parts through an explicit layout
    layout = ModelLayout("custom", base="model.language_model", layers="model.language_model.layers",
                         final_norm="model.language_model.norm", embed="model.language_model.embed_tokens",
                         head="lm_head")
    explicit = HFLensModel(Wrapper(), make_tokenizer(), layout=layout, name="explicit")
    assert explicit.layout is layout and explicit.n_layers == 4
    ids = explicit.encode(LONG_TEXT, max_length=10)
    with torch.no_grad():
        torch.testing.assert_close(explicit.head(explicit.forward(ids)), inner(input_ids=ids).logits)
    broken = ModelLayout("broken", "model.nothing", "model.nothing.layers", None, "lm_head", "lm_head")
    with pytest.raises(ValueError, match=r"Layout 'broken' does not match Wrapper: nothing found at "
                                         r"base='model.nothing', layers='model.nothing.layers'\."):
        HFLensModel(Wrapper(), None, layout=broken)
    no_head = ModelLayout("no-head", "model.language_model", "model.language_model.layers", None,
                          "model.language_model.embed_tokens", "output")
    with pytest.raises(ValueError, match=r"nothing found at head='output'"):
        HFLensModel(Wrapper(), None, layout=no_head)


def test_encode_and_decode():
    model = tiny("llama")
    ids = model.encode(LONG_TEXT, max_length=12)
    assert ids.dtype == torch.long and ids.shape == (1, 12)
    full = model.encode(LONG_TEXT)
    assert full.shape[1] > 12 and torch.equal(full[:, :12], ids)
    assert model.decode(full) == LONG_TEXT
    assert model.decode(int(full[0, 0])) == model.decode([int(full[0, 0])])
    with pytest.raises(ValueError, match="empty"):
        model.encode("")


def test_chat_applies_the_template():
    model = tiny("llama")
    assert model.chat("What is 2+2?") == "<|bos|>user\nWhat is 2+2?<|eos|>\n<|bos|>assistant\n"
    assert model.chat("Hi", system="Be brief.", assistant_prefill="The answer") == (
        "<|bos|>system\nBe brief.<|eos|>\n<|bos|>user\nHi<|eos|>\n<|bos|>assistant\nThe answer")
    tok = make_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        HFLensModel(make_hf_model("llama"), tok, name="plain").chat("Hi")


def test_name_defaults_and_repr():
    model = HFLensModel(make_hf_model("gpt2"), make_tokenizer())
    assert model.name  # config._name_or_path or the class name
    assert "gpt2" in repr(model) and "n_layers=4" in repr(model)
    assert tiny("gpt2").name == "tiny-gpt2"


def test_fingerprint_is_stable_across_dtype_and_tells_models_apart():
    fp32 = HFLensModel(make_hf_model("llama"), make_tokenizer(), name="a")
    fp16 = HFLensModel(make_hf_model("llama").half(), make_tokenizer(), name="a")
    bf16 = HFLensModel(make_hf_model("llama").to(torch.bfloat16), make_tokenizer(), name="a")
    other = HFLensModel(make_hf_model("llama", seed=1), make_tokenizer(), name="b")
    a = fp32.fingerprint()
    assert a == fp32.fingerprint()
    assert a["vocab_size"] == 300 and a["d_model"] == 32
    assert same_fingerprint(a, fp16.fingerprint()) and same_fingerprint(a, bf16.fingerprint())
    assert not same_fingerprint(a, other.fingerprint())
    assert not same_fingerprint(a, tiny("llama").fingerprint() | {"vocab_size": 301})


def test_loads_in_several_threads_at_once_all_succeed(tmp_path):
    """transformers loads under process-wide patches (meta-device init, tied weights): without load_model's
    lock, four threads loading at once (the app's warm-up and a page) failed with meta tensors every time."""
    import threading

    from conftest import make_tokenizer, tiny_config
    from transformers import AutoModelForCausalLM

    from jlens_core.models.loading import load_model

    config = tiny_config("llama")
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    reference = load_model(str(tmp_path), device="cpu").hf_model.state_dict()
    outcomes: list[object] = []

    def load() -> None:
        try:
            weights = load_model(str(tmp_path), device="cpu").hf_model.state_dict()
            outcomes.append(all(torch.equal(weights[k], reference[k]) for k in reference))
        except Exception as exc:  # noqa: BLE001 - the failure is what this test looks for
            outcomes.append(repr(exc))

    for _ in range(3):
        threads = [threading.Thread(target=load) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert outcomes == [True] * 12, outcomes
