"""Make it say X (docs/method.md §7.1): the search, its ranking and replays, the controls, say success and
``jlens say``, on tiny models; every check against an independent computation (generate, the model's forward)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import make_hf_model
from helpers import random_lens, tiny

from jlens_core import HFLensModel, LogitLens
from jlens_core.interventions import Ablate, Steer, Swap, token_direction
from jlens_core.interventions.intervals import clopper_pearson_interval
from jlens_core.interventions.read_directions import token_directions
from jlens_core.interventions.say import make_it_say
from jlens_core.interventions.say_ranking import (
    LensDirections,
    RandomDirections,
    bands,
    clean_pass,
    rank,
    spell_target,
)
from jlens_core.interventions.say_replay import Replayer
from jlens_core.interventions.say_success import load_say_set, say_success
from jlens_core.reading.edit_hooks import EditRunner
from jlens_core.reading.generation import generate
from jlens_core.reading.tokens import encode_plain, spellings

PROMPT = "The capital of France is Paris. The capital of Italy is"
SAYS_J = "Once upon a time there was a small model"  # the tiny model's greedy next token here is 'J'
LAYERS = [0, 1, 2]


@pytest.fixture(scope="module")
def model():
    return tiny("llama")


@pytest.fixture(scope="module")
def lens(model):
    return random_lens(model)  # reads layers 0..2 of the 4-layer model


def says(model, edits, accepted) -> bool:
    """Independent check: the greedy token ``generate`` writes with ``edits`` spells the target."""
    return int(generate(model, PROMPT, max_new_tokens=1, edits=edits).generated_ids[0]) in accepted


def readout(model) -> int:
    return int(model.encode(PROMPT).shape[1]) - 1


# -- the search ----------------------------------------------------------------------------------------
def test_the_search_finds_the_one_recipe_that_works_and_the_random_control_does_not(model, lens):
    target = " of"
    x = spellings(model.tokenizer, "of", vocab_size=model.vocab_size)[target]
    accepted = set(spellings(model.tokenizer, "of", vocab_size=model.vocab_size).values())
    n = readout(model)
    random = RandomDirections(model.d_model, seed=0)
    # brute force over the whole space, by generate: exactly one band works along the lens, none at random
    works = [b for b in bands(LAYERS) if says(model, [Steer(model, lens, x, 1.0, layers=list(b), positions=[n])],
                                              accepted)]
    works_random = [b for b in bands(LAYERS) if says(model, [Steer(
        model, lens, x, 1.0, layers=list(b), positions=[n], directions={layer: random(layer, x) for layer in b})],
        accepted)]
    assert works == [(0, 1, 2)] and works_random == []

    result = make_it_say(model, lens, PROMPT, "of", layers=LAYERS, ops=["steer"], positions=["readout"],
                         grids={"steer": [1.0]}, max_replays=len(bands(LAYERS)), minimise=False,
                         controls=["random"], continuation_tokens=0)
    assert result.search.n_ranked == len(bands(LAYERS)) and result.search.n_replayed == len(bands(LAYERS))
    assert [r.layers for r in result.recipes] == works
    assert result.minimal is result.recipes[0] and result.minimal.next_token == target
    assert result.controls["random"].recipes == [] and result.controls["random"].n_replayed == len(bands(LAYERS))
    assert "controls: random: none" in result.message
    # the recipe's edits are the edit that works
    assert says(model, result.minimal.edits, accepted)
    assert repr(result.minimal.edits[0]) == repr(Steer(model, lens, x, 1.0, layers=[0, 1, 2], positions=[n]))


def test_bisection_keeps_the_smallest_strength_that_still_works(model, lens):
    result = make_it_say(model, lens, PROMPT, "of", layers=LAYERS, ops=["steer"], positions=["readout"],
                         grids={"steer": [1.0]}, controls=[], continuation_tokens=0)
    minimal = result.minimal
    accepted = set(spellings(model.tokenizer, "of", vocab_size=model.vocab_size).values())
    assert minimal.verified and minimal.layers == (0, 1, 2) and minimal.strength <= 1.0  # the halves fail
    x = spellings(model.tokenizer, "of", vocab_size=model.vocab_size)[" of"]
    n = readout(model)
    assert says(model, [Steer(model, lens, x, minimal.strength, layers=list(minimal.layers), positions=[n])], accepted)
    # every strength tried below the minimal one at its band failed (the bisection's lower bracket)
    below = [r for r in result.search.tried if r.layers == minimal.layers and r.strength < minimal.strength]
    assert below and not any(r.verified for r in below)
    for r in below:
        assert not says(model, [Steer(model, lens, x, r.strength, layers=list(r.layers), positions=[n])], accepted)


def test_a_multi_token_target_is_verified_by_greedy_decoding_of_its_tokens(model, lens):
    target = " Paris capital"
    ids = encode_plain(model.tokenizer, target)
    assert len(ids) > 1 and not spellings(model.tokenizer, target.strip(), vocab_size=model.vocab_size)
    result = make_it_say(model, lens, PROMPT, target, layers=LAYERS, max_replays=10, controls=[],
                         continuation_tokens=0)
    assert result.target_ids == ids and result.target_text == target
    assert result.search.tried
    for recipe in result.search.tried:
        written = generate(model, PROMPT, max_new_tokens=len(ids), edits=recipe.edits, top_k=1)
        assert recipe.verified == (written.generated_ids.tolist() == ids)
        # teacher-forced probability of the target: the forward over prompt + target under the same edits
        full = torch.cat([model.encode(PROMPT), torch.tensor([ids[:-1]])], dim=1)
        n = readout(model) + 1
        runner = EditRunner(model, recipe.edits, n)
        with torch.no_grad():
            logp = runner.run(lambda f=full: model.hf_model(input_ids=f).logits[0], torch.arange(full.shape[1]),
                              clean_forward=lambda f=full: model.hf_model(input_ids=f)).float().log_softmax(-1)
        expected = math.exp(sum(float(logp[n - 1 + i, t]) for i, t in enumerate(ids)))
        assert recipe.target_prob == pytest.approx(expected, rel=1e-3, abs=1e-9)


def test_the_first_order_ranking_is_the_derivative_of_the_margin(model, lens):
    """The predicted margin of a small steer and swap matches the replayed one (the gradient is right)."""
    target = spell_target(model, "of", PROMPT)
    ids = model.encode(PROMPT)
    state = clean_pass(model, ids, target, LAYERS)
    hf_logits = model.hf_model(ids).logits[0, -1].float()
    assert state.margin == pytest.approx(float(hf_logits[target.ids[0]] - hf_logits[state.competitor]), rel=1e-4)
    assert state.competitor not in target.accepted
    n = readout(model)
    ranking = rank(state, LensDirections(model, lens), target, LAYERS, ["steer"], ["readout"], 1, {}, [])
    for layer in LAYERS:
        eps = 1e-3
        steer = Steer(model, lens, target.ids[0], eps, layers=[layer], positions=[n])
        runner = EditRunner(model, [steer], n + 1)
        with torch.no_grad():
            z = runner.run(lambda: model.hf_model(input_ids=ids).logits[0, -1].float(), torch.arange(n + 1))
        actual = float(z[target.ids[0]] - z[state.competitor])
        predicted = ranking.predict("steer", [layer], "readout", eps)
        assert predicted - state.margin == pytest.approx(actual - state.margin, rel=0.05, abs=1e-5)


def test_readout_edits_leave_the_other_positions_and_the_cached_replay_is_the_full_forward(model, lens):
    target = spell_target(model, "of", PROMPT)
    ids = model.encode(PROMPT)
    n = readout(model)
    continuation = generate(model, PROMPT, max_new_tokens=5, top_k=1).generated_ids.tolist()
    replayer = Replayer(model, ids, target, LAYERS, continuation)
    steer = Steer(model, lens, target.ids[0], 1.0, layers=[1, 2], positions=[n])
    cached, full = replayer.run([steer], n), replayer.run([steer], 0)
    assert cached.verified == full.verified and cached.next_id == full.next_id
    assert cached.target_prob == pytest.approx(full.target_prob, rel=1e-4)
    assert cached.readout_kl_bits == pytest.approx(full.readout_kl_bits, rel=1e-3) and cached.readout_kl_bits > 0
    assert math.isnan(cached.prompt_kl_bits)  # a readout edit touches no other prompt position
    assert full.prompt_kl_bits == pytest.approx(0, abs=1e-6)  # computed from position 0: a causal model
    assert replayer.downstream([steer], n)[0] > 0  # a readout edit reaches the continuation through attention
    everywhere = Steer(model, lens, target.ids[0], 1.0, layers=[1, 2], positions=range(2, n + 1))
    # the downstream figure, cached from position 2, against the full forward over prompt + continuation
    tokens = torch.cat([ids, torch.tensor([continuation])], dim=1)
    with torch.no_grad():
        clean_lp = model.hf_model(input_ids=tokens).logits[0].float().log_softmax(-1)
        edited_lp = EditRunner(model, [everywhere], n + 1).run(
            lambda: model.hf_model(input_ids=tokens).logits[0].float(), torch.arange(tokens.shape[1])).log_softmax(-1)
    kl = (edited_lp.exp() * (edited_lp - clean_lp)).sum(-1)[n + 1:] / math.log(2)
    mean, largest = replayer.downstream([everywhere], 2)
    assert mean == pytest.approx(float(kl.mean()), rel=1e-2) and mean > 1e-3
    assert largest == pytest.approx(float(kl.max()), rel=1e-2)
    edited = replayer.run([everywhere], 2)
    # independent: KL(edited || clean) at the prompt positions the edit touches before the readout (2..n-1), bits
    with torch.no_grad():
        clean_logp = model.hf_model(ids).logits[0].float().log_softmax(-1)
        runner = EditRunner(model, [everywhere], n + 1)
        logp = runner.run(lambda: model.hf_model(input_ids=ids).logits[0].float(), torch.arange(n + 1)).log_softmax(-1)
    kl = (logp.exp() * (logp - clean_logp)).sum(-1)[2:n] / math.log(2)
    assert edited.prompt_kl_bits == pytest.approx(float(kl.mean()), rel=1e-3) and edited.prompt_kl_bits > 0
    assert edited.prompt_kl_max_bits == pytest.approx(float(kl.max()), rel=1e-3)


def test_swap_and_ablate_recipes_are_the_edits_they_name(model, lens):
    result = make_it_say(model, lens, PROMPT, "time", layers=LAYERS, ops=["swap", "ablate"], max_replays=6,
                         minimise=False, controls=["random", "logit"], continuation_tokens=0)
    n = readout(model)
    x = result.target_ids[0]
    for recipe in result.search.tried:
        if recipe.op == "swap":
            assert len(recipe.edits) == recipe.width and all(isinstance(e, Swap) for e in recipe.edits)
            for edit, layer in zip(recipe.edits, recipe.layers):
                assert edit.replacement_id == x and edit.layers == [layer]
                assert model.decode([edit.source_id]) == recipe.tokens[layer]
        else:
            assert all(isinstance(e, Ablate) for e in recipe.edits) and len(recipe.edits) == recipe.strength
            assert [model.decode([e.token_id]) for e in recipe.edits] == recipe.tokens
        assert recipe.positions == ((n,) if recipe.position_mode == "readout" else tuple(range(1, n + 1)))
    # the random arm's edits are along the seeded random directions, the logit arm's along the logit lens's
    rand = result.controls["random"].tried[0]
    assert "given directions" in repr(rand.edits[0])
    logit = result.controls["logit"].tried[0]
    assert "logit lens" in repr(logit.edits[0])
    table = result.table(verified_only=False)
    assert len(table) == sum(len(a.tried) for a in result.arms.values())
    json.dumps(result.to_dict(), default=str)  # JSON-ready


def test_the_model_already_saying_it_and_a_search_that_finds_nothing(model, lens):
    assert model.decode([int(model.hf_model(model.encode(SAYS_J)).logits[0, -1].argmax())]) == "J"
    already = make_it_say(model, lens, SAYS_J, "J", layers=LAYERS, controls=[], continuation_tokens=0)
    assert already.already and already.search.n_replayed == 0 and already.clean_next == "J"
    assert already.message == f"The model already says {already.target_text!r} here: no edit is needed."
    nothing = make_it_say(model, lens, PROMPT, "capital", layers=[0], ops=["ablate"], positions=["readout"],
                          grids={"ablate": [1]}, max_replays=1, controls=[], continuation_tokens=0)
    assert not nothing.search.found
    assert nothing.message.startswith("No edit made the model say ' capital': ranked 1 candidates (ablate up to 1 "
                                      "competitors; layers 0; at the readout) and replayed 1 of them, at most 1")
    assert "the closest, ablate the 1 best competitor at layer 0, readout" in nothing.message


def test_progress_is_reported_and_returning_true_stops_the_search(model, lens):
    seen = []

    def stop_after_three(p):
        seen.append((p.stage, p.done, p.total))
        return len(seen) >= 3

    result = make_it_say(model, lens, PROMPT, "time", layers=LAYERS, controls=["random"], continuation_tokens=0,
                         progress=stop_after_three)
    assert result.stopped and len(seen) == 3 and "(stopped early)" in result.message
    assert [s for s, _, _ in seen][:2] == ["rank", "rank"] and all(d <= t for _, d, t in seen)
    assert result.search.n_replayed <= 1 and "random" not in result.controls


# -- bad input -----------------------------------------------------------------------------------------
def word_model() -> HFLensModel:
    """A tiny model with a word-level tokenizer that has an unknown token: it cannot spell every word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "<s>", "the", "capital", "of", "France", "is", "Paris", "Rome", "Italy"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>")
    return HFLensModel(make_hf_model("llama"), fast, name="tiny-words")


