"""Expert weights learned from labelled items (docs/method.md §9.1; jlens_core.fitting.expert_weights and
jlens_core.evaluation.labelled_items) on the tiny llama with an expert lens built from random matrices: the
surrogate against a computation from HF's own hidden states, the exact macro against pass@k of the combined
lens read through passk, unit norms, the kept iterate, the split and the errors; the fast path (the logit
basis) against unembed on llama (RMSNorm), gpt2 (LayerNorm with a bias) and gemma2 (1 + w gain, soft-cap),
a padded, scaled head with a bias, its budget and its self-check."""

from __future__ import annotations

import json
import logging
import math
import random

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import make_tiny
from torch import nn

from jlens_core.evaluation.labelled_items import read_labelled_items
from jlens_core.evaluation.passk import macro_mean, pass_at_k
from jlens_core.fitting.expert_weights import (
    STARTS,
    ItemBatch,
    basis_bytes,
    heldout_score,
    intermediate_ranks,
    layer_logits,
    layer_std,
    layer_surrogate,
    learn_expert_weights,
    macro_pass_at_k,
    split_items,
    surrogate_terms,
)
from jlens_core.lenses.experts import Clustering, ExpertLens

N_EXPERTS = 4
# single tokens of the test tokenizer (conftest.CORPUS), so scorable; "zebra" is not: unscored
WORDS = ["the", "and", "capital", "is", "of", "one", "time", "at", "a", "b", "s", "t"]
PROMPTS = ["The capital of France is", "Once upon a time there was", "def add(a, b):", "Numbers like 12 and",
           "Water boils at one", "a small model that read every", "symbols: #, @, %", "The capital of Italy",
           "one token at a time", "there was a small"]


def expert_lens(model, seed: int = 0, counts=(100, 80, 60, 10)) -> ExpertLens:
    """An expert lens of ``model`` from random matrices: pooled ``I + 0.3 N``, experts pooled ``+ 0.5 N``;
    the last expert has 10 positions, so it falls back to the pooled matrix."""
    gen = torch.Generator().manual_seed(seed)
    d, layers = model.d_model, range(model.n_layers - 1)
    pooled = {layer: torch.eye(d) + 0.3 * torch.randn(d, d, generator=gen) for layer in layers}
    experts = {layer: pooled[layer] + 0.5 * torch.randn(N_EXPERTS, d, d, generator=gen) for layer in layers}
    clustering = {layer: Clustering(torch.zeros(d), torch.eye(d)[:4], torch.randn(N_EXPERTS, 4, generator=gen))
                  for layer in layers}
    return ExpertLens(pooled, experts, {layer: torch.tensor(counts) for layer in layers}, clustering, 10, d,
                      target_layer=model.n_layers - 1, n_layers=model.n_layers, model_name=model.name,
                      model_fingerprint=model.fingerprint())


def write_sets(folder) -> dict[str, list[dict]]:
    """Two sets of 20 items (two intermediates each; a few unscored words) as ``folder/alpha.json`` and ``beta.json``."""
    rng = random.Random(0)
    sets = {}
    for name in ("alpha", "beta"):
        items = [{"name": f"{name}_{i}", "prompt": f"{text} {i % 3}",
                  "intermediates": rng.sample(WORDS, 2) + (["zebra"] if i % 5 == 0 else [])}
                 for i, text in enumerate(PROMPTS * 2)]
        (folder / f"{name}.json").write_text(json.dumps({"items": items}))
        sets[name] = items
    return sets


@pytest.fixture(scope="module")
def work(tmp_path_factory, llama):
    folder = tmp_path_factory.mktemp("weights")
    sets = write_sets(folder)
    lens = expert_lens(llama)
    paths = [str(folder / f"{name}.json") for name in sets]
    items = read_labelled_items(llama, paths, lens.source_layers)
    return {"folder": folder, "sets": sets, "paths": paths, "lens": lens, "items": items}


@pytest.fixture(scope="module")
def learned(work, llama):
    train, heldout = split_items(work["items"], 0.5, seed=0)
    return train, heldout, learn_expert_weights(llama, work["lens"], train, steps=12)


def hand_spellings(tokenizer, word: str) -> list[int]:
    """Token ids of the word's complete single-token spellings (as written, lower-cased, capitalised; with and
    without a leading space), computed here from the tokenizer alone."""
    ids = set()
    for form in {word, word.lower(), word.capitalize()}:
        for text in (form, " " + form):
            encoded = tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) == 1 and tokenizer.decode(encoded) == text:
                ids.add(encoded[0])
    return sorted(ids)


