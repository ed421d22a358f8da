"""Side effects (docs/method.md §7.2): the plain-tensor figures against numpy, and on a tiny model a readout edit
that moves the rest of the distribution (figures above zero) and one that leaves it alone (near zero), in
make_it_say, compare_runs, swap success and say success; one rule for the minimal recipe."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch
from helpers import random_lens, tiny

from jlens_core.interventions import Steer
from jlens_core.interventions.compare import compare_runs
from jlens_core.interventions.intervals import bootstrap_interval
from jlens_core.interventions.say import make_it_say, minimal_key, minimal_recipe
from jlens_core.interventions.side_effects import (
    check_downstream_tokens,
    clean_continuation,
    divergence_stats,
    kl_bits,
    readout_divergence,
    set_figures,
    teacher_forced_side_effects,
)
from jlens_core.reading.generation import generate
from jlens_core.reading.tokens import spellings

PROMPT = "The capital of France is Paris. The capital of Italy is"
LAYERS = [0, 1, 2]
swap_module = importlib.import_module("jlens_core.interventions.swap_success")
say_module = importlib.import_module("jlens_core.interventions.say_success")


@pytest.fixture(scope="module")
def model():
    return tiny("llama")


@pytest.fixture(scope="module")
def lens(model):
    return random_lens(model)


def np_kl_bits(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """Independent: KL(p || q) in bits from logits, in float64 numpy."""
    p = np.exp(p_logits - p_logits.max())
    p /= p.sum()
    q = np.exp(q_logits - q_logits.max())
    q /= q.sum()
    keep = p > 0
    return float((p[keep] * np.log2(p[keep] / q[keep])).sum())


# -- the plain-tensor figures --------------------------------------------------------------------------
def test_kl_and_the_readout_divergence_against_numpy():
    gen = torch.Generator().manual_seed(0)
    clean, edited = torch.randn(50, generator=gen, dtype=torch.float64), torch.randn(50, generator=gen,
                                                                                  dtype=torch.float64)
    full = float(kl_bits(edited.log_softmax(-1), clean.log_softmax(-1)))
    assert full == pytest.approx(np_kl_bits(edited.numpy(), clean.numpy()), rel=1e-9)
    exclude = [3, 7]
    kept = [i for i in range(50) if i not in exclude]
    assert readout_divergence(edited, clean, exclude) == pytest.approx(
        np_kl_bits(edited.numpy()[kept], clean.numpy()[kept]), rel=1e-6)
    # an edit of the target's logit only: the rest, renormalised, has not moved; the full distribution has
    only_target = clean.clone()
    only_target[3] += 9.0
    assert readout_divergence(only_target, clean, [3]) == pytest.approx(0, abs=1e-9)
    assert float(kl_bits(only_target.log_softmax(-1), clean.log_softmax(-1))) > 0.5
    # the same edit plus a shuffle of the rest: a side effect the figure shows
    scrambled = only_target.clone()
    scrambled[kept] = only_target[kept][torch.randperm(len(kept), generator=gen)]
    assert readout_divergence(scrambled, clean, [3]) > 0.1
    with pytest.raises(ValueError, match="leaves out all 3 tokens"):
        readout_divergence(torch.zeros(3), torch.zeros(3), [0, 1, 2])


def test_divergence_stats_and_set_figures_against_numpy():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(6, 20, generator=gen), torch.randn(6, 20, generator=gen)
    per_row = [np_kl_bits(a[i].double().numpy(), b[i].double().numpy()) for i in range(6)]
    mean, largest = divergence_stats(a, b)
    assert mean == pytest.approx(np.mean(per_row), rel=1e-4) and largest == pytest.approx(max(per_row), rel=1e-4)
    assert all(math.isnan(x) for x in divergence_stats(a[:0], b[:0]))
    values = [0.3, float("nan"), 0.1, 0.7, 0.2]
    kept = [0.3, 0.1, 0.7, 0.2]
    figures = set_figures(values, "readout_kl")
    assert figures["readout_kl_bits"] == pytest.approx(np.mean(kept))
    assert figures["readout_kl_median"] == pytest.approx(np.median(kept))
    assert (figures["readout_kl_low"], figures["readout_kl_high"]) == bootstrap_interval(kept)
    assert figures["readout_kl_low"] <= figures["readout_kl_bits"] <= figures["readout_kl_high"]
    assert all(math.isnan(v) for v in set_figures([float("nan")], "x").values())
    for bad in (-1, 257, 1.5, True):
        with pytest.raises(ValueError, match="downstream_tokens="):
            check_downstream_tokens(bad)


# -- on a tiny model -------------------------------------------------------------------------------------
def independent_effects(model, edits, continuation, exclude):
    """Readout and downstream KL by hand: generate's step distributions are not used, only full forwards."""
    ids = torch.cat([model.encode(PROMPT), torch.tensor([continuation])], dim=1)
    n = int(model.encode(PROMPT).shape[1])
    from jlens_core.reading.edit_hooks import EditRunner

    with torch.no_grad():
        clean = model.hf_model(input_ids=ids).logits[0].double()
        edited = EditRunner(model, edits, n).run(lambda: model.hf_model(input_ids=ids).logits[0],
                                                 torch.arange(ids.shape[1]),
                                                 clean_forward=lambda: model.hf_model(input_ids=ids)).double()
    kept = [i for i in range(clean.shape[1]) if i not in exclude]
    readout = np_kl_bits(edited[n - 1, kept].numpy(), clean[n - 1, kept].numpy())
    down = [np_kl_bits(edited[i].numpy(), clean[i].numpy()) for i in range(n, ids.shape[1])]
    return readout, float(np.mean(down)), float(max(down))


