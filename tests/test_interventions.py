"""Interventions (docs/method.md §7): read directions, steer / ablate / swap, swap success; tiny models, checked
against independent computations."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CORPUS, make_tiny
from helpers import random_lens

from jlens_core import JacobianLens, LogitLens
from jlens_core.interventions import Ablate, Steer, Swap, load_swap_set, swap_success, token_direction
from jlens_core.interventions.read_directions import check_layers, default_layers
from jlens_core.interventions.swap_success import wilson_interval
from jlens_core.reading.generation import generate
from jlens_core.reading.inputs import record_residuals
from jlens_core.reading.reader import read_prompt
from jlens_core.reading.tokens import TokenDisplay, is_word_like, spellings

PROMPT = "The capital of France is Paris. The capital of Italy is"


def word_tokens(model, n: int = 4) -> list[str]:
    """``n`` texts that are one word-like vocabulary token each (with a leading space)."""
    display = TokenDisplay.for_model(model)
    out = [t for t in display.texts if t.startswith(" ") and len(t) > 2 and is_word_like(t)]
    assert len(out) >= n
    return out[:n]


# -- read directions ---------------------------------------------------------------------------------
def pre_norm_logit(model, family: str, matrix: torch.Tensor, token_id: int):
    """The lens's logit of ``token_id`` before the final norm's scale, written out per family."""
    hf = model.hf_model
    if family == "gpt2":
        gain, centre, head = hf.transformer.ln_f.weight, True, hf.lm_head.weight
    elif family == "gemma":
        gain, centre, head = 1.0 + hf.model.norm.weight, False, hf.lm_head.weight
    elif family == "opt":
        gain, centre, head = hf.model.decoder.final_layer_norm.weight, True, hf.lm_head.weight
    else:
        gain, centre, head = hf.model.norm.weight, False, hf.lm_head.weight

    def f(h):
        x = matrix @ h
        if centre:
            x = x - x.mean()
        return head[token_id] @ (gain * x)

    return f


@pytest.mark.parametrize("family", ["llama", "gemma", "gpt2", "opt"])
@pytest.mark.parametrize("lens_kind", ["jacobian", "logit"])
def test_direction_is_the_gradient_of_the_lens_logit(family, lens_kind):
    model = make_tiny(family)
    lens = random_lens(model) if lens_kind == "jacobian" else LogitLens.for_model(model)
    token = word_tokens(model, 1)[0]
    tid = spellings(model.tokenizer, token)[token]
    for layer in (0, model.n_layers - 2):
        matrix = lens.matrix(layer) if lens_kind == "jacobian" else torch.eye(model.d_model)
        h = torch.randn(model.d_model, requires_grad=True)
        pre_norm_logit(model, family, matrix, tid)(h).backward()
        expected = h.grad / h.grad.norm()
        got = token_direction(model, lens, layer, token)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        assert token_direction(model, lens, layer, tid).equal(got)  # by id too


def test_bad_tokens_and_layers_are_one_sentence(llama):
    lens = random_lens(llama)
    with pytest.raises(ValueError, match=r"' capital city' is not a single vocabulary token: it is \d+ pieces ' capital'"):
        token_direction(llama, lens, 1, " capital city")
    with pytest.raises(ValueError, match=r"Layer 3 is outside the lens: it reads layers 0\.\.2"):
        token_direction(llama, lens, 3, " capital")
    with pytest.raises(ValueError, match=r"Steering strength 5 is out of range"):
        Steer(llama, lens, " capital", 5)
    with pytest.raises(ValueError, match="Cannot swap ' capital' with itself"):
        Swap(llama, lens, " capital", " capital")
    with pytest.raises(ValueError, match=r"alpha=-1 is out of range"):
        Swap(llama, lens, " capital", " time", -1)


def test_edit_layers_count_from_the_end_and_must_be_read_by_the_lens(llama):
    lens = random_lens(llama)  # reads 0..2, target 3
    assert check_layers(llama, lens, [-2, 1, 1, 0]) == [0, 1, 2]
    with pytest.raises(ValueError, match=r"^Layer 3 is outside the lens"):
        check_layers(llama, lens, [-1])
    with pytest.raises(ValueError, match=r"^Layer 9 is out of range: the model has 4 layers"):
        check_layers(llama, lens, [9])
    with pytest.raises(ValueError, match="list of layers is empty"):
        check_layers(llama, lens, [])


def test_default_layers_are_the_middle_band(llama):
    assert default_layers(llama, random_lens(llama)) == [1, 2]  # 4 layers: 4 // 3 = 1 .. last source 2
    partial = JacobianLens({0: torch.eye(32), 1: torch.eye(32)}, n_prompts=1, d_model=32, target_layer=3, n_layers=4)
    assert default_layers(llama, partial) == [1]


# -- the edits ------------------------------------------------------------------------------------------
def test_swap_exchanges_the_clean_coordinates_at_every_edited_layer(llama):
    lens = random_lens(llama)
    a, b = word_tokens(llama, 2)
    swap = Swap(llama, lens, a, b, 1.0, layers=[1, 2])
    ids = llama.encode(PROMPT)
    clean = record_residuals(llama, ids, range(llama.n_layers))
    edited = record_residuals(llama, ids, range(llama.n_layers), edits=[swap])
    torch.testing.assert_close(edited[0], clean[0], rtol=0, atol=0)  # below the edit: untouched
    for layer in (1, 2):
        got = swap.coordinates(layer, edited[layer][1:])  # [seq-1, 2]
        want = swap.coordinates(layer, clean[layer][1:]).flip(-1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(edited[layer][0], clean[layer][0], rtol=1e-6, atol=1e-6)  # position 0: a sink
    # the swap moves only the span of the two directions: the rest of h is the run's own
    basis, pinv = swap.bases[1]
    rest = edited[1] - (edited[1] @ pinv.T) @ basis.T
    rest_clean = clean[1] - (clean[1] @ pinv.T) @ basis.T
    torch.testing.assert_close(rest, rest_clean, rtol=1e-5, atol=1e-5)


def test_ablation_removes_the_component(llama):
    lens = random_lens(llama)
    token = word_tokens(llama, 1)[0]
    edit = Ablate(llama, lens, token, layers=[1, 2])
    edited = record_residuals(llama, llama.encode(PROMPT), [1, 2], edits=[edit])
    for layer in (1, 2):
        h = edited[layer][1:]
        component = (h @ edit.directions[layer]).abs()
        assert bool((component < 1e-6 * h.norm(dim=-1)).all())


def test_steer_adds_strength_times_norm_along_the_direction(llama):
    lens = random_lens(llama)
    token = word_tokens(llama, 1)[0]
    ids = llama.encode(PROMPT)
    clean = record_residuals(llama, ids, [1])[1]
    edited = record_residuals(llama, ids, [1], edits=[Steer(llama, lens, token, 2.5, layers=[1])])[1]
    v = token_direction(llama, lens, 1, token)
    expected = clean[1:] + 2.5 * clean[1:].norm(dim=-1, keepdim=True) * v
    torch.testing.assert_close(edited[1:], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(edited[0], clean[0])


def test_identity_edits_are_bit_identical(llama):
    lens = random_lens(llama)
    a, b = word_tokens(llama, 2)
    clean_reading = read_prompt(llama, lens, PROMPT)
    clean_gen = generate(llama, PROMPT, max_new_tokens=8, stop_at_eos=False)
    for edits in ([], [Steer(llama, lens, a, 0.0)], [Swap(llama, lens, a, b, 0.0)]):
        reading = read_prompt(llama, lens, PROMPT, edits=edits)
        assert (reading.kl_bits == clean_reading.kl_bits).all()
        assert (reading.top_probs == clean_reading.top_probs).all()
        gen = generate(llama, PROMPT, max_new_tokens=8, stop_at_eos=False, edits=edits)
        assert gen.generated_ids.tolist() == clean_gen.generated_ids.tolist()
        assert (gen.top_probs == clean_gen.top_probs).all()


@pytest.mark.parametrize("layer", [1, 2])
def test_edits_leave_lower_layers_unchanged(llama, layer):
    lens = random_lens(llama)
    a, b = word_tokens(llama, 2)
    ids = llama.encode(PROMPT)
    clean = record_residuals(llama, ids, range(4))
    for edit in (Steer(llama, lens, a, 1.0, layers=[layer]), Ablate(llama, lens, a, layers=[layer]),
                 Swap(llama, lens, a, b, 2.0, layers=[layer])):
        edited = record_residuals(llama, ids, range(4), edits=[edit])
        for below in range(layer):
            assert torch.equal(edited[below], clean[below])
        assert not torch.equal(edited[layer], clean[layer])


def test_swap_while_generating_targets_generated_tokens_only_when_asked(llama):
    lens = random_lens(llama)
    a, b = word_tokens(llama, 2)
    prompt_only = Swap(llama, lens, a, b, 4.0, layers=[1, 2])
    also_generated = Swap(llama, lens, a, b, 4.0, layers=[1, 2], on_generated=True)
    g1 = generate(llama, PROMPT, max_new_tokens=6, stop_at_eos=False, edits=[prompt_only])
    g2 = generate(llama, PROMPT, max_new_tokens=6, stop_at_eos=False, edits=[also_generated])
    assert g1.generated_ids[0] == g2.generated_ids[0]  # the first new token sees the same edited prompt
    # reading the edited run of the same ids reproduces what the model wrote under the edit
    reading = read_prompt(llama, lens, g2, edits=[also_generated])
    out = reading.layers.index(reading.output_layer)
    assert reading.top_ids[out, g2.n_prompt - 1:-1, 0].tolist() == g2.generated_ids.tolist()


# -- swap success --------------------------------------------------------------------------------------
def eligible_item(model):
    """An item whose answer is the model's clean greedy next token (a word-like single token)."""
    for sentence in CORPUS.split(". "):
        words = sentence.split()
        for n in range(3, len(words)):
            prompt = " ".join(words[:n])
            gen = generate(model, prompt, max_new_tokens=1, stop_at_eos=False)
            text = model.decode(gen.generated_ids.tolist())
            if is_word_like(text) and text.strip() and spellings(model.tokenizer, text).get(text) is not None:
                return prompt, text
    pytest.skip("no prompt whose next token is a word")