def test_surrogate_against_hf_hidden_states(work, llama):
    """sigmoid((best candidate logit - 10th largest logit) / (0.1 x the row's population std)), per scored
    intermediate, from HF's hidden states at the last token, the combined matrix and the model's norm and head."""
    lens, model = work["lens"], llama
    weights = torch.tensor([0.5, -0.2, 0.7, 0.1])
    batch = ItemBatch.build({layer: lens.expert_matrices(layer) for layer in lens.source_layers}, work["items"])
    for layer in lens.source_layers:
        ours = surrogate_terms(layer_logits(model, batch, layer, weights), batch).double()
        expected = []
        for items in work["sets"].values():
            for item in items:
                ids = model.encode(item["prompt"])
                with torch.no_grad():
                    hidden = model.hf_model(ids, output_hidden_states=True).hidden_states[layer + 1][0, -1]
                    x = lens.combined(layer, weights) @ hidden
                    logits = model.hf_model.lm_head(model.final_norm(x)).double().numpy()
                tenth = np.sort(logits)[::-1][9]
                for word in item["intermediates"]:
                    cands = hand_spellings(model.tokenizer, word)
                    if cands:
                        margin = logits[cands].max() - tenth
                        expected.append(1 / (1 + math.exp(-margin / (0.1 * logits.std()))))
        assert len(expected) == len(ours)
        assert np.allclose(ours.numpy(), expected, atol=1e-5)


def combined_pass_at_k(model, lens, weights, items, sets, vocab="all") -> dict[int, float]:
    """macro_mean of passk's pass@k, per set, of the one-matrix Jacobian lens of ``weights`` on ``items``."""
    combined = lens.with_weights(weights, ["x"]).to_jacobian_lens()
    frames = []
    for name, set_items in sets.items():
        chosen = [set_items[item.index] for item in items if item.set_name == name]
        frame = pass_at_k(model, {"combined": combined}, chosen, k=(1, 5, 10), vocab=vocab)
        frames.append(frame.assign(set=name))
    table = macro_mean(pd.concat(frames))
    return {int(k): float(v) for k, v in zip(table["k"], table["pass_rate"])}


@pytest.mark.parametrize("vocab", ["all", "word"])
def test_exact_macro_equals_pass_at_k_of_the_combined_lens(work, llama, vocab):
    lens = work["lens"]
    items = work["items"] if vocab == "all" else read_labelled_items(llama, work["paths"], lens.source_layers,
                                                                     vocab=vocab)
    gen = torch.Generator().manual_seed(1)
    weights = {layer: torch.randn(N_EXPERTS, generator=gen) for layer in lens.source_layers}
    unit = {layer: w / w.norm() for layer, w in weights.items()}
    ours = macro_pass_at_k(llama, {layer: lens.expert_matrices(layer) for layer in lens.source_layers}, items, unit)
    expected = combined_pass_at_k(llama, lens, weights, items, work["sets"], vocab=vocab)
    assert ours == pytest.approx(expected, abs=1e-12)
    assert 0 < ours[10] < 1  # neither empty nor saturated: the comparison can fail


def test_every_iterate_has_unit_rows_and_the_starts_are_as_specified(learned, work):
    _, _, fit = learned
    assert [h["start"] for h in fit.history] == [s for s in STARTS for _ in range(13)]
    for entry in fit.history:
        assert torch.allclose(entry["weights"].norm(dim=1), torch.ones(len(work["lens"].source_layers)), atol=1e-6)
    first = {h["start"]: h["weights"] for h in fit.history if h["step"] == 0}
    assert torch.allclose(first["uniform"], torch.full_like(first["uniform"], 0.5))
    assert ((first["best_expert"] == 1).sum(1) == 1).all() and ((first["best_expert"] == 0).sum(1) == 3).all()
    assert torch.allclose(first["top3"].sort(dim=1).values,
                          torch.tensor([0.0] + [3 ** -0.5] * 3).expand_as(first["top3"]))
    moved = [h for h in fit.history if h["step"] == 12]
    assert all(not torch.equal(h["weights"], first[h["start"]]) for h in moved)