def test_a_readout_edit_that_moves_the_rest_shows_and_one_that_does_not_is_zero(model, lens):
    x = spellings(model.tokenizer, "of", vocab_size=model.vocab_size)[" of"]
    exclude = set(spellings(model.tokenizer, "of", vocab_size=model.vocab_size).values())
    n = int(model.encode(PROMPT).shape[1])
    continuation = clean_continuation(model, model.encode(PROMPT), 6)
    assert continuation == generate(model, PROMPT, max_new_tokens=6).generated_ids.tolist()
    moves = [Steer(model, lens, x, 4.0, layers=LAYERS, positions=range(1, n))]
    effects = teacher_forced_side_effects(model, model.encode(PROMPT), continuation, moves, exclude)
    readout, mean, largest = independent_effects(model, moves, continuation, exclude)
    assert effects.readout_bits == pytest.approx(readout, rel=1e-3) and effects.readout_bits > 1e-3
    assert effects.downstream_bits == pytest.approx(mean, rel=1e-3) and effects.downstream_bits > 1e-3
    assert effects.downstream_max_bits == pytest.approx(largest, rel=1e-3) and effects.n_downstream == 6
    still = [Steer(model, lens, x, 0.0, layers=LAYERS, positions=range(1, n))]  # strength 0: the identity
    nothing = teacher_forced_side_effects(model, model.encode(PROMPT), continuation, still, exclude)
    assert nothing.readout_bits == pytest.approx(0, abs=1e-6) and nothing.downstream_bits == pytest.approx(0, abs=1e-6)


def test_make_it_say_recipes_carry_side_effects_that_can_fail(model, lens):
    result = make_it_say(model, lens, PROMPT, "of", layers=LAYERS, ops=["steer"], positions=["readout", "from"],
                         grids={"steer": [1.0, 4.0]}, max_replays=8, controls=[], continuation_tokens=0,
                         downstream_tokens=5)
    exclude = set(result.target_ids) | set(spellings(model.tokenizer, "of", vocab_size=model.vocab_size).values())
    continuation = clean_continuation(model, model.encode(PROMPT), 5)
    assert result.recipes
    for recipe in result.search.tried:
        readout, mean, largest = independent_effects(model, recipe.edits, continuation, exclude)
        assert recipe.readout_kl_bits == pytest.approx(readout, rel=1e-2, abs=1e-6)
        assert recipe.readout_kl_bits > 1e-4  # a steer toward X moves the rest too: the figure is not 0
        if recipe.verified:
            assert recipe.downstream_kl_bits == pytest.approx(mean, rel=1e-2, abs=1e-6)
            assert recipe.downstream_kl_max_bits == pytest.approx(largest, rel=1e-2, abs=1e-6)
            assert recipe.downstream_kl_bits > 0
        else:
            assert math.isnan(recipe.downstream_kl_bits)  # not reported: not computed
        assert math.isnan(recipe.prompt_kl_bits) == (recipe.position_mode == "readout")
        row = recipe.row()
        assert row["readout_kl_bits"] == recipe.readout_kl_bits and "kl_bits" not in row
    assert "side effects: readout KL" in result.message
    none = make_it_say(model, lens, PROMPT, "of", layers=LAYERS, ops=["steer"], positions=["readout"],
                       grids={"steer": [1.0, 4.0]}, max_replays=2, controls=[], continuation_tokens=0,
                       downstream_tokens=0)
    assert all(math.isnan(r.downstream_kl_bits) and r.row()["downstream_kl_bits"] is None for r in none.search.tried)
    with pytest.raises(ValueError, match="downstream_tokens=-1"):
        make_it_say(model, lens, PROMPT, "of", layers=LAYERS, downstream_tokens=-1)


