"""Shared fixtures: tiny randomly initialised models of several families and a tokenizer made here.

Nothing is downloaded. ``make_tiny(family)`` builds a model from a config in this file.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Fits compute in fp32 here, in this process and the CLI and app processes it starts: the checks compare them with
# fp32 computations. "auto" picks bf16 on CPUs with hardware bf16 (fitting.precision); test_cpu_features tests that.
os.environ.setdefault("JLENS_CPU_BF16", "0")

TINY_VOCAB = 300
CORPUS = (
    "The capital of France is Paris. The capital of Italy is Rome. Water boils at one hundred degrees.\n"
    "def add(a, b):\n    return a + b\n"
    "Once upon a time there was a small model that read every layer of itself, one token at a time. "
    "Numbers like 12, 345 and 6789 appear in text; so do symbols: #, @, %, & and *. "
) * 4


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=["<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS], trainer=trainer)
    return tok.to_str()


def make_tokenizer():
    """A byte-level BPE tokenizer (GPT-2 style, ``Ġ`` for spaces) trained on a few lines here."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
                                  bos_token="<|bos|>", eos_token="<|eos|>")
    tok.chat_template = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")
    return tok


# family -> (config class, the fields beyond width, depth and heads); gpt2 names its sizes its own way
_DECODER_FAMILIES = {
    "llama": ("LlamaConfig", {"num_key_value_heads": 2}),
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 2}),
    "qwen3": ("Qwen3Config", {"num_key_value_heads": 2, "head_dim": 8}),
    "mistral": ("MistralConfig", {"num_key_value_heads": 2}),
    "gemma": ("GemmaConfig", {"num_key_value_heads": 2, "head_dim": 8}),
    "gemma2": ("Gemma2Config", {"num_key_value_heads": 2, "head_dim": 8, "final_logit_softcapping": 30.0,
                                "sliding_window": 8}),
    "olmo": ("OlmoConfig", {}),
    "phi": ("PhiConfig", {}),
    "gpt_neox": ("GPTNeoXConfig", {"max_position_embeddings": 256}),
}


def tiny_config(family: str, *, n_layers: int = 4, d_model: int = 32):
    """A transformers config for a tiny model of ``family`` (vocab ``TINY_VOCAB``, 4 heads)."""
    import transformers as tf

    common = {"vocab_size": TINY_VOCAB, "bos_token_id": 0, "eos_token_id": 1}
    heads = 4
    if family in _DECODER_FAMILIES:
        name, extra = _DECODER_FAMILIES[family]
        return getattr(tf, name)(hidden_size=d_model, intermediate_size=2 * d_model, num_hidden_layers=n_layers,
                                 num_attention_heads=heads, **extra, **common)
    if family == "gpt2":
        return tf.GPT2Config(n_embd=d_model, n_layer=n_layers, n_head=heads, n_positions=256, **common)
    if family == "opt":
        return tf.OPTConfig(hidden_size=d_model, ffn_dim=2 * d_model, num_hidden_layers=n_layers,
                            num_attention_heads=heads, word_embed_proj_dim=d_model, max_position_embeddings=256,
                            pad_token_id=2, **common)
    raise ValueError(f"unknown family {family!r}")


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "olmo", "phi", "gpt2", "gpt_neox", "opt")


def make_hf_model(family: str, *, seed: int = 0, **kwargs):
    """A randomly initialised ``*ForCausalLM`` of ``family`` in fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **kwargs), torch_dtype=torch.float32)
    return model.eval()


def make_tiny(family: str = "llama", *, seed: int = 0, **kwargs):
    """An :class:`~jlens_core.HFLensModel` over a tiny random model of ``family`` and the test tokenizer."""
    from jlens_core import HFLensModel

    return HFLensModel(make_hf_model(family, seed=seed, **kwargs), make_tokenizer(), name=f"tiny-{family}")


def save_tiny(folder, family: str = "llama") -> str:
    """Save a tiny random model of ``family`` and the test tokenizer to ``folder``; returns it as a string."""
    make_hf_model(family).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return str(folder)


def pytest_addoption(parser):
    parser.addoption("--conformance", choices=("sample", "full"), default=None,
                     help="tests/test_conformance.py: every causal-LM architecture transformers ships "
                          "(default) or a fixed sample (same as JLENS_CONFORMANCE=sample)")


def pytest_configure(config):
    if config.getoption("--conformance", default=None):
        os.environ["JLENS_CONFORMANCE"] = config.getoption("--conformance")


def pytest_terminal_summary(terminalreporter):
    """The conformance table (architecture | result | reason), when test_conformance ran."""
    import sys

    module = sys.modules.get("test_conformance")
    results = getattr(module, "RESULTS", None)
    if results:
        terminalreporter.write_sep("=", "conformance over causal-LM architectures")
        terminalreporter.write_line(module.table(results))


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    # Tiny models: more threads only add contention (and a CI box may be busy); subprocesses pin theirs.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """A folder holding a tiny llama and the tokenizer (as ``load_model`` reads a local model), per module."""
    return save_tiny(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def llama():
    """The tiny llama of the session (``helpers.tiny("llama")``); tests that change a model build their own."""
    from helpers import tiny

    return tiny("llama")


LONG_TEXT = ("The quick brown fox jumps over the lazy dog while the capital of France is Paris and "
             "water boils at one hundred degrees. Once upon a time there was a small model.")


@pytest.fixture(scope="module")
def tiny_model(tiny_dir):
    """The module's tiny llama loaded as ``load_model`` reads a local folder (the app's tests read it so)."""
    from jlens_core.models.loading import load_model

    return load_model(tiny_dir, device="cpu")


@pytest.fixture(scope="module")
def lens_file(tiny_model, tmp_path_factory) -> str:
    """A lens file fitted on :func:`tiny_model` from three texts (split halves and a canary included)."""
    from jlens_core import fit

    texts = [LONG_TEXT, LONG_TEXT.upper(), " ".join(reversed(LONG_TEXT.split()))]
    lens = fit(tiny_model, texts, skip_first=4, max_seq_len=40)
    return str(lens.save(tmp_path_factory.mktemp("lens") / "tiny.safetensors"))


def free_port() -> int:
    """A TCP port free on localhost now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving(url: str) -> bool:
    """Whether a Streamlit server answers ``ok`` on ``url``'s health endpoint."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as response:
            return response.read().strip() == b"ok"
    except OSError:
        return False


def wait_serving(url: str, proc, timeout: float = 90) -> bool:
    """Wait until the server at ``url`` serves; ``False`` when ``proc`` exits or ``timeout`` passes first."""
    import time

    deadline = time.time() + timeout
    while not serving(url):
        if proc.poll() is not None or time.time() > deadline:
            return False
        time.sleep(0.5)
    return True


def stop(proc, timeout: float = 20) -> None:
    """Stop a server started by a test: SIGTERM, then SIGKILL when it has not exited within ``timeout`` seconds."""
    import subprocess

    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