def test_the_kept_iterate_has_the_best_exact_macro_of_the_three_starts(learned, work, llama):
    train, _, fit = learned
    best = max(h["macro"] for h in fit.history)
    first_best = next(h for h in fit.history if h["macro"] == best)
    assert (fit.start, fit.step) == (first_best["start"], first_best["step"])
    assert fit.macro[10] == pytest.approx(best, abs=1e-12)
    layers = work["lens"].source_layers
    assert torch.equal(torch.stack([fit.weights[layer] for layer in layers]), first_best["weights"])
    # the history's macro is the exact one: recomputed through passk for the kept weights and another iterate
    assert combined_pass_at_k(llama, work["lens"], fit.weights, train, work["sets"])[10] == pytest.approx(best)
    other = fit.history[5]
    other_weights = {layer: other["weights"][i] for i, layer in enumerate(layers)}
    assert combined_pass_at_k(llama, work["lens"], other_weights, train, work["sets"])[10] == \
        pytest.approx(other["macro"])
    assert fit.items == [item.key for item in train if item.scored]


def test_the_split_is_by_prompt_disjoint_seeded_and_deterministic(work):
    items = work["items"]
    train, heldout = split_items(items, 0.5, seed=0)
    assert len(train) + len(heldout) == len(items)
    assert not {i.prompt for i in train} & {i.prompt for i in heldout}  # alpha and beta share prompts
    assert not {i.key for i in train} & {i.key for i in heldout}
    again = split_items(list(reversed(items)), 0.5, seed=0)
    assert {i.key for i in again[1]} == {i.key for i in heldout}
    assert {i.key for i in split_items(items, 0.5, seed=1)[1]} != {i.key for i in heldout}
    scores = [heldout_score(f"prompt {i}", 0) for i in range(2000)]
    assert abs(np.mean(np.array(scores) < 0.3) - 0.3) < 0.05  # about the asked fraction is held out
    for fraction in (0, 1, -0.5, 1.5):
        with pytest.raises(ValueError, match="strictly between 0 and 1"):
            split_items(items, fraction)
    with pytest.raises(ValueError, match="leaves no training item"):
        split_items(items[:1], 0.999999)


def test_items_are_read_with_the_passk_protocol(work):
    items = work["items"]
    assert [i.key for i in items[:2]] == ["alpha:0", "alpha:1"] and items[20].key == "beta:0"
    assert all(len(i.candidates) == 2 for i in items)  # "zebra" is unscored: left out
    assert items[0].residuals.shape == (len(work["lens"].source_layers), 32)


def test_errors_are_one_sentence(work, llama, tmp_path):
    lens = work["lens"]
    bad = tmp_path / "unscorable.json"
    bad.write_text(json.dumps({"items": [{"prompt": "The capital", "intermediates": ["zebra"]}]}))
    with pytest.raises(ValueError, match="has no scorable item"):
        read_labelled_items(llama, [str(bad)], lens.source_layers)
    with pytest.raises(FileNotFoundError, match="No evaluation set 'no_such_set'"):
        read_labelled_items(llama, ["no_such_set"], lens.source_layers)
    with pytest.raises(ValueError, match="not in \\[0, 3\\)"):
        read_labelled_items(llama, work["paths"], [3])
    unscored = [i for i in work["items"] if not i.scored] or [
        type(work["items"][0])(**{**work["items"][0].__dict__, "candidates": (), "final_ranks": torch.zeros(0)})]
    with pytest.raises(ValueError, match="has a scorable intermediate"):
        learn_expert_weights(llama, lens, unscored, steps=1)


# -- the fast path: the logit basis ------------------------------------------------------------------------------
def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|`` in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def expert_matrices(lens) -> dict:
    return {layer: lens.expert_matrices(layer) for layer in lens.source_layers}


@pytest.fixture(scope="module", params=["llama", "gpt2", "gemma2"])
def family(request, work):
    """A tiny model of the family with a random final-norm gain (and bias), so a misread gain or bias shows;
    its expert lens and its items."""
    model = make_tiny(request.param, seed=1)
    with torch.no_grad():
        model.final_norm.weight.normal_(0.0 if request.param == "gemma2" else 1.0, 0.5)  # Gemma: gain 1 + w
        if getattr(model.final_norm, "bias", None) is not None:
            model.final_norm.bias.normal_(0.0, 0.5)
    lens = expert_lens(model, seed=2)
    items = read_labelled_items(model, work["paths"], lens.source_layers)
    return {"name": request.param, "model": model, "lens": lens, "items": items}


def both_paths(model, batches, layer, weights):
    """Per batch: (logits, the std layer_std gives, the surrogate objective's gradient in the weights)."""
    out = []
    for batch in batches:
        w = weights.clone().requires_grad_(True)
        logits = layer_logits(model, batch, layer, w)
        std = layer_std(model, batch, layer, w)
        terms = surrogate_terms(logits, batch, std=std)
        (grad,) = torch.autograd.grad((batch.inter_weight.float() * terms).sum(), w)
        out.append((logits.detach(), std, grad))
    return out


