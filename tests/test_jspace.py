"""The J-space on tiny models (docs/method.md §11): the dictionary equals read_vector, correlations and atoms agree
with the dictionary written out from the weights, decompose agrees with the plain-tensor pursuit over that written-out
dictionary, the controls, concept vectors, split, and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_tiny
from helpers import random_lens

from jlens_core import LogitLens
from jlens_core.interventions.read_directions import mean_read_vector, read_vector
from jlens_core.jspace import concept_vector, concept_vectors, decompose, jspace, pursuit, split
from jlens_core.jspace.pursuit import kkt_violation
from jlens_core.reading.inputs import record_residuals
from jlens_core.reading.tokens import TokenDisplay

LAYER = 1
PROMPT = "The capital of France is Paris. The capital of Italy is"


def shifted_model(family: str):
    """A tiny model whose head rows share a common vector (as trained unembeddings do): centring matters."""
    model = make_tiny(family)
    head = model.hf_model.get_output_embeddings().weight
    with torch.no_grad():
        head += 0.2 * torch.randn(head.shape[1], generator=torch.Generator().manual_seed(1))
    return model


def written_out(model, family: str, lens, layer: int, gauge: str) -> torch.Tensor:
    """Every atom ``[vocab, d]`` float64 from the weights: ``M^T C (gamma * u_t)`` (minus the mean: centred)."""
    hf = model.hf_model
    if family == "gpt2":
        gain, centre = hf.transformer.ln_f.weight, True
    else:
        gain, centre = hf.model.norm.weight, False
    rows = hf.lm_head.weight.detach().double() * gain.detach().double()
    if centre:
        rows = rows - rows.mean(dim=1, keepdim=True)
    v = rows @ lens.matrix(layer).double()
    return v - v.mean(dim=0) if gauge == "centred" else v


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def setup(request):
    model = shifted_model(request.param)
    return request.param, model, random_lens(model)


@pytest.fixture(scope="module")
def residuals(setup):
    _, model, _ = setup
    return record_residuals(model, model.encode(PROMPT), [LAYER])[LAYER].float()[1:]  # [seq - 1, d]


@pytest.mark.parametrize("gauge", ["centred", "raw"])
def test_the_dictionary_is_read_vector_and_the_weights(setup, gauge):
    family, model, lens = setup
    space = jspace(model, lens, LAYER, gauge=gauge)
    full = written_out(model, family, lens, LAYER, gauge)
    assert space.n_atoms == model.vocab_size and space.token_ids.tolist() == list(range(model.vocab_size))
    for t in (0, 7, 123, 299):
        torch.testing.assert_close(space.atoms([t])[0], read_vector(model, lens, LAYER, t, centred=gauge == "centred"),
                                   rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(space.atoms(torch.arange(model.vocab_size)).double(), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(space.norms.double(), full.norm(dim=1), rtol=1e-5, atol=1e-5)
    x = torch.randn(5, model.d_model, generator=torch.Generator().manual_seed(4))
    unit = full / full.norm(dim=1, keepdim=True)
    torch.testing.assert_close(space.correlations(x).double(), x.double() @ unit.T, rtol=1e-4, atol=1e-4)
    # the centre is not negligible here: the two gauges differ
    if gauge == "centred":
        assert float(mean_read_vector(model, lens, LAYER).norm()) > 0.1 * float(full.norm(dim=1).mean())


def test_a_sub_vocabulary_keeps_only_its_atoms(setup):
    _, model, lens = setup
    ids = [5, 17, 200]
    space = jspace(model, lens, LAYER, vocab=ids)
    whole = jspace(model, lens, LAYER)
    x = torch.randn(2, model.d_model, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(space.correlations(x), whole.correlations(x)[:, ids], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not in this dictionary"):
        space.atoms([6])


@pytest.mark.parametrize("method", ["gradient_pursuit", "nnls"])
@pytest.mark.parametrize("gauge", ["centred", "raw"])
def test_decompose_is_the_pursuit_over_the_written_out_dictionary(setup, residuals, method, gauge):
    family, model, lens = setup
    dec = decompose(model, lens, residuals, LAYER, k=6, method=method, gauge=gauge)
    ref = pursuit(written_out(model, family, lens, LAYER, gauge), residuals, k=6, method=method)
    assert dec.token_ids.tolist() == ref.indices.tolist()
    torch.testing.assert_close(dec.coefficients.double(), ref.coefficients, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dec.j_part.double(), ref.fitted, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dec.j_part + dec.remainder, residuals, rtol=1e-5, atol=1e-5)
    want = 1 - (residuals.double() - ref.fitted).pow(2).sum(-1) / residuals.double().pow(2).sum(-1)
    torch.testing.assert_close(dec.explained.double(), want, rtol=1e-4, atol=1e-5)
    texts = TokenDisplay.for_model(model).texts
    assert dec.tokens == [[texts[int(t)] for t in row if int(t) >= 0] for row in dec.token_ids]
    assert bool((dec.coefficients >= 0).all())
    assert dec.active.tolist() == ((dec.token_ids >= 0) & (dec.coefficients > 0)).tolist()
    assert torch.equal(dec.occupancy, dec.active.sum(-1))
    if method == "nnls":  # a larger support never fits worse
        assert bool((dec.explained_by_step[:, 1:] >= dec.explained_by_step[:, :-1] - 1e-5).all())
        full = written_out(model, family, lens, LAYER, gauge)
        a = (full / full.norm(dim=1, keepdim=True))[dec.token_ids.clamp_min(0)]
        gram = a @ a.transpose(1, 2)
        b = (a @ residuals.double()[..., None])[..., 0]
        assert float(kkt_violation(gram, b, dec.coefficients.double()).max()) < 1e-4


def test_the_controls(setup, residuals):
    _, model, lens = setup
    dec = decompose(model, lens, residuals, LAYER, k=6, seed=3)
    again = decompose(model, lens, residuals, LAYER, k=6, seed=3)
    other = decompose(model, lens, residuals, LAYER, k=6, seed=4)
    assert torch.equal(dec.random_explained, again.random_explained)  # seeded
    assert not torch.equal(dec.random_explained, other.random_explained)
    # the random control is the pursuit over unit Gaussian atoms drawn with that seed, by hand
    gen = torch.Generator().manual_seed(3)
    atoms = torch.randn(model.vocab_size, model.d_model, generator=gen)
    ref = pursuit(atoms, residuals, k=6)
    want = 1 - (residuals.double() - ref.fitted).pow(2).sum(-1) / residuals.double().pow(2).sum(-1)
    torch.testing.assert_close(dec.random_explained.double(), want, rtol=1e-4, atol=1e-5)
    assert bool(torch.isfinite(dec.shuffled_explained).all())
    assert not torch.allclose(dec.shuffled_explained, dec.explained)
    # shuffled labels: a permutation of the selected tokens' labels, not the tokens themselves
    picked = dec.token_ids >= 0
    assert torch.equal(dec.shuffled_token_ids >= 0, picked)
    assert not torch.equal(dec.shuffled_token_ids[picked], dec.token_ids[picked])
    bare = decompose(model, lens, residuals, LAYER, k=6, controls=False)
    assert bool(torch.isnan(bare.random_explained).all()) and torch.equal(bare.explained, dec.explained)
    random_only = decompose(model, lens, residuals, LAYER, k=6, controls="random", seed=3)
    assert torch.equal(random_only.random_explained, dec.random_explained)
    assert bool(torch.isnan(random_only.shuffled_explained).all())
    with pytest.raises(ValueError, match="controls='shuffled' is not a choice"):
        decompose(model, lens, residuals, LAYER, k=6, controls="shuffled")


def test_mean_subtracted_target(setup, residuals):
    _, model, lens = setup
    dec = decompose(model, lens, residuals, LAYER, k=4, target="mean-subtracted", controls=False)
    torch.testing.assert_close(dec.x, residuals - residuals.mean(0))
    mean = torch.ones(model.d_model)
    dec = decompose(model, lens, residuals[0], LAYER, k=4, target="mean-subtracted", mean=mean, controls=False)
    torch.testing.assert_close(dec.x[0], residuals[0] - mean)
    with pytest.raises(ValueError, match="needs its mean"):
        decompose(model, lens, residuals[0], LAYER, k=4, target="mean-subtracted")


def test_steps_to_a_fraction_of_the_fit(setup, residuals):
    _, model, lens = setup
    dec = decompose(model, lens, residuals, LAYER, k=8, method="nnls", controls=False)
    steps = dec.steps_to(0.9)
    for i in range(dec.n):
        by = dec.explained_by_step[i]
        want = next(j + 1 for j in range(8) if float(by[j]) >= 0.9 * float(by[-1]))
        assert int(steps[i]) == want


def test_the_logit_lens_has_a_dictionary_of_head_rows():
    model = make_tiny("llama")
    lens = LogitLens.for_model(model)
    space = jspace(model, lens, LAYER, gauge="raw")
    gain = model.hf_model.model.norm.weight.detach()
    head = model.hf_model.lm_head.weight.detach() * gain
    torch.testing.assert_close(space.atoms([3, 9]), head[[3, 9]], rtol=1e-5, atol=1e-6)


def test_split_parts_add_up(setup, residuals):
    _, model, lens = setup
    v = residuals[2] - residuals[5]
    s = split(model, lens, v, LAYER, k=5)
    torch.testing.assert_close(s.j_part + s.non_j_part, v, rtol=1e-5, atol=1e-5)
    assert math.isclose(s.j_share + s.non_j_share, 1.0, abs_tol=1e-6)
    assert math.isclose(s.j_share, 1 - float(s.non_j_part.norm() ** 2 / v.norm() ** 2), rel_tol=1e-4)
    assert 0 < s.j_share < 1
    with pytest.raises(ValueError, match="one vector"):
        split(model, lens, residuals, LAYER)


def test_concept_vectors_are_mean_differences(setup):
    _, model, _ = setup
    prompts, baseline = ["Tell me about Paris", "Paris is a city"], ["Tell me about water", "Hello there", "One two"]
    got = concept_vectors(model, prompts, baseline, layers=[0, LAYER], position=-1)

    def last(p, layer):
        return record_residuals(model, model.encode(p), [layer])[layer][-1].float()

    for layer in (0, LAYER):
        want = torch.stack([last(p, layer) for p in prompts]).mean(0) - torch.stack([last(p, layer)
                                                                                      for p in baseline]).mean(0)
        torch.testing.assert_close(got[layer], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(concept_vector(model, LAYER, prompts, baseline), got[LAYER])
    chat = [[{"role": "user", "content": "Tell me about Paris"}]]
    ids = model.tokenizer.apply_chat_template(chat[0], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    h = record_residuals(model, torch.tensor([list(ids)]), [LAYER])[LAYER][-1].float()
    torch.testing.assert_close(concept_vector(model, LAYER, chat, ["Hello there"]), h - last("Hello there", LAYER))


def test_chat_prompts_need_a_chat_template(setup):
    _, model, _ = setup
    saved = model.tokenizer.chat_template
    model.tokenizer.chat_template = None
    try:
        with pytest.raises(ValueError, match="no chat template"):
            concept_vector(model, LAYER, [[{"role": "user", "content": "hi"}]], ["x"])
    finally:
        model.tokenizer.chat_template = saved


def test_bad_input_one_sentence_each(setup, residuals):
    _, model, lens = setup
    with pytest.raises(ValueError, match="outside the lens"):
        decompose(model, lens, residuals, model.n_layers - 1)
    with pytest.raises(ValueError, match="k=0"):
        decompose(model, lens, residuals, LAYER, k=0)
    with pytest.raises(ValueError, match="k=100000"):
        decompose(model, lens, residuals, LAYER, k=100000)
    with pytest.raises(ValueError, match="zero vector"):
        decompose(model, lens, torch.zeros(model.d_model), LAYER)
    with pytest.raises(ValueError, match="shape"):
        decompose(model, lens, torch.ones(3), LAYER)
    with pytest.raises(ValueError, match="gauge="):
        jspace(model, lens, LAYER, gauge="sideways")
    with pytest.raises(ValueError, match="method="):
        decompose(model, lens, residuals, LAYER, method="omp")
    with pytest.raises(ValueError, match="target="):
        decompose(model, lens, residuals, LAYER, target="centred")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        jspace(model, lens, LAYER, vocab=[1, 10**6])

    class NoMatrix:
        kind = "mystery"
        layers = lens.layers
        target_layer = lens.target_layer
        source_layers = lens.source_layers

        def matrix(self, layer):
            raise NotImplementedError

        def transport(self, h, layer):
            return torch.tanh(h)

    with pytest.raises(ValueError, match="no J-space dictionary"):
        jspace(model, NoMatrix(), LAYER)


def test_the_tuned_lens_dictionary_is_its_read_vectors(setup):
    from jlens_core import TunedLens

    _, model, _ = setup
    gen = torch.Generator().manual_seed(7)
    d = model.d_model
    lens = TunedLens({layer: (0.2 * torch.randn(d, d, generator=gen), 0.5 * torch.randn(d, generator=gen))
                      for layer in range(model.n_layers - 1)}, d, target_layer=model.n_layers - 1,
                     n_layers=model.n_layers)
    for gauge in ("centred", "raw"):
        space = jspace(model, lens, LAYER, gauge=gauge)
        for t in (4, 99):  # the bias b_l plays no part in a direction
            torch.testing.assert_close(space.atoms([t])[0],
                                       read_vector(model, lens, LAYER, t, centred=gauge == "centred"),
                                       rtol=1e-5, atol=1e-5)


def test_the_word_vocabulary_keeps_the_word_tokens(setup):
    import numpy as np

    from jlens_core.reading.word_readout import word_mask

    _, model, lens = setup
    space = jspace(model, lens, LAYER, vocab="word")
    mask = word_mask(TokenDisplay.for_model(model))[: model.vocab_size]
    assert space.token_ids.tolist() == np.nonzero(mask)[0].tolist() and 0 < space.n_atoms < model.vocab_size
    dec = decompose(model, lens, torch.randn(2, model.d_model, generator=torch.Generator().manual_seed(0)), LAYER,
                    k=3, vocab="word", controls=False)
    assert all(bool(mask[int(t)]) for t in dec.token_ids.reshape(-1) if int(t) >= 0)