def test_one_rule_names_the_minimal_recipe_finished_or_stopped(model, lens):
    settings = {"layers": LAYERS, "ops": ["steer", "swap"], "max_replays": 8, "controls": ["logit"],
                "continuation_tokens": 0, "downstream_tokens": 0}
    result = make_it_say(model, lens, PROMPT, "of", **settings)
    assert sum(len(arm.recipes) > 1 for arm in result.arms.values()) >= 1  # a choice to make
    grids = {"steer": (0.25, 0.5, 1.0, 2.0, 4.0), "swap": (1.0, 2.0, 4.0, 8.0, 16.0)}
    for arm in result.arms.values():
        if arm.recipes:
            # independent: the smallest band, then readout before from, then the smallest relative strength
            best = min(arm.recipes, key=lambda r: (len(r.layers), r.position_mode == "from",
                                                      r.strength / max(grids[r.op])))
            assert arm.minimal is best is minimal_recipe(arm.recipes, grids)
    stopped = make_it_say(model, lens, PROMPT, "of", **settings, progress=lambda p: p.done >= 7)
    assert stopped.stopped and stopped.search.recipes
    for arm in stopped.arms.values():
        assert arm.minimal is minimal_recipe(arm.recipes, grids)
    assert minimal_recipe([], grids) is None
    if result.minimal is not None:
        assert minimal_key(result.minimal, grids)[0] == result.minimal.width


def test_compare_runs_reports_the_side_effects_beside_the_effect(model, lens):
    n = int(model.encode(PROMPT).shape[1])
    steer = Steer(model, lens, " of", 4.0, layers=LAYERS, positions=range(1, n))
    compared = compare_runs(model, PROMPT, [steer], max_new_tokens=5, target="of")
    exclude = set(spellings(model.tokenizer, "of", vocab_size=model.vocab_size).values())
    readout, mean, largest = independent_effects(model, [steer], compared.clean.generated_ids.tolist(), exclude)
    assert compared.readout_kl_bits == pytest.approx(readout, rel=1e-3) and compared.readout_kl_bits > 1e-3
    assert compared.downstream_kl_bits == pytest.approx(mean, rel=1e-3)
    assert compared.downstream_kl_max_bits == pytest.approx(largest, rel=1e-3)
    assert sorted(compared.readout_excluded) == sorted(model.decode([t]) for t in exclude)
    assert compared.side_effects().startswith(f"readout KL {compared.readout_kl_bits:.3g} bits (without ")
    # no target: the token the edited model writes first is left out
    default = compare_runs(model, PROMPT, [steer], max_new_tokens=5)
    assert model.decode([int(default.edited.generated_ids[0])]) in default.readout_excluded
    identity = compare_runs(model, PROMPT, [Steer(model, lens, " of", 0.0, layers=LAYERS)], max_new_tokens=5)
    assert identity.readout_kl_bits == pytest.approx(0, abs=1e-6)
    assert identity.downstream_kl_bits == pytest.approx(0, abs=1e-6)
    with pytest.raises(ValueError, match="has no single-token spelling"):
        compare_runs(model, PROMPT, [steer], max_new_tokens=2, target="Paris capital")


