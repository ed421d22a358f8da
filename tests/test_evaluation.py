"""evaluate (per-layer KL / CE over a corpus), pass@k, and the shipped evaluation sets."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import LONG_TEXT, make_tiny

from jlens_core import JacobianLens, LensFileError, LogitLens
from jlens_core.reading.evaluation import EVALUATE_COLUMNS, evaluate
from jlens_core.reading.passk import (
    DETAIL_COLUMNS,
    EVAL_DIR,
    EVAL_SETS,
    PASS_COLUMNS,
    load_eval_set,
    pass_at_k,
    summarize_pass_at_k,
)
from jlens_core.reading.tokens import spellings

TEXTS = [LONG_TEXT, "Once upon a time there was a small model that read every layer of itself.",
         "def add(a, b):\n    return a + b\n\nprint(add(12, 345))"]


def identity_lens(model, layers=None, **kwargs) -> JacobianLens:
    layers = range(model.n_layers - 1) if layers is None else layers
    return JacobianLens({layer: torch.eye(model.d_model) for layer in layers}, n_prompts=1,
                        d_model=model.d_model, target_layer=model.n_layers - 1, n_layers=model.n_layers,
                        model_name=model.name, model_fingerprint=model.fingerprint(), **kwargs)


def reference_logits(model, ids) -> list[torch.Tensor]:
    """Logit-lens logits ``[seq, vocab]`` per layer from HF's hidden states (last: the model output)."""
    hf = model.hf_model
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
        logits = [hf.lm_head(model.final_norm(out.hidden_states[layer + 1][0])).float()
                  for layer in range(model.n_layers - 1)]
        logits.append(out.logits[0].float())
    return logits


@pytest.fixture(scope="module")
def model():
    return make_tiny("llama")


def test_evaluate_frame_and_values(model):
    skip, max_len = 4, 40
    lenses = {"logit": LogitLens.for_model(model), "jac": identity_lens(model, layers=[0, 2])}
    calls = []
    frame = evaluate(model, lenses, TEXTS, max_seq_len=max_len, skip_first=skip,
                     progress=lambda done, total: calls.append((done, total)))
    assert list(frame.columns) == list(EVALUATE_COLUMNS)
    assert frame[["lens", "layer"]].values.tolist() == [["logit", 0], ["logit", 1], ["logit", 2], ["logit", 3],
                                                       ["jac", 0], ["jac", 2], ["jac", 3]]
    assert calls == [(1, 3), (2, 3), (3, 3)]
    assert frame.attrs["skip_first"] == skip and frame.attrs["n_skipped"] == 0

    # independent computation: the logit lens from HF hidden states, positions [skip, seq - 1)
    kl_all, ce_all = {layer: [] for layer in range(model.n_layers)}, {layer: [] for layer in range(model.n_layers)}
    for text in TEXTS:
        ids = model.encode(text, max_length=max_len)
        seq = ids.shape[1]
        per_layer = reference_logits(model, ids)
        final = per_layer[-1].log_softmax(-1)[skip:seq - 1]
        nxt = ids[0, skip + 1:seq]
        for layer, logits in enumerate(per_layer):
            logp = logits.log_softmax(-1)[skip:seq - 1]
            kl_all[layer] += ((final.exp() * (final - logp)).sum(-1) / math.log(2)).tolist()
            ce_all[layer] += (-logp.gather(-1, nxt[:, None])[:, 0] / math.log(2)).tolist()
    logit = frame[frame.lens == "logit"].set_index("layer")
    for layer in range(model.n_layers):
        kl, ce = np.array(kl_all[layer]), np.array(ce_all[layer])
        assert logit.loc[layer, "n_tokens"] == len(kl)
        assert logit.loc[layer, "kl_bits"] == pytest.approx(kl.clip(0).mean(), rel=1e-4, abs=1e-6)
        assert logit.loc[layer, "ce_bits"] == pytest.approx(ce.mean(), rel=1e-5)
        assert logit.loc[layer, "ce_se"] == pytest.approx(ce.std(ddof=1) / math.sqrt(len(ce)), rel=1e-3)
    assert logit.loc[3, "kl_bits"] == 0.0 and logit.loc[3, "kl_se"] == 0.0
    # the model's own loss at the last layer, as HF computes it (nats -> bits), on a single text
    one = evaluate(model, {"logit": lenses["logit"]}, [TEXTS[0]], max_seq_len=max_len, skip_first=0)
    ids = model.encode(TEXTS[0], max_length=max_len)
    loss = model.hf_model(ids, labels=ids).loss.item() / math.log(2)
    assert one.set_index("layer").loc[3, "ce_bits"] == pytest.approx(loss, rel=1e-5)
    # J = I reads like the logit lens at the layers it has
    jac = frame[frame.lens == "jac"].set_index("layer")
    for col in ("kl_bits", "ce_bits", "n_tokens"):
        np.testing.assert_allclose(jac[col].to_numpy(), logit.loc[[0, 2, 3], col].to_numpy())