def test_swap_success_counts_eligible_skipped_and_matches_generation(llama):
    lens = random_lens(llama)
    prompt, answer = eligible_item(llama)
    a, b = [w for w in word_tokens(llama, 4) if w != answer][:2]
    edited_first = {}
    for alpha in (1.0, 4.0):
        swap = Swap(llama, lens, a, b, alpha)
        edited_first[alpha] = llama.decode(generate(llama, prompt, max_new_tokens=1, edits=[swap]).generated_ids.tolist())
    target = edited_first[4.0]
    items = [
        {"name": "ok", "prompt": prompt, "source": a, "replacement": b, "answer": answer.strip(),
         "swap_answer": target.strip() or "x"},
        {"name": "wrong", "prompt": prompt, "source": a, "replacement": b, "answer": "zzzz", "swap_answer": "x"},
        {"name": "multi", "prompt": prompt, "source": "capital city", "replacement": b, "answer": answer,
         "swap_answer": "x"},
    ]
    report = swap_success(llama, {"jacobian": lens}, items, alphas=(1.0, 4.0))
    assert report.n_items == 3 and report.n_skipped == 2  # 'zzzz' and 'capital city' have no single-token spelling
    assert report.n_eligible == 1
    row = report.items.set_index("name").loc["ok"]
    assert row["jacobian@4 next"] == edited_first[4.0] and row["jacobian@1 next"] == edited_first[1.0]
    target_spelled = bool(spellings(llama.tokenizer, target.strip() or "x"))
    assert bool(row["jacobian@4"]) == target_spelled
    assert set(report.summary["lens"]) == {"jacobian", "logit", "random", "norm-matched"}
    jac4 = report.summary[(report.summary["lens"] == "jacobian") & (report.summary["alpha"] == 4.0)].iloc[0]
    assert jac4["eligible"] == 1 and jac4["successes"] == int(target_spelled)
    assert jac4["ci_low"] <= jac4["rate"] <= jac4["ci_high"]
    assert report.items.set_index("name").loc["multi", "reason"].startswith("skipped: no single-token spelling of source")
    assert len(report.best) == 4 and report.seconds > 0