def test_swap_success_reports_side_effects_per_arm_and_alpha(llama):
    from test_swap_controls import eligible_prompt

    lens = random_lens(llama)
    prompt, answer = eligible_prompt(llama)
    item = {"name": "ok", "prompt": prompt, "source": "capital", "replacement": "time", "answer": answer.strip(),
            "swap_answer": "the"}
    report = swap_module.swap_success(llama, {"jacobian": lens}, [item, {**item, "name": "again"}], layers=[1, 2],
                                      alphas=(0.0, 4.0), downstream_tokens=4, norm_matched_control=False)
    assert list(report.summary.columns) == list(swap_module.SUMMARY_COLUMNS)
    row = report.items.iloc[0]
    swap = swap_module.Swap(llama, lens, " capital", " time", 4.0, layers=[1, 2])
    continuation = clean_continuation(llama, llama.encode(prompt), 4)
    ids = torch.cat([llama.encode(prompt), torch.tensor([continuation])], dim=1)
    from jlens_core.reading.edit_hooks import EditRunner

    n = int(llama.encode(prompt).shape[1])
    with torch.no_grad():
        clean = llama.hf_model(input_ids=ids).logits[0].double()
        edited = EditRunner(llama, [swap], n).run(lambda: llama.hf_model(input_ids=ids).logits[0],
                                                  torch.arange(ids.shape[1]),
                                                  clean_forward=lambda: llama.hf_model(input_ids=ids)).double()
    exclude = set(spellings(llama.tokenizer, "the", vocab_size=llama.vocab_size).values())
    kept = [i for i in range(clean.shape[1]) if i not in exclude]
    assert row["jacobian@4 readout_kl"] == pytest.approx(
        np_kl_bits(edited[n - 1, kept].numpy(), clean[n - 1, kept].numpy()), rel=1e-3)
    assert row["jacobian@4 downstream_kl"] == pytest.approx(
        np.mean([np_kl_bits(edited[i].numpy(), clean[i].numpy()) for i in range(n, ids.shape[1])]), rel=1e-3)
    assert row["jacobian@4 readout_kl"] > 0
    assert row["jacobian@0 readout_kl"] == pytest.approx(0, abs=1e-6)  # alpha 0: the identity
    summary = report.summary.set_index(["lens", "alpha"])
    assert summary.loc[("jacobian", 4.0), "readout_kl_bits"] == pytest.approx(
        report.items["jacobian@4 readout_kl"].mean())
    assert summary.loc[("jacobian", 0.0), "downstream_kl_bits"] == pytest.approx(0, abs=1e-6)


def test_say_success_reports_the_minimal_recipes_side_effects(model, lens):
    items = [{"name": "a", "prompt": PROMPT, "answer": "Rome", "target": "of"},
             {"name": "b", "prompt": "Once upon a time there was", "answer": "a", "target": "time"}]
    report = say_module.say_success(model, {"jacobian": lens}, items, layers=LAYERS, max_replays=4,
                                    downstream_tokens=4, random_control=False)
    assert list(report.summary.columns) == list(say_module.SUMMARY_COLUMNS)
    assert report.summary["successes"].sum() > 0
    expected = make_it_say(model, lens, PROMPT, "of", layers=LAYERS, max_replays=4, controls=["logit"],
                           continuation_tokens=0, downstream_tokens=4)
    row = report.items.iloc[0]
    for name, arm in expected.arms.items():
        if arm.minimal is not None:
            assert row[f"{name} readout_kl"] == pytest.approx(arm.minimal.readout_kl_bits, rel=1e-4)
            assert row[f"{name} downstream_kl"] == pytest.approx(arm.minimal.downstream_kl_bits, rel=1e-4)
    for _, summary in report.summary.iterrows():
        wins = report.items[report.items["scored"] & report.items[summary["arm"]].fillna(False).astype(bool)]
        values = wins[f"{summary['arm']} readout_kl"].astype(float)
        if len(values):
            assert summary["readout_kl_median"] == pytest.approx(values.median())
            assert summary["readout_kl_bits"] == pytest.approx(values.mean())
            assert summary["readout_kl_bits"] > 0