def test_skip_first_default(model):
    texts = [LONG_TEXT]
    assert evaluate(model, {"logit": LogitLens.for_model(model)}, texts).attrs["skip_first"] == 16
    fitted = identity_lens(model, settings={"skip_first": 5})
    frame = evaluate(model, {"j": fitted, "logit": LogitLens.for_model(model)}, texts)
    assert frame.attrs["skip_first"] == 5
    n = model.encode(LONG_TEXT, max_length=128).shape[1]
    assert (frame["n_tokens"] == n - 1 - 5).all()


def test_short_texts(model):
    lens = {"logit": LogitLens.for_model(model)}
    frame = evaluate(model, lens, [LONG_TEXT, "Hi.", ""], skip_first=4)
    assert frame.attrs["n_skipped"] == 2 and (frame["n_texts"] == 1).all()
    with pytest.raises(ValueError, match="None of the 2 texts has a position to evaluate"):
        evaluate(model, lens, ["Too short.", "Tiny"], skip_first=16)
    with pytest.raises(ValueError, match="max_seq_len=10"):
        evaluate(model, lens, [LONG_TEXT], max_seq_len=10, skip_first=16)
    with pytest.raises(ValueError, match="texts is empty"):
        evaluate(model, lens, [])
    with pytest.raises(ValueError, match="lenses is empty"):
        evaluate(model, {}, [LONG_TEXT])


def test_lens_for_another_model(model):
    other = make_tiny("llama", seed=1)
    with pytest.raises(LensFileError, match="unembedding differs"):
        evaluate(model, {"j": identity_lens(other)}, [LONG_TEXT])
    with pytest.raises(LensFileError):
        pass_at_k(model, {"logit": LogitLens(model.n_layers + 2, model.d_model)}, ITEMS)


ITEMS = [
    {"prompt": "The capital of France is", "intermediates": ["France"], "target": "Paris"},
    {"prompt": "Water boils at one hundred", "intermediates": ["water", "boils"], "target": "degrees"},
    {"prompt": "def add(a, b):\n    return", "intermediates": "a", "target": "b"},
]


def test_pass_at_k_first_token_rule_frames_and_values(model):
    """``spelling="first_token"``: the older rule, every word scored; checked against HF's own hidden states."""
    lenses = {"logit": LogitLens.for_model(model), "jac": identity_lens(model, layers=[1])}
    summary, detail = pass_at_k(model, lenses, ITEMS, k=(1, 5, 50, 300), return_detail=True, spelling="first_token")
    assert list(summary.columns) == list(PASS_COLUMNS)
    assert list(detail.columns) == list(DETAIL_COLUMNS)
    assert summary[["lens", "k"]].values.tolist() == [[n, k] for n in ("logit", "jac") for k in (1, 5, 50, 300)]
    assert (summary["n_items"] == 3).all() and (summary["n_words"] == 4).all() and (summary["words_scored"] == 4).all()
    assert len(detail) == 2 * (4 + 3)
    # every rank is in the full vocabulary: k = vocab passes everything
    assert (summary[summary.k == 300]["pass_rate"] == 1.0).all()

    # independent best ranks for the logit lens
    for i, item in enumerate(ITEMS):
        ids = model.encode(item["prompt"])
        last = torch.stack([logits[-1] for logits in reference_logits(model, ids)])  # [n_layers, vocab]
        words = item["intermediates"] if isinstance(item["intermediates"], list) else [item["intermediates"]]
        for role, word in [("intermediate", w) for w in words] + [("target", item["target"])]:
            cands = list(spellings(model.tokenizer, word, rule="first").values())
            ranks = torch.stack([(last > last[:, [c]]).sum(-1) + 1 for c in cands]).min(0).values  # [n_layers]
            row = detail[(detail.item == i) & (detail.lens == "logit") & (detail.word == word)].iloc[0]
            assert row.role == role and row.token_ids == cands
            assert row.best_rank == int(ranks.min()) and row.best_layer == int(torch.argmin(ranks))
            assert row.final_rank == int(ranks[-1])
            jrow = detail[(detail.item == i) & (detail.lens == "jac") & (detail.word == word)].iloc[0]
            assert jrow.best_rank == int(ranks[[1, 3]].min()) and jrow.best_layer in (1, 3)
    # the set's score: the mean over items of each item's share of intermediates found
    logit_inter = detail[(detail.lens == "logit") & (detail.role == "intermediate")]
    for k in (1, 5, 50):
        expected = float((logit_inter.best_rank <= k).groupby(logit_inter.item).mean().mean())
        got = summary[(summary.lens == "logit") & (summary.k == k)].pass_rate.item()
        assert got == pytest.approx(expected)
    again = summarize_pass_at_k(detail, 5)
    pd.testing.assert_frame_equal(again, summary[summary.k == 5].reset_index(drop=True))