def test_wilson_interval():
    low, high = wilson_interval(7, 10)
    assert 0.39 < low < 0.40 and 0.89 < high < 0.90  # the textbook values 0.397, 0.892
    assert wilson_interval(0, 10)[0] == 0.0
    wide, narrow = wilson_interval(5, 10), wilson_interval(50, 100)
    assert narrow[1] - narrow[0] < wide[1] - wide[0]


def test_swap_set_files(tmp_path):
    shipped = load_swap_set("swaps")
    assert len(shipped) >= 60
    assert len({item["relation"] for item in shipped}) >= 4
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="holds no items"):
        load_swap_set(empty)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"name": "x", "prompt": "p", "source": "a", "replacement": "b", "answer": "c"}) + "\n")
    with pytest.raises(ValueError, match="Item x of .* has no swap_answer"):
        load_swap_set(bad)
    with pytest.raises(FileNotFoundError, match="No swap set 'nope'"):
        load_swap_set("nope")


def test_edits_on_a_multi_stream_model_are_refused_in_one_sentence():
    from jlens_core.models.recorder import StreamReadout

    model = make_tiny("llama")
    steer = Steer(model, LogitLens.for_model(model), " capital", 2.0, layers=[1])
    model.stream_readout = StreamReadout(collapse=lambda x: x.mean(0), stream_dim=0, description="AltUp streams")
    with pytest.raises(ValueError, match="Residual edits are not supported on 'tiny-llama': its layers pass AltUp "
                                         "streams"):
        read_prompt(model, LogitLens.for_model(model), "The capital of France is", edits=[steer])
    read_prompt(model, LogitLens.for_model(model), "The capital of France is")  # reading alone still works