def test_the_logit_basis_gives_unembeds_logits_spread_and_gradients(family):
    model, lens = family["model"], family["lens"]
    fast = ItemBatch.build(expert_matrices(lens), family["items"], model=model)
    slow = ItemBatch.build(expert_matrices(lens), family["items"], model=model, basis_budget=0)
    assert fast.basis is not None and slow.basis is None
    assert (fast.basis.offset is not None) == (family["name"] == "gpt2")  # W b: the LayerNorm's bias
    assert bool(model.softcap) == (family["name"] == "gemma2")
    gen = torch.Generator().manual_seed(3)
    for layer in lens.source_layers:
        for weights in (torch.randn(N_EXPERTS, generator=gen), torch.tensor([1.0, -0.5, 0.0, 0.25])):
            (got, std, grad), (want, no_std, want_grad) = both_paths(model, (fast, slow), layer, weights)
            assert got.shape == want.shape == (len(fast.keys), model.vocab_size)
            assert rel_max(got, want) < 1e-5
            assert no_std is None
            if model.softcap:
                assert std is None  # soft-capped logits: the spread is computed from them
            else:
                assert std is not None and rel_max(std, want.std(dim=-1, correction=0)) < 1e-5
            assert want_grad.norm() > 0 and rel_max(grad, want_grad) < 1e-4


@pytest.mark.parametrize("vocab", ["all", "word"])
def test_the_surrogate_from_the_basis_columns_has_the_dense_values_and_gradient(family, work, vocab):
    """layer_surrogate's sparse backward (the basis's columns at the k-th largest and best candidate ids) against
    surrogate_terms of the full logits, unembedded (the slow path): the same terms, gradient and exact ranks
    (those in the batch's buffers), with either readout."""
    model, lens = family["model"], family["lens"]
    items = family["items"] if vocab == "all" else read_labelled_items(model, work["paths"], lens.source_layers,
                                                                        vocab=vocab)
    fast = ItemBatch.build(expert_matrices(lens), items, model=model)
    slow = ItemBatch.build(expert_matrices(lens), items, model=model, basis_budget=0)
    assert (fast.kept is None) == (vocab == "all")
    gen = torch.Generator().manual_seed(7)
    for layer in lens.source_layers:
        weights = torch.randn(N_EXPERTS, generator=gen)
        w = weights.clone().requires_grad_(True)
        terms, logits = layer_surrogate(model, fast, layer, w)
        assert not logits.requires_grad and logits.shape == (len(fast.keys), model.vocab_size)
        (grad,) = torch.autograd.grad((fast.inter_weight.float() * terms).sum(), w)
        ((want_logits, _, want_grad),) = both_paths(model, (slow,), layer, weights)
        want_terms = surrogate_terms(want_logits, slow)
        assert rel_max(logits, want_logits) < 1e-5
        assert rel_max(terms, want_terms) < 1e-4
        assert want_grad.norm() > 0 and rel_max(grad, want_grad) < 1e-3
        with torch.no_grad():  # buffered ranks against a count made here
            rows = want_logits[slow.inter_item]
            best = rows.gather(1, slow.cand).max(dim=1, keepdim=True).values
            above = rows > best
            if slow.kept is not None:
                above &= slow.kept[slow.inter_item] > 0
            assert torch.equal(intermediate_ranks(want_logits, fast), above.sum(dim=1) + 1)


def test_a_padded_scaled_head_with_a_bias(work):
    """A head padded past the vocabulary (its last rows dropped, as unembed drops them), a logit scale and a
    head bias: the basis reads them as unembed does."""
    model = make_tiny("llama", seed=3)
    lens = expert_lens(model, seed=4)
    items = read_labelled_items(model, work["paths"], lens.source_layers)  # candidates under the full vocabulary
    vocab = model.vocab_size - 20
    model.unpadded_vocab = model.vocab_size = vocab
    model.logit_scale = 0.37
    gen = torch.Generator().manual_seed(5)
    model.head.bias = nn.Parameter(torch.randn(model.head.out_features, generator=gen))
    fast = ItemBatch.build(expert_matrices(lens), items, model=model)
    slow = ItemBatch.build(expert_matrices(lens), items, model=model, basis_budget=0)
    assert fast.basis is not None and fast.basis.offset is not None and fast.basis.offset.shape == (vocab,)
    weights = torch.tensor([0.3, -0.8, 0.1, 0.5])
    for layer in lens.source_layers:
        got, want = (layer_logits(model, batch, layer, weights) for batch in (fast, slow))
        assert got.shape == want.shape == (len(fast.keys), vocab)
        assert rel_max(got, want) < 1e-5
        std = layer_std(model, fast, layer, weights)
        assert std is not None and rel_max(std, want.std(dim=-1, correction=0)) < 1e-5
        w = weights.clone().requires_grad_(True)
        probe = torch.randn(vocab, generator=torch.Generator().manual_seed(layer))
        (grad,) = torch.autograd.grad((layer_logits(model, fast, layer, w) * probe).sum(), w)
        w_slow = weights.clone().requires_grad_(True)
        (want_grad,) = torch.autograd.grad((layer_logits(model, slow, layer, w_slow) * probe).sum(), w_slow)
        assert rel_max(grad, want_grad) < 1e-4