def test_pass_at_k_bad_input(model):
    lens = {"logit": LogitLens.for_model(model)}
    with pytest.raises(ValueError, match="k=0"):
        pass_at_k(model, lens, ITEMS, k=0)
    with pytest.raises(ValueError, match=r"item 0: missing field\(s\) \['intermediates'\]"):
        pass_at_k(model, lens, [{"prompt": "x", "target": "y"}])
    with pytest.raises(ValueError, match=r"item 0: missing field\(s\) \['prompt'\]"):
        pass_at_k(model, lens, [{"intermediates": ["y"]}])
    with pytest.raises(ValueError, match="item 0: 'intermediates' must be a list"):
        pass_at_k(model, lens, [{"prompt": "x", "intermediates": [""], "target": "z"}])
    with pytest.raises(ValueError, match="items is empty"):
        pass_at_k(model, lens, [])
    with pytest.raises(ValueError, match="unknown readout rule 'middle'"):
        pass_at_k(model, lens, ITEMS, readout="middle")
    with pytest.raises(ValueError, match=r"item 0: readout \{'before': 'zebra'\}: 'zebra' is not in the prompt"):
        pass_at_k(model, lens, ITEMS[:1], readout={"before": "zebra"})


def test_shipped_eval_sets(model):
    shipped = sorted(p.stem for p in EVAL_DIR.glob("*.json"))
    assert shipped == sorted(EVAL_SETS) and "two_hop" in shipped
    for name in shipped:
        items = load_eval_set(name)
        assert len(items) >= 20, name
        names = [item["name"] for item in items]
        assert len(set(names)) == len(names), name
        for item in items:
            assert item["prompt"].strip()
            assert item["intermediates"] and all(isinstance(w, str) and w.strip() for w in item["intermediates"])
            assert item["readout"] in ("last", "last_newline")
    two_hop = load_eval_set("two_hop")
    assert two_hop[0]["intermediates"] == ["France"] and two_hop[0]["target"] == "Paris"
    assert load_eval_set("arithmetic_chain")[0]["synonyms"] == "numbers_ops"
    summary = pass_at_k(model, {"logit": LogitLens.for_model(model)}, "antonym_chain", k=(1, 10))
    assert summary["n_items"].tolist() == [28, 28]


def test_load_eval_set_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="two_hop"):
        load_eval_set("no_such_set")
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"prompt": "a", "intermediates": ["b"], "target": "c"}) + "\n\n{oops\n")
    with pytest.raises(ValueError, match=r"mine.jsonl:3: not valid JSON"):
        load_eval_set(path)
    path.write_text(json.dumps({"prompt": "a", "intermediates": "b", "target": "c", "note": "kept"}) + "\n")
    assert load_eval_set(str(path)) == [{"prompt": "a", "intermediates": ["b"], "target": "c", "note": "kept"}]
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"sets": []}))
    with pytest.raises(ValueError, match="has no 'items' list"):
        load_eval_set(ref)
    ref.write_text(json.dumps({"items": [{"name": "x", "prompt": "p"}]}))
    with pytest.raises(ValueError, match=r"ref.json item 1 \(x\): missing field\(s\) \['intermediates'\]"):
        load_eval_set(ref)
    ref.write_text(json.dumps({"readout": "sideways", "items": [{"prompt": "p", "intermediates": ["q"]}]}))
    with pytest.raises(ValueError, match="unknown readout rule 'sideways'"):
        load_eval_set(ref)
    ref.write_text(json.dumps({"readout": "last_newline", "synonyms": "numbers_ops",
                               "items": [{"prompt": "p", "intermediates": ["q"]},
                                         {"prompt": "p", "intermediates": ["q"], "readout": -2}]}))
    items = load_eval_set(ref)
    assert items[0]["readout"] == "last_newline" and items[1]["readout"] == -2
    assert items[0]["synonyms"] == "numbers_ops" and "target" not in items[0]