def test_bad_input_is_one_sentence(model, lens):
    def fails(match, **kwargs):
        args = {"prompt": PROMPT, "target": "of"} | kwargs
        with pytest.raises(ValueError, match=match):
            make_it_say(model, lens, args.pop("prompt"), args.pop("target"), **args)

    fails(r"^The prompt is empty: give the text the model should continue\.$", prompt="  ")
    fails(r"^The target is empty: give the word the model should say\.$", target=" ")
    fails(r"^Layer 9 is out of range: the model has 4 layers", layers=[9])
    fails(r"^Layer 3 is outside the lens: it reads layers 0\.\.2", layers=[3])
    fails(r"^from_position=40 is outside the prompt: it has positions 0\.\.\d+\.$", from_position=40)
    fails(r"^Edit \['nudge'\] is not allowed: choose from steer, swap, ablate\.$", ops=["nudge"])
    fails(r"^The steer grid \[9\.0\] must hold numbers in \(0, 4\]\.$", grids={"steer": [9.0]})
    fails(r"^The ablate grid \[1\.5\] counts competitors: give whole numbers\.$", grids={"ablate": [1.5]})
    fails(r"^Control \['shuffle'\] is not allowed", controls=["shuffle"])
    fails(r"^The target ' capital of France is Paris capital of France is Paris capital' is \d+ tokens long",
          target=" capital of France is Paris capital of France is Paris capital")
    words = word_model()
    with pytest.raises(ValueError, match=r"^The tokenizer cannot spell the target 'zebra': its tokens read back as "
                                         r"'\[UNK\]'; give a word made of characters the tokenizer knows\.$"):
        make_it_say(words, LogitLens.for_model(words), "the capital of France is", "zebra")