def test_learning_keeps_the_same_iterate_on_both_paths(family):
    """The same kept iterate, macro and weights. The best-expert start is compared by its macros only: the
    readout is scale-invariant in ``w`` (no bias) or nearly, so the gradient along the one-hot start is zero
    up to rounding, and Adam's first step (``g / (|g| + eps)``) follows that rounding on either path."""
    model, lens = family["model"], family["lens"]
    train, _ = split_items(family["items"], 0.5, seed=0)
    fast = learn_expert_weights(model, lens, train, steps=8)
    slow = learn_expert_weights(model, lens, train, steps=8, basis_budget=0)
    assert (fast.start, fast.step) == (slow.start, slow.step)
    assert fast.macro == slow.macro
    assert [h["macro"] for h in fast.history] == [h["macro"] for h in slow.history]
    for mine, theirs in zip(fast.history, slow.history):
        if mine["start"] != "best_expert":
            assert mine["surrogate"] == pytest.approx(theirs["surrogate"], rel=1e-4)
            assert torch.allclose(mine["weights"], theirs["weights"], atol=1e-4)
    for layer in lens.source_layers:
        assert torch.allclose(fast.weights[layer], slow.weights[layer], atol=1e-4)
    first, last = fast.history[0]["weights"], fast.history[8]["weights"]
    assert not torch.allclose(first, last, atol=1e-3)  # the weights moved: the comparison can fail


def test_the_basis_budget_falls_back_to_unembed(work, llama, caplog):
    lens, items = work["lens"], work["items"]
    scored = [item for item in items if item.scored]
    size = basis_bytes(len(lens.source_layers), len(scored), N_EXPERTS, llama.vocab_size)
    assert ItemBatch.build(expert_matrices(lens), items, model=llama, basis_budget=size).basis is not None
    with caplog.at_level(logging.INFO, logger="jlens_core.fitting.expert_weights"):
        for budget in (0, size - 1):
            batch = ItemBatch.build(expert_matrices(lens), items, model=llama, basis_budget=budget)
            assert batch.basis is None
            assert layer_std(llama, batch, lens.source_layers[0], torch.ones(N_EXPERTS)) is None
    assert "over its budget" in caplog.text
    # no model: no basis, the same numbers through unembed
    plain = ItemBatch.build(expert_matrices(lens), items)
    weights = torch.tensor([0.5, -0.2, 0.7, 0.1])
    assert plain.basis is None
    assert torch.equal(layer_logits(llama, plain, 0, weights), layer_logits(llama, batch, 0, weights))


class SquaringHead(nn.Linear):
    """A linear head plus a term no logit basis holds (the squared norm of its input, on every logit)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 0.01 * x.pow(2).sum(-1, keepdim=True)


def test_the_self_check_refuses_a_basis_that_misreads_the_head(work, caplog):
    model = make_tiny("llama", seed=4)
    lens = expert_lens(model, seed=5)
    items = read_labelled_items(model, work["paths"], lens.source_layers)
    head = SquaringHead(model.d_model, model.head.out_features, bias=False)
    head.weight = model.head.weight
    model.head = head  # unembed reads through it: the structure looks linear, the numbers are not
    with caplog.at_level(logging.WARNING, logger="jlens_core.fitting.expert_weights"):
        batch = ItemBatch.build(expert_matrices(lens), items, model=model)
    assert batch.basis is None
    assert "every step unembeds instead" in caplog.text
    assert any(record.levelno == logging.WARNING for record in caplog.records)
    weights = torch.tensor([0.5, -0.2, 0.7, 0.1])
    h = torch.einsum("nei,e->ni", batch.transported[1], weights)
    assert torch.equal(layer_logits(model, batch, 1, weights), model.unembed(h).float())