def test_one_swap_basis_and_one_random_draw():
    """``swap_basis``: V = [va vb] with its float64 pseudo-inverse (V⁺ V = I), None for nearly collinear
    directions; ``Swap`` keeps exactly it per layer. The random directions of the swap's control and of
    make-it-say's are unit Gaussian draws of one generator scheme (``jlens_core.seeds``)."""
    from helpers import random_lens, tiny

    from jlens_core.interventions.lens_edits import (
        Swap,
        random_directions,
        swap_basis,
    )
    from jlens_core.interventions.read_directions import token_direction
    from jlens_core.interventions.say_ranking import RandomDirections
    from jlens_core.seeds import derive_seed, generator, unit_directions

    va, vb = unit_directions(2, 16, generator(0))
    basis, pinv = swap_basis(va, vb)
    assert basis.shape == (16, 2) and pinv.shape == (2, 16)
    torch.testing.assert_close(pinv @ basis, torch.eye(2), atol=1e-5, rtol=0)
    assert swap_basis(va, va) is None and swap_basis(va, -va) is None
    model, lens = tiny(), random_lens(tiny(), seed=1)
    swap = Swap(model, lens, 5, 7, layers=[1])
    a, b = (token_direction(model, lens, 1, t) for t in (5, 7))
    for mine, expected in zip(swap.bases[1], swap_basis(a, b)):
        torch.testing.assert_close(mine, expected, rtol=0, atol=0)
    pair = random_directions([3, 4], 16, seed=9)
    draws = torch.randn(2, 16, generator=generator(derive_seed(9, 3)))  # layer 3's pair: the generator of (9, 3)
    torch.testing.assert_close(pair[3][0], draws[0] / draws[0].norm(), rtol=0, atol=1e-7)
    assert all(abs(float(v.norm()) - 1) < 1e-6 for p in pair.values() for v in p)
    v = RandomDirections(16, seed=2)(3, 11)
    draw = torch.randn(1, 16, generator=generator(2, 3, 11))[0]  # make-it-say's: the generator of (seed, layer, token)
    torch.testing.assert_close(v, draw / draw.norm(), rtol=0, atol=1e-7)