# -- directions ----------------------------------------------------------------------------------------
def test_batched_directions_are_the_single_ones_and_given_directions_replace_them(model, lens):
    ids = [5, 17, 40, 5]
    batch = token_directions(model, lens, 1, ids)
    fresh = random_lens(model)  # nothing cached: one at a time through the old path's definition
    for row, t in zip(batch, ids):
        torch.testing.assert_close(row, token_direction(model, fresh, 1, t), rtol=1e-5, atol=1e-6)
    assert batch.shape == (4, model.d_model) and batch[0].equal(batch[3])
    with pytest.raises(ValueError, match=r"Token id 999 is outside the vocabulary"):
        token_directions(model, lens, 1, [999])
    v = torch.randn(model.d_model)
    steer = Steer(model, lens, " of", 0.5, layers=[1], directions={1: 3 * v})
    h = torch.randn(2, model.d_model)
    expected = h + 0.5 * h.norm(dim=-1, keepdim=True) * (v / v.norm())
    torch.testing.assert_close(steer.apply(1, h, None), expected)
    assert "given directions" in repr(steer)
    with pytest.raises(ValueError, match=r"directions has no vector for layer 2"):
        Ablate(model, lens, " of", layers=[1, 2], directions={1: v})


# -- say success ---------------------------------------------------------------------------------------
def test_say_success_counts_items_with_a_verified_recipe_per_arm(model, lens):
    items = [{"name": "of", "prompt": PROMPT, "answer": "x", "target": "of"},
             {"name": "already", "prompt": SAYS_J, "answer": "J", "target": "J"},
             {"name": "time", "prompt": PROMPT, "answer": "x", "target": "time"}]
    report = say_success(model, {"jacobian": lens}, items, layers=LAYERS, ops=["steer"], positions=["readout"],
                         max_replays=4)
    assert list(report.summary["arm"]) == ["jacobian", "logit", "random"]
    assert report.n_items == 3 and report.n_scored == 2
    table = report.items.set_index("name")
    assert not table.loc["already", "scored"] and "already says" in table.loc["already", "reason"]
    assert table.loc["already", "answered"] and not table.loc["of", "answered"]
    for arm in ("jacobian", "logit", "random"):
        row = report.summary.set_index("arm").loc[arm]
        wins = int(table.loc[["of", "time"], arm].astype(bool).sum())
        assert row["items"] == 2 and row["successes"] == wins
        assert (row["ci_low"], row["ci_high"]) == pytest.approx(clopper_pearson_interval(wins, 2))
        # each success is the search's own result on that item (the same settings, one arm at a time)
    alone = make_it_say(model, lens, PROMPT, "of", layers=LAYERS, ops=["steer"], positions=["readout"],
                        max_replays=4, controls=[], continuation_tokens=0)
    assert bool(table.loc["of", "jacobian"]) == alone.search.found
    if alone.search.found:
        assert table.loc["of", "jacobian width"] == alone.minimal.width
        assert table.loc["of", "jacobian strength"] == pytest.approx(alone.minimal.strength)


