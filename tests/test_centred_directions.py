"""Centred read directions (docs/method.md §7, §9.1): ``v_t - m_l``, ``m_l`` the mean read direction over
the vocabulary. Checked against the read vectors written out from the weights, per family; readings are
unchanged by centring (every logit shifts by ``h . m_l``); edits along centred directions follow the §7
formulas."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny
from helpers import random_lens

from jlens_core.interventions import Ablate, Steer, Swap, token_direction
from jlens_core.interventions.read_directions import mean_read_vector, read_vector, read_vector_norms
from jlens_core.reading.inputs import record_residuals

PROMPT = "The capital of France is Paris. The capital of Italy is"
LAYER = 1


def shifted_model(family: str):
    """A tiny model whose head rows share a common vector, as trained unembeddings do, so the mean
    read direction is large and centring moves every direction visibly."""
    model = make_tiny(family)
    head = model.hf_model.get_output_embeddings().weight
    with torch.no_grad():
        head += 0.2 * torch.randn(head.shape[1], generator=torch.Generator().manual_seed(1))
    return model


def read_matrix(model, family: str, lens, layer: int) -> torch.Tensor:
    """Every token's read vector ``v_t = M^T C (gamma * u_t)`` as rows ``[vocab, d]``, from the weights."""
    hf = model.hf_model
    if family == "gpt2":
        gain, centre = hf.transformer.ln_f.weight, True
    else:
        gain, centre = hf.model.norm.weight, False
    rows = hf.lm_head.weight.detach().double() * gain.detach().double()  # [vocab, d]
    if centre:
        rows = rows - rows.mean(dim=1, keepdim=True)
    return rows @ lens.matrix(layer).double()  # row t: (M^T r_t)^T


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def setup(request):
    family = request.param
    model = shifted_model(family)
    lens = random_lens(model)
    return model, lens, read_matrix(model, family, lens, LAYER)


def test_mean_and_centred_directions_match_the_weights(setup):
    model, lens, vectors = setup
    mean = vectors.mean(dim=0)
    torch.testing.assert_close(mean_read_vector(model, lens, LAYER).double(), mean, rtol=1e-5, atol=1e-5)
    for tid in (3, 57, 250):
        raw, centred = vectors[tid] / vectors[tid].norm(), (vectors[tid] - mean) / (vectors[tid] - mean).norm()
        torch.testing.assert_close(token_direction(model, lens, LAYER, tid).double(), raw, rtol=1e-5, atol=1e-5)
        got = token_direction(model, lens, LAYER, tid, centred=True).double()
        torch.testing.assert_close(got, centred, rtol=1e-5, atol=1e-5)
        assert float(raw @ centred) < 0.9  # the centre is not negligible here: the check can tell them apart
    norms = read_vector_norms(model, lens, LAYER, chunk=70).double()
    torch.testing.assert_close(norms, vectors.norm(dim=1), rtol=1e-5, atol=1e-5)
    centred_norms = read_vector_norms(model, lens, LAYER, centred=True, chunk=70).double()
    torch.testing.assert_close(centred_norms, (vectors - mean).norm(dim=1), rtol=1e-5, atol=1e-5)


