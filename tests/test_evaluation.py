"""evaluation/by_layer: evaluate (per-layer KL / CE over a corpus), against HF's own hidden states."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import LONG_TEXT, make_tiny
from helpers import identity_lens, reference_logits

from jlens_core import LensFileError, LogitLens
from jlens_core.evaluation.by_layer import EVALUATE_COLUMNS, evaluate

TEXTS = [LONG_TEXT, "Once upon a time there was a small model that read every layer of itself.",
         "def add(a, b):\n    return a + b\n\nprint(add(12, 345))"]


def test_evaluate_frame_and_values(llama):
    skip, max_len = 4, 40
    lenses = {"logit": LogitLens.for_model(llama), "jac": identity_lens(llama, layers=[0, 2])}
    calls = []
    frame = evaluate(llama, lenses, TEXTS, max_seq_len=max_len, skip_first=skip,
                     progress=lambda done, total: calls.append((done, total)))
    assert list(frame.columns) == list(EVALUATE_COLUMNS)
    assert frame[["lens", "layer"]].values.tolist() == [["logit", 0], ["logit", 1], ["logit", 2], ["logit", 3],
                                                       ["jac", 0], ["jac", 2], ["jac", 3]]
    assert calls == [(1, 3), (2, 3), (3, 3)]
    assert frame.attrs["skip_first"] == skip and frame.attrs["n_skipped"] == 0

    # independent computation: the logit lens from HF hidden states, positions [skip, seq - 1)
    kl_all, ce_all = {layer: [] for layer in range(llama.n_layers)}, {layer: [] for layer in range(llama.n_layers)}
    for text in TEXTS:
        ids = llama.encode(text, max_length=max_len)
        seq = ids.shape[1]
        per_layer = reference_logits(llama, ids)
        final = per_layer[-1].log_softmax(-1)[skip:seq - 1]
        nxt = ids[0, skip + 1:seq]
        for layer, logits in enumerate(per_layer):
            logp = logits.log_softmax(-1)[skip:seq - 1]
            kl_all[layer] += ((final.exp() * (final - logp)).sum(-1) / math.log(2)).tolist()
            ce_all[layer] += (-logp.gather(-1, nxt[:, None])[:, 0] / math.log(2)).tolist()
    logit = frame[frame.lens == "logit"].set_index("layer")
    for layer in range(llama.n_layers):
        kl, ce = np.array(kl_all[layer]), np.array(ce_all[layer])
        assert logit.loc[layer, "n_tokens"] == len(kl)
        assert logit.loc[layer, "kl_bits"] == pytest.approx(kl.clip(0).mean(), rel=1e-4, abs=1e-6)
        assert logit.loc[layer, "ce_bits"] == pytest.approx(ce.mean(), rel=1e-5)
        assert logit.loc[layer, "ce_se"] == pytest.approx(ce.std(ddof=1) / math.sqrt(len(ce)), rel=1e-3)
    assert logit.loc[3, "kl_bits"] == 0.0 and logit.loc[3, "kl_se"] == 0.0
    # the model's own loss at the last layer, as HF computes it (nats -> bits), on a single text
    one = evaluate(llama, {"logit": lenses["logit"]}, [TEXTS[0]], max_seq_len=max_len, skip_first=0)
    ids = llama.encode(TEXTS[0], max_length=max_len)
    loss = llama.hf_model(ids, labels=ids).loss.item() / math.log(2)
    assert one.set_index("layer").loc[3, "ce_bits"] == pytest.approx(loss, rel=1e-5)
    # J = I reads like the logit lens at the layers it has
    jac = frame[frame.lens == "jac"].set_index("layer")
    for col in ("kl_bits", "ce_bits", "n_tokens"):
        np.testing.assert_allclose(jac[col].to_numpy(), logit.loc[[0, 2, 3], col].to_numpy())


def test_skip_first_default(llama):
    texts = [LONG_TEXT]
    assert evaluate(llama, {"logit": LogitLens.for_model(llama)}, texts).attrs["skip_first"] == 16
    fitted = identity_lens(llama, settings={"skip_first": 5})
    frame = evaluate(llama, {"j": fitted, "logit": LogitLens.for_model(llama)}, texts)
    assert frame.attrs["skip_first"] == 5
    n = llama.encode(LONG_TEXT, max_length=128).shape[1]
    assert (frame["n_tokens"] == n - 1 - 5).all()


def test_short_texts(llama):
    lens = {"logit": LogitLens.for_model(llama)}
    frame = evaluate(llama, lens, [LONG_TEXT, "Hi.", ""], skip_first=4)
    assert frame.attrs["n_skipped"] == 2 and (frame["n_texts"] == 1).all()
    with pytest.raises(ValueError, match="None of the 2 texts has a position to evaluate"):
        evaluate(llama, lens, ["Too short.", "Tiny"], skip_first=16)
    with pytest.raises(ValueError, match="max_seq_len=10"):
        evaluate(llama, lens, [LONG_TEXT], max_seq_len=10, skip_first=16)
    with pytest.raises(ValueError, match="texts is empty"):
        evaluate(llama, lens, [])
    with pytest.raises(ValueError, match="lenses is empty"):
        evaluate(llama, {}, [LONG_TEXT])


def test_lens_for_another_model(llama):
    other = make_tiny("llama", seed=1)
    with pytest.raises(LensFileError, match="unembedding differs"):
        evaluate(llama, {"j": identity_lens(other)}, [LONG_TEXT])