def test_the_shipped_say_set_is_large_disjoint_and_counterfactual():
    from jlens_core.interventions import load_swap_set

    items = load_say_set("say")
    assert len(items) >= 40 and len({i["relation"] for i in items}) >= 5
    assert all(i["answer"].strip().lower() != i["target"].strip().lower() for i in items)
    assert not {i["prompt"] for i in items} & {i["prompt"] for i in load_swap_set("swaps")}
    assert len({i["name"] for i in items}) == len(items)
    with pytest.raises(FileNotFoundError, match="No say set 'nope'"):
        load_say_set("nope")


# -- jlens say -----------------------------------------------------------------------------------------
def test_cli_say_json_is_the_library_result(tiny_dir, capsys):
    from jlens_core.cli.main import main
    from jlens_core.models.loading import load_model

    code = main(["say", "--model", tiny_dir, "--lens", "logit", "--prompt", PROMPT, "--target", "of", "--layers", "0:3",
                 "--max-replays", "4", "--max-new-tokens", "3", "--format", "json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    loaded = load_model(tiny_dir, device="cpu")
    expected = make_it_say(loaded, LogitLens.for_model(loaded), PROMPT, "of", layers=[0, 1, 2], max_replays=4,
                           continuation_tokens=3).to_dict()
    for key in ("target_text", "target_ids", "clean_next", "n_ranked", "n_replayed", "message", "already",
                "edited_continuation", "clean_continuation"):
        assert out[key] == expected[key], key
    assert out["search"]["minimal"] == json.loads(json.dumps(expected["search"]["minimal"], default=str))
    assert set(out["controls"]) == {"random"}  # the logit lens is the lens: no logit control
    assert set(out["timings"]) >= {"clean", "rank", "replay", "total"}


def test_cli_say_text_labels_every_row_by_arm_and_gives_each_arms_minimal_recipe(tiny_dir, capsys):
    from jlens_core.cli.main import main

    args = ["say", "--model", tiny_dir, "--lens", "logit", "--prompt", PROMPT, "--target", "of", "--layers", "0:3",
            "--max-replays", "4", "--max-new-tokens", "0", "--downstream-tokens", "3"]
    assert main(args + ["--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    text = capsys.readouterr().out
    arms = {data["search"]["name"]: data["search"], **data["controls"]}
    rows = [line for line in text.splitlines() if "P=" in line]
    assert len(rows) == sum(len(a["verified"]) for a in arms.values())
    for name, arm in arms.items():
        labelled = [line for line in rows if f"[{name}]" in line]
        assert len(labelled) == len(arm["verified"])
        for line, recipe in zip(labelled, arm["verified"]):
            assert f"readout KL {recipe['readout_kl_bits']:.3g} bits" in line
    minimal = text[text.index("minimal recipe per arm"):].splitlines()[1:1 + len(arms)]
    for line, (name, arm) in zip(minimal, arms.items()):
        assert line.split()[0] == f"{name}:"
        assert ("none found" in line) == (arm["minimal"] is None)
        if arm["minimal"] is not None:
            assert f"readout KL {arm['minimal']['readout_kl_bits']:.3g} bits" in line
            assert f"layer{'s' if arm['minimal']['width'] > 1 else ''} {arm['minimal']['layers']}," in line


def test_cli_say_bad_input_and_set(tiny_dir, tmp_path, capsys):
    from jlens_core.cli.main import main

    assert main(["say", "--model", tiny_dir, "--lens", "logit", "--prompt", " ", "--target", "x"]) == 2
    assert "jlens say: error: --prompt is empty" in capsys.readouterr().err
    assert main(["say", "--model", tiny_dir, "--lens", "logit", "--prompt", PROMPT, "--target", "of",
                 "--steer-grid", "a,b"]) == 2
    assert "--steer-grid 'a,b' must be comma-separated numbers" in capsys.readouterr().err
    assert main(["say", "--model", tiny_dir, "--lens", "logit", "--prompt", PROMPT, "--target", "of",
                 "--layers", "40"]) == 2
    assert "out of range" in capsys.readouterr().err
    items = tmp_path / "items.jsonl"
    items.write_text("\n".join(json.dumps({"prompt": PROMPT, "answer": "x", "target": t}) for t in ("of", "time")))
    out = tmp_path / "out"
    assert main(["say", "--model", tiny_dir, "--lens", "logit", "--set", str(items), "--layers", "0:3",
                 "--max-replays", "2", "--out", str(out), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["n_items"] == 2 and [r["arm"] for r in report["summary"]] == ["logit", "random"]
    assert (out / "say_success.csv").is_file() and (out / "say_items.csv").is_file()


def test_the_bench_prompt_has_the_length_asked_for(model):
    from helpers import load_script

    bench = load_script("bench/say_speed.py")
    for n in (32, 40):
        text = bench.prompt_of(model, n)
        assert text.endswith(bench.QUESTION) and int(model.encode(text).shape[1]) == n
