"""Sharded and offloaded models (#34 §1, docs/models.md "Sharded and offloaded models"): a tiny model loaded
with an explicit ``device_map`` over ``cpu`` and ``disk`` (accelerate's hooks; offloaded weights are meta
tensors until a forward loads them) gives the numbers of the same model in memory: Jacobians (both rules),
readings, greedy generations, swaps, read directions, tuned training and dumps. Bad settings are one sentence.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import LONG_TEXT, save_tiny
from helpers import random_lens

from jlens_core import Swap, generate, load_model, read_prompt
from jlens_core.cli.main import main
from jlens_core.fitting.estimator import jacobian_for_prompt
from jlens_core.fitting.fused import fused_unsupported_reason
from jlens_core.interventions.read_directions import token_direction
from jlens_core.models.device_maps import PlacementError, parse_device_map, parse_max_memory
from jlens_core.models.placement import HOOKED_FORWARD, is_dispatched, materialised

RTOL = 1e-5
PROMPT = "The capital of France is Paris. The capital of Italy is"

# per family: decoder layers 1 and 3, the final norm and (llama) the head on disk, the rest on the CPU
SPLITS = {
    "llama": {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
              "model.layers.1": "disk", "model.layers.2": "cpu", "model.layers.3": "disk", "model.norm": "disk",
              "lm_head": "disk"},
    "gpt2": {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.h.0": "cpu", "transformer.h.1": "disk",
             "transformer.h.2": "cpu", "transformer.h.3": "disk", "transformer.ln_f": "disk", "lm_head": "cpu"},
}


def rel(a, b) -> float:
    """``||a - b|| / ||b||`` over the entries both have (NaN, e.g. no next token, must sit in the same places)."""
    a, b = (np.array(x.numpy() if isinstance(x, torch.Tensor) else x, dtype=np.float64) for x in (a, b))
    assert (np.isnan(a) == np.isnan(b)).all()
    a, b = a[~np.isnan(b)], b[~np.isnan(b)]
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module", params=sorted(SPLITS))
def pair(request, tmp_path_factory):
    """``(family, in_memory, dispatched, folder)``: the same saved tiny model loaded twice."""
    family = request.param
    folder = save_tiny(tmp_path_factory.mktemp(f"tiny-{family}"), family)
    memory = load_model(folder)
    dispatched = load_model(folder, device_map=SPLITS[family], offload_folder=tmp_path_factory.mktemp("offload"))
    return family, memory, dispatched, folder


def test_the_split_is_real(pair):
    _, memory, dispatched, _ = pair
    assert set(dispatched.hf_model.hf_device_map.values()) == {"cpu", "disk"}
    offloaded = [n for n, p in dispatched.hf_model.named_parameters() if p.device.type == "meta"]
    assert offloaded and any(".1." in n for n in offloaded)  # layer 1's weights wait on disk
    assert is_dispatched(dispatched.hf_model) and not is_dispatched(memory.hf_model)
    assert dispatched.device == torch.device("cpu")  # the embedding's execution device
    assert dispatched.fingerprint() == memory.fingerprint()
    assert fused_unsupported_reason(memory) is None and fused_unsupported_reason(dispatched) is None


@pytest.mark.parametrize("rules", ["jacobian", "relevance"])
def test_jacobian_equals_in_memory(pair, rules):
    _, memory, dispatched, _ = pair
    got = jacobian_for_prompt(dispatched, LONG_TEXT, skip_first=4, rules=rules).jacobians
    want = jacobian_for_prompt(memory, LONG_TEXT, skip_first=4, rules=rules).jacobians
    assert sorted(got) == sorted(want)
    assert max(rel(got[layer], want[layer]) for layer in want) <= RTOL
    # the rules' patches went through the hooks' own forward and are gone: the hooks are intact
    norm = dispatched.final_norm
    assert HOOKED_FORWARD in norm.__dict__ and "forward" in norm.__dict__
    assert norm.__dict__["forward"].func.__name__ == "new_forward"


@pytest.mark.parametrize("rules", ["jacobian", "relevance"])
@pytest.mark.parametrize("layer_major", [True, False])
def test_fused_backward_equals_in_memory(pair, rules, layer_major, monkeypatch):
    # The fused backward runs each layer where it lives and loads an offloaded layer's weights once per
    # backward group: once per layer in the layer-major order, once per chunk of rows in the row-major one.
    from jlens_core.fitting import fused_layouts
    from jlens_core.fitting.estimator import prompt_ids
    from jlens_core.fitting.fused import fused_backward, prepare_layers

    _, memory, dispatched, _ = pair
    ids = prompt_ids(memory, LONG_TEXT, 24)
    sources, target, dim_batch = [0, 1, 2], 3, 12  # 3 chunks of the 32 rows
    want = fused_backward(memory, prepare_layers(memory, ids, 0, target, 4, rules=rules), sources, target,
                          dim_batch, layer_major=layer_major)
    prep = prepare_layers(dispatched, ids, 0, target, 4, rules=rules)
    assert sorted(j for j, c in prep.layers.items() if c.offloaded) == [1, 3]
    loads = []
    plain = fused_layouts.materialised

    def counted(module):
        loads.append(module)
        return plain(module)

    monkeypatch.setattr(fused_layouts, "materialised", counted)
    got = fused_backward(dispatched, prep, sources, target, dim_batch, layer_major=layer_major)
    chunks = 1 if layer_major else 3
    assert len(loads) == 2 * chunks  # layers 1 and 3, the offloaded ones in 1..3
    assert max(rel(got[layer], want[layer]) for layer in sources) <= RTOL
    assert all(p.device.type == "meta" for p in dispatched.layers[1].parameters())  # offloaded again


def test_fit_equals_in_memory(pair, tmp_path):
    from jlens_core import fit

    _, memory, dispatched, _ = pair
    prompts = [LONG_TEXT, PROMPT * 2]
    got = fit(dispatched, prompts, max_seq_len=32, skip_first=4, checkpoint_path=tmp_path / "lens.ckpt")
    want = fit(memory, prompts, max_seq_len=32, skip_first=4)
    assert got.n_prompts == want.n_prompts == 2
    assert max(rel(got.matrix(layer), want.matrix(layer)) for layer in want.source_layers) <= RTOL
    assert got.metadata()["model_fingerprint"] == want.metadata()["model_fingerprint"]


def test_reading_equals_in_memory(pair):
    _, memory, dispatched, _ = pair
    lens = random_lens(memory)
    got = read_prompt(dispatched, lens, LONG_TEXT, pinned=[" capital"]).frame
    want = read_prompt(memory, lens, LONG_TEXT, pinned=[" capital"]).frame
    assert len(got) == len(want) > 0
    for column in ("entropy_bits", "kl_bits", "ce_bits"):
        assert rel(got[column], want[column]) <= RTOL, column
    assert rel(np.stack(got["top_probs"]), np.stack(want["top_probs"])) <= RTOL
    for column in ("top_ids", "next_token_rank", "final_top1_rank"):
        assert [np.asarray(x).tolist() for x in got[column]] == [np.asarray(x).tolist() for x in want[column]], column


def test_greedy_generation_is_identical(pair):
    _, memory, dispatched, _ = pair
    got = generate(dispatched, PROMPT, max_new_tokens=12, stop_at_eos=False)
    want = generate(memory, PROMPT, max_new_tokens=12, stop_at_eos=False)
    assert got.generated_ids.tolist() == want.generated_ids.tolist()
    assert rel(got.top_probs, want.top_probs) <= RTOL


def test_swap_equals_in_memory(pair):
    _, memory, dispatched, _ = pair
    lens = random_lens(memory)
    vocab = memory.vocab_size
    for layer in (1, 2):  # a direction read through the offloaded final norm (and llama's head)
        assert rel(token_direction(dispatched, lens, layer, " capital"),
                   token_direction(memory, lens, layer, " capital")) <= RTOL

    def edited_next_token_logprobs(model):
        swap = Swap(model, lens, " capital", " time", 4.0, layers=[1, 2])
        step = generate(model, PROMPT, max_new_tokens=1, stop_at_eos=False, top_k=vocab, edits=[swap])
        logprobs = np.full(vocab, np.nan)
        logprobs[step.top_ids[0]] = np.log(step.top_probs[0].astype(np.float64))
        return logprobs

    got, want = edited_next_token_logprobs(dispatched), edited_next_token_logprobs(memory)
    clean = generate(memory, PROMPT, max_new_tokens=1, stop_at_eos=False, top_k=vocab)
    assert not np.allclose(np.sort(clean.top_probs[0]), np.sort(np.exp(want)))  # the swap changes the logits
    assert rel(got, want) <= RTOL


def test_tuned_training_equals_in_memory(pair):
    from jlens_core import train_tuned_lens

    _, memory, dispatched, _ = pair
    texts = [LONG_TEXT, PROMPT * 3]
    got = train_tuned_lens(dispatched, texts, steps=3, max_seq_len=32, seed=0)
    want = train_tuned_lens(memory, texts, steps=3, max_seq_len=32, seed=0)
    for layer in want.source_layers:
        for a, b in zip(got.translators[layer], want.translators[layer]):
            assert rel(a, b) <= RTOL


def test_dump_equals_in_memory(pair, tmp_path):
    from jlens_core import diff_dumps, dump_hidden_states

    _, memory, dispatched, _ = pair
    a = dump_hidden_states(dispatched, PROMPT, tmp_path / "dispatched", ops="all")
    b = dump_hidden_states(memory, PROMPT, tmp_path / "memory", ops="all")
    result = diff_dumps(a, b, atol=0.0, rtol=RTOL)
    assert result.matches, result.to_text()


def test_materialised_reads_offloaded_weights(pair):
    _, memory, dispatched, _ = pair
    head = dispatched.final_norm
    assert head.weight.device.type == "meta"
    with materialised(head):
        torch.testing.assert_close(head.weight, memory.final_norm.weight, rtol=0, atol=0)
    assert head.weight.device.type == "meta"  # offloaded again


# -- settings ----------------------------------------------------------------------------------------
def test_settings_are_parsed():
    assert parse_device_map(" auto ") == "auto"
    assert parse_device_map('{"model.layers.0": "cpu", "lm_head": "disk"}') == {"model.layers.0": "cpu",
                                                                                "lm_head": "disk"}
    assert parse_max_memory("cpu:64GiB, disk:1.5GB") == {"cpu": 64 * 2**30, "disk": 1_500_000_000}
    assert parse_device_map(None) is None and parse_max_memory("") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA devices")
def test_bad_settings_are_one_sentence(tiny_dir, tmp_path):
    cases = [
        ({"device": "cuda:3"}, r"^Device 'cuda:3' does not exist: this machine has no CUDA device; use cpu"),
        ({"device_map": {"model.layers.0": "cuda:3"}},
         r"^device_map's device 'cuda:3' for 'model.layers.0' does not exist: this machine has no CUDA device"),
        ({"max_memory": "0:20GiB,cpu:64GiB"}, r"^max_memory's device 'cuda:0' does not exist: this machine has no CUDA"),
        ({"device_map": "sideways"}, r"^device_map 'sideways' is neither a strategy \(auto, balanced"),
        ({"max_memory": "cpu:10KiB"}, (r"^max_memory gives cpu 10\.0 KiB, less than one decoder layer of .* needs "
                                       r"\(36\.2 KiB in float32\): give it at least that, or leave it out\.$")),
        ({"max_memory": "cpu:lots"}, r"^max_memory's size for cpu 'lots' is not a memory size"),
        ({"device_map": {"": "disk"}}, r"^The device map puts modules on 'disk' but no offload folder was given"),
        ({"device_map": "auto", "offload_folder": tmp_path / "a-file" / "sub"},
         r"^The offload folder .* cannot be written \(Not a directory\): choose a folder you can write to"),
        ({"device": "cpu", "device_map": "auto"}, r"^device='cpu' puts the whole model on one device"),
    ]
    if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        cases.append(({"device": "mps"}, r"^Device 'mps' does not exist: MPS \(Apple silicon\) is not available"))
    (tmp_path / "a-file").write_text("")
    for kwargs, message in cases:
        with pytest.raises(PlacementError, match=message) as info:
            load_model(tiny_dir, **kwargs)
        assert str(info.value).count(". ") == 0 and "\n" not in str(info.value), str(info.value)


# -- command line ------------------------------------------------------------------------------------
def test_cli_flags_load_the_split_model(pair, tmp_path, capsys):
    import json

    family, _, _, folder = pair
    split = json.dumps(SPLITS[family])
    flags = ["--device-map", split, "--offload-folder", str(tmp_path / "offload")]
    assert main(["dump", "--model", folder, "--prompt", PROMPT, "--out", str(tmp_path / "a"), *flags]) == 0
    assert main(["dump", "--model", folder, "--prompt", PROMPT, "--out", str(tmp_path / "b")]) == 0
    from jlens_core import diff_dumps

    assert diff_dumps(tmp_path / "a", tmp_path / "b", atol=0.0, rtol=RTOL).matches
    run = json.loads((tmp_path / "a" / "run.json").read_text())
    assert run["extra"]["cli"]["device_map"] == split
    capsys.readouterr()
    code = main(["intervene", "--model", folder, "--lens", "logit", "--prompt", PROMPT, "--swap", " capital: time",
                 "--alpha", "4", "--max-new-tokens", "3", *flags])
    out_split = capsys.readouterr().out
    assert code == 0 and main(["intervene", "--model", folder, "--lens", "logit", "--prompt", PROMPT, "--swap",
                               " capital: time", "--alpha", "4", "--max-new-tokens", "3"]) == 0
    assert out_split == capsys.readouterr().out


def test_cli_bad_flags_exit_2_with_one_sentence(tiny_dir, capsys):
    code = main(["intervene", "--model", tiny_dir, "--prompt", PROMPT, "--swap", " capital: time",
                 "--max-memory", "cpu:lots"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "max_memory's size for cpu 'lots' is not a memory size" in err and "\n" not in err
