"""The drift check (docs/sharing.md): ``refit_check`` / ``jlens check --refit`` catch a model whose rope scaling
changed on some layers since the lens was fitted, and pass the unchanged model."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import CORPUS, make_tiny, save_tiny

from jlens_core.cli.main import main
from jlens_core.fitting.drift import predicted_prompt_error, refit_check
from jlens_core.fitting.fit import fit

PROMPTS = [CORPUS[i * 29: i * 29 + 240] for i in range(8)]
OTHER = [CORPUS[::-1][i * 31: i * 31 + 240] for i in range(4)]  # another corpus: reversed text
FIT = {"skip_first": 2, "max_seq_len": 40}


@functools.cache
def model_and_lens():
    """A tiny llama whose queries and keys are scaled up (sharp attention: which position it attends depends on the
    rotary angles, as in a trained model; a random tiny model attends almost uniformly), and its lens."""
    model = make_tiny("llama", seed=3)
    with torch.no_grad():
        for layer in model.hf_model.model.layers:
            layer.self_attn.q_proj.weight.mul_(16.0)
            layer.self_attn.k_proj.weight.mul_(16.0)
    return model, fit(model, PROMPTS, **FIT)


def without_record(lens):
    """The lens as a file of another library holds it: its matrices and halves, no convergence record."""
    return lens.replace(diagnostics=())


class RopeScaling:
    """Linear rope scaling (positions / ``factor``) on some decoder layers only, as a transformers release that
    applied a rope scaling to the wrong layers would compute: each layer's position embeddings are replaced before
    it runs, from the model's own rotary embedding."""

    def __init__(self, model, layers, factor: float = 4.0) -> None:
        rotary = model.hf_model.model.rotary_emb

        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            positions = kwargs.get("position_ids")
            if positions is None:
                positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
            kwargs["position_embeddings"] = rotary(hidden, positions.float() / factor)
            return args, kwargs

        self.handles = [model.layers[layer].register_forward_pre_hook(hook, with_kwargs=True) for layer in layers]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()


def test_the_unchanged_model_passes():
    model, lens = model_and_lens()
    rows = refit_check(model, lens, PROMPTS[:2], nested=True)  # its own prompts: row by row with its record
    assert rows.exit_code == 0 and rows.compared == "convergence record"
    assert max(row.rel_diff for row in rows.layers) < 1e-5 and rows.layers[0].bound == 1e-3
    bare = without_record(lens)
    same = refit_check(model, bare, PROMPTS, nested=True)  # all its prompts, matrices: only rounding differs
    assert same.exit_code == 0 and same.compared == "matrices" and same.se_from == "file halves"
    assert max(row.rel_diff for row in same.layers) < 1e-4
    fewer = refit_check(model, bare, PROMPTS[:4], nested=True)  # half of them: sampling error, within bounds
    assert fewer.exit_code == 0 and all(row.predicted_se > 0 for row in fewer.layers)
    assert max(row.rel_diff for row in fewer.layers) > 10 * max(row.rel_diff for row in same.layers)
    other = refit_check(model, lens, OTHER, nested=False)  # another corpus: matrices, wider bounds
    assert other.exit_code == 0 and other.compared == "matrices"
    assert "Within sampling error at every layer" in other.message
    told_wrong = refit_check(model, lens, OTHER, nested=True)  # "its own corpus", but its record's texts differ
    assert told_wrong.compared == "matrices" and not told_wrong.nested and told_wrong.exit_code == 0


def test_rope_scaling_changed_on_some_layers_is_caught():
    model, lens = model_and_lens()
    with RopeScaling(model, layers=[1, 2]):
        changed = refit_check(model, lens, PROMPTS[:2], nested=True)  # two prompts, compared row by row
        assert changed.exit_code == 1 and changed.compared == "convergence record"
        bad = changed.first_out_of_bounds
        assert bad is not None and bad.layer == 0 and bad.rel_diff > bad.bound
        assert changed.message.startswith("Out of bounds from layer 0:")
        by_matrices = refit_check(model, without_record(lens), PROMPTS, nested=True)
        assert by_matrices.exit_code == 1 and by_matrices.first_out_of_bounds.layer == 0
    assert refit_check(model, lens, PROMPTS[:2], nested=True).exit_code == 0  # hooks gone: it passes again


def test_the_predicted_error_follows_the_split_half_formula():
    _, lens = model_and_lens()
    table = lens.half_diagnostics()
    per_prompt = predicted_prompt_error(lens)
    for row in table.itertuples():
        assert per_prompt[row.layer] == pytest.approx(row.predicted_rel_se * (row.n_even + row.n_odd) ** 0.5)


def test_jlens_check_refit_exit_codes(tmp_path):
    good = save_tiny(tmp_path / "model")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(PROMPTS))
    lens = tmp_path / "lens.safetensors"
    assert main(["fit", "--model", good, "--corpus", str(corpus), "--min-chars", "10", "--skip-first", "2",
                 "--max-seq-len", "40", "--split", "all", "--no-progress", "--out", str(lens)]) == 0
    check = ["check", str(lens), "--refit", "4", "--min-chars", "10"]
    assert main([*check, "--model", good]) == 0
    # the same weights but block 1's MLP scaled: the head (and so the fingerprint) unchanged, the Jacobians not
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(good)
    with torch.no_grad():
        hf.model.layers[1].mlp.down_proj.weight.mul_(3.0)
    hf.save_pretrained(tmp_path / "changed")
    (tmp_path / "changed" / "tokenizer.json").write_bytes((tmp_path / "model" / "tokenizer.json").read_bytes())
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (tmp_path / "model" / name).exists():
            (tmp_path / "changed" / name).write_bytes((tmp_path / "model" / name).read_bytes())
    assert main([*check, "--model", str(tmp_path / "changed")]) == 1
    assert main([*check[:3], "1", "--min-chars", "10", "--model", good]) == 0  # one prompt: its record row suffices
    assert main([*check[:3], "0", "--model", good]) == 2


def test_each_prompt_records_the_hash_of_its_text():
    import hashlib

    _, lens = model_and_lens()
    hashes = {r["prompt_index"]: r["prompt_hash"] for r in lens.diagnostics if "prompt_hash" in r}
    assert hashes == {i: hashlib.sha256(text.encode() + b"\x00").hexdigest()[:12] for i, text in enumerate(PROMPTS)}