def test_centring_shifts_every_logit_equally_and_leaves_readings_unchanged(setup):
    model, lens, _ = setup
    h = torch.randn(model.d_model, generator=torch.Generator().manual_seed(2))
    raw = torch.stack([read_vector(model, lens, LAYER, t) for t in range(model.vocab_size)]) @ h  # [vocab]
    centred = torch.stack([read_vector(model, lens, LAYER, t, centred=True) for t in range(model.vocab_size)]) @ h
    shift = raw - centred
    expected = float(mean_read_vector(model, lens, LAYER) @ h)
    assert abs(expected) > 1e-2  # a real shift, not zero
    torch.testing.assert_close(shift, torch.full_like(shift, expected), rtol=0, atol=1e-5)
    # the lens's own logits are the direction logits scaled by the norm's 1/scale, plus a per-token bias
    # (a LayerNorm's beta, read through the head) that does not depend on h
    with torch.no_grad():
        logits = model.unembed(lens.transport(h[None], LAYER))[0].double()
        bias = model.unembed(lens.transport(torch.zeros(1, model.d_model), LAYER))[0].double()
    slope = float(((logits - bias) @ raw.double()) / (raw.double() @ raw.double()))
    torch.testing.assert_close(logits - bias, slope * raw.double(), rtol=0, atol=1e-4)
    from_raw = torch.softmax(slope * raw.double() + bias, dim=0)
    from_centred = torch.softmax(slope * centred.double() + bias, dim=0)
    torch.testing.assert_close(from_centred, from_raw, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(from_centred, torch.softmax(logits, dim=0), rtol=1e-4, atol=1e-7)
    assert torch.equal(torch.argsort(raw, descending=True), torch.argsort(centred, descending=True))


def test_swap_along_centred_directions_follows_the_formula(setup):
    model, lens, vectors = setup
    a, b, alpha = 40, 90, 0.7
    ids = model.encode(PROMPT)
    clean = record_residuals(model, ids, [LAYER])[LAYER].double()
    swap = Swap(model, lens, a, b, alpha, layers=[LAYER], centred=True)
    edited = record_residuals(model, ids, [LAYER], edits=[swap])[LAYER].double()
    mean = vectors.mean(dim=0)
    basis = torch.stack([(vectors[t] - mean) / (vectors[t] - mean).norm() for t in (a, b)], dim=1)  # V [d, 2]
    pinv = torch.linalg.pinv(basis)
    c = clean[1:] @ pinv.T  # clean coordinates; one edited layer, so h there is the clean residual
    target = c + alpha * (c.flip(-1) - c)
    expected = clean[1:] + (target - clean[1:] @ pinv.T) @ basis.T
    torch.testing.assert_close(edited[1:], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(edited[0], clean[0], rtol=0, atol=0)  # position 0 is not edited
    raw = record_residuals(model, ids, [LAYER], edits=[Swap(model, lens, a, b, alpha, layers=[LAYER])])[LAYER]
    assert float((raw.double()[1:] - edited[1:]).norm()) > 1e-3 * float(edited.norm())  # centring changes the edit
    assert "centred directions" in repr(swap)


def test_steer_and_ablate_along_centred_directions(setup):
    model, lens, vectors = setup
    tid = 123
    v = vectors[tid] - vectors.mean(dim=0)
    v = v / v.norm()
    ids = model.encode(PROMPT)
    clean = record_residuals(model, ids, [LAYER])[LAYER].double()[1:]
    steered = record_residuals(model, ids, [LAYER], edits=[Steer(model, lens, tid, -1.5, layers=[LAYER],
                                                                  centred=True)])[LAYER].double()[1:]
    torch.testing.assert_close(steered, clean - 1.5 * clean.norm(dim=-1, keepdim=True) * v, rtol=1e-5, atol=1e-5)
    ablated = record_residuals(model, ids, [LAYER], edits=[Ablate(model, lens, tid, layers=[LAYER],
                                                                  centred=True)])[LAYER].double()[1:]
    torch.testing.assert_close(ablated, clean - (clean @ v)[:, None] * v, rtol=1e-5, atol=1e-5)


def test_mean_is_cached_per_lens_and_layer(setup):
    model, lens, _ = setup
    first = mean_read_vector(model, lens, LAYER)
    assert mean_read_vector(model, lens, LAYER) is first
    other = random_lens(model, seed=5)
    assert not torch.equal(mean_read_vector(model, other, LAYER), first)  # another lens, another centre


def test_head_rows_and_the_head_matrix_are_cached_and_equal_the_autograd_rows(llama):
    from jlens_core.interventions import read_directions as rd

    first = rd.head_row(llama, 5)
    first.add_(1.0)  # the caller's copy: the cache is not changed through it
    assert torch.equal(rd.head_row(llama, 5), rd._head_gradient(llama, 5))
    matrix = rd.head_matrix(llama)
    assert rd.head_matrix(llama) is matrix  # built once per model
    for t in (0, 5, llama.vocab_size - 1):
        assert torch.allclose(matrix[:, t].float().cpu(), rd._head_gradient(llama, t), atol=1e-5)
