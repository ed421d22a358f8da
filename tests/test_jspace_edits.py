"""Edits on the J-space split (docs/method.md §11.5) on a tiny model: bit-identical at strength 0, each checked
against an independent computation of what it says, and its random control differs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_tiny
from helpers import random_lens

from jlens_core.interventions import Steer
from jlens_core.interventions.jspace_edits import AblateJSpace, ClampJ, VectorSwap
from jlens_core.interventions.read_directions import token_directions
from jlens_core.jspace import concept_vectors, decompose, split
from jlens_core.reading.inputs import record_residuals
from jlens_core.reading.reader import read_prompt

PROMPT = "The capital of France is Paris. The capital of Italy is"
LAYER = 1


@pytest.fixture(scope="module")
def setup():
    model = make_tiny("llama")
    lens = random_lens(model)
    ids = model.encode(PROMPT)
    vectors = {
        "a": concept_vectors(model, ["Tell me about Paris", "Paris and France"], ["Hello", "Water is wet"],
                             layers=[LAYER, 2]),
        "b": concept_vectors(model, ["Tell me about Rome", "Rome and Italy"], ["Hello", "Water is wet"],
                             layers=[LAYER, 2]),
    }
    return model, lens, ids, vectors


def run(model, ids, edits, layers=(LAYER, 2, 3)):
    return record_residuals(model, ids, list(layers), edits=edits)


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_strength_zero_is_bit_identical(setup):
    model, lens, ids, vec = setup
    clean = run(model, ids, None)
    edits = [VectorSwap(model, lens, vec["a"], vec["b"], part=p, strength=0.0, k=4) for p in ("full", "j", "non_j")]
    edits += [AblateJSpace(model, lens, k=4, strength=0.0, layers=[LAYER, 2]),
              AblateJSpace(model, lens, k=4, strength=0.0, layers=[LAYER], random=True)]
    for edit in edits:
        assert same(run(model, ids, [edit]), clean), edit
    # the clamp alone holds the clean coordinates of a clean run: nothing moves
    assert same(run(model, ids, [ClampJ(model, lens, [" t", 17], layers=[LAYER, 2])]), clean)
    # and the readings agree bit for bit
    r0 = read_prompt(model, lens, PROMPT)
    r1 = read_prompt(model, lens, PROMPT, edits=[AblateJSpace(model, lens, k=4, strength=0.0, layers=[LAYER])])
    assert np.array_equal(r0.top_ids, r1.top_ids)


@pytest.mark.parametrize("part", ["full", "j", "non_j"])
def test_vector_swap_adds_the_part_difference(setup, part):
    model, lens, ids, vec = setup
    clean = run(model, ids, None)[LAYER].float()
    edit = VectorSwap(model, lens, vec["a"], vec["b"], part=part, strength=0.7, k=4, layers=[LAYER])
    got = run(model, ids, [edit])[LAYER].float()
    a, b = vec["a"][LAYER], vec["b"][LAYER]
    if part == "full":
        delta = b - a
    else:
        sa, sb = split(model, lens, a, LAYER, k=4, controls=False), split(model, lens, b, LAYER, k=4, controls=False)
        delta = sb.j_part - sa.j_part if part == "j" else sb.non_j_part - sa.non_j_part
    torch.testing.assert_close(got[1:], clean[1:] + 0.7 * delta, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0], clean[0])  # the attention sink is left alone
    # norm-matched: the same direction, the full difference's norm
    matched = VectorSwap(model, lens, vec["a"], vec["b"], part=part, magnitude="norm_matched", k=4, layers=[LAYER])
    assert abs(float(matched.deltas[LAYER].norm()) - float((b - a).norm())) < 1e-4
    cos = torch.nn.functional.cosine_similarity(matched.deltas[LAYER], delta, dim=0)
    assert float(cos) > 1 - 1e-5
    # the random control: same norm, another direction, seeded
    rnd = VectorSwap(model, lens, vec["a"], vec["b"], part=part, k=4, layers=[LAYER], random=True, seed=1)
    assert abs(float(rnd.deltas[LAYER].norm()) - float(delta.norm())) < 1e-4
    assert abs(float(torch.nn.functional.cosine_similarity(rnd.deltas[LAYER], delta, dim=0))) < 0.9
    again = VectorSwap(model, lens, vec["a"], vec["b"], part=part, k=4, layers=[LAYER], random=True, seed=1)
    assert torch.equal(rnd.deltas[LAYER], again.deltas[LAYER])


def test_j_and_non_j_swaps_add_up_to_the_full_swap(setup):
    model, lens, _, vec = setup
    j = VectorSwap(model, lens, vec["a"], vec["b"], part="j", k=4)
    non_j = VectorSwap(model, lens, vec["a"], vec["b"], part="non_j", k=4)
    for layer in j.layers:
        torch.testing.assert_close(j.deltas[layer] + non_j.deltas[layer], vec["b"][layer] - vec["a"][layer],
                                   rtol=1e-5, atol=1e-5)


def test_clamp_holds_clean_coordinates_and_undoes_a_steer_along_them(setup):
    model, lens, ids, _ = setup
    clean = run(model, ids, None)
    tid = 23
    steer = Steer(model, lens, tid, 1.5, layers=[LAYER, 2], centred=True)
    steered = run(model, ids, [steer])
    assert not torch.allclose(steered[LAYER], clean[LAYER])
    clamp = ClampJ(model, lens, [tid, 40], layers=[LAYER, 2])
    both = run(model, ids, [steer, clamp])
    # the steer moves along the clamped direction only: the clamp after it gives the clean run back
    for layer in (LAYER, 2, 3):
        torch.testing.assert_close(both[layer], clean[layer], rtol=1e-4, atol=1e-4)
    # an ablation of another direction then a clamp: the clamped coordinates equal the clean ones, by hand
    other = Steer(model, lens, 60, 1.0, layers=[LAYER, 2])
    held = run(model, ids, [other, clamp])
    v = token_directions(model, lens, 2, [tid, 40], centred=True).double()  # [2, d]
    pinv = torch.linalg.pinv(v.T)
    c_clean = clean[2].double()[1:] @ pinv.T
    c_held = held[2].double()[1:] @ pinv.T
    torch.testing.assert_close(c_held, c_clean, rtol=1e-4, atol=1e-4)
    moved = run(model, ids, [other])[2].double()[1:] @ pinv.T
    assert float((moved - c_clean).abs().max()) > 1e-2  # without the clamp they move
    # the random control clamps other directions: the steer along the token comes through
    rnd = ClampJ(model, lens, [tid, 40], layers=[LAYER, 2], random=True)
    assert not torch.allclose(run(model, ids, [steer, rnd])[LAYER], clean[LAYER], atol=1e-3)
    with pytest.raises(ValueError, match="no token"):
        ClampJ(model, lens, [], layers=[LAYER])
    with pytest.raises(ValueError):
        ClampJ(model, lens, ["not one token at all"], layers=[LAYER])


def test_ablate_jspace_removes_the_decomposition(setup):
    model, lens, ids, _ = setup
    clean = run(model, ids, None)[LAYER].float()
    edit = AblateJSpace(model, lens, k=4, strength=0.5, layers=[LAYER])
    got = run(model, ids, [edit])[LAYER].float()
    dec = decompose(model, lens, clean[1:], LAYER, k=4, controls=False)
    torch.testing.assert_close(got[1:], clean[1:] - 0.5 * dec.j_part, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[0], clean[0])
    # the random control removes a vector of the same norm, in another direction
    rnd = AblateJSpace(model, lens, k=4, layers=[LAYER], random=True)
    removed = rnd.removed(LAYER, clean[1:])
    torch.testing.assert_close(removed.norm(dim=-1), dec.j_part.norm(dim=-1), rtol=1e-4, atol=1e-4)
    cos = torch.nn.functional.cosine_similarity(removed, dec.j_part, dim=-1)
    assert float(cos.abs().max()) < 0.99
    assert not torch.allclose(run(model, ids, [rnd])[LAYER].float(), run(model, ids, [edit])[LAYER].float())


def test_bad_input(setup):
    model, lens, _, vec = setup
    with pytest.raises(ValueError, match="part="):
        VectorSwap(model, lens, vec["a"], vec["b"], part="half")
    with pytest.raises(ValueError, match="magnitude="):
        VectorSwap(model, lens, vec["a"], vec["b"], magnitude="big")
    with pytest.raises(ValueError, match="Strength"):
        VectorSwap(model, lens, vec["a"], vec["b"], strength=9)
    with pytest.raises(ValueError, match="no vector for layer 0"):
        VectorSwap(model, lens, vec["a"], vec["b"], layers=[0])
    with pytest.raises(ValueError, match="k=0"):
        AblateJSpace(model, lens, k=0, layers=[LAYER])
    with pytest.raises(ValueError, match="outside the lens"):
        AblateJSpace(model, lens, layers=[model.n_layers - 1])


def test_clamp_takes_a_decompositions_support(setup):
    model, lens, ids, _ = setup
    h = run(model, ids, None)[LAYER].float()[-1]
    dec = decompose(model, lens, h, LAYER, k=5, controls=False)
    clamp = ClampJ(model, lens, dec.token_ids, layers=[LAYER])  # [1, k] with -1 padding
    assert clamp.token_ids == [int(t) for t in dec.token_ids[0] if int(t) >= 0]
    assert clamp.bases[LAYER][0].shape == (model.d_model, len(clamp.token_ids))
