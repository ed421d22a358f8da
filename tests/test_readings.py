"""read_prompt: per layer x position statistics, checked against computations from the HF model."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import LONG_TEXT, make_tiny
from helpers import identity_lens, random_lens, reference_logits

from jlens_core import JacobianLens, LensFileError, LogitLens
from jlens_core.reading import logit_stats, openmp_workers
from jlens_core.reading.prompt_reading import FRAME_COLUMNS
from jlens_core.reading.reader import read_prompt
from jlens_core.reading.summaries import compare_readings, difference
from jlens_core.reading.tokens import TokenDisplay, is_word_like, token_id

TEXT = "The capital of France is Paris. Water boils at one hundred degrees."


@pytest.fixture(scope="module")
def reading(llama):
    return read_prompt(llama, LogitLens.for_model(llama), TEXT, top_k=5, pinned=[" Paris", "is"])


def test_frame_columns_and_shape(llama, reading):
    frame = reading.frame
    assert list(frame.columns) == list(FRAME_COLUMNS) + ["rank_ Paris", "rank_is"]
    seq = len(reading.input_ids)
    assert len(frame) == llama.n_layers * seq
    assert frame["layer"].tolist() == [layer for layer in range(llama.n_layers) for _ in range(seq)]
    assert frame["position"].tolist() == list(range(seq)) * llama.n_layers
    assert frame["token"].tolist()[:seq] == reading.tokens
    assert all(len(ids) == 5 and len(p) == 5 for ids, p in zip(frame["top_ids"], frame["top_probs"]))
    assert reading.layers == list(range(llama.n_layers)) and reading.output_layer == llama.n_layers - 1
    assert reading.grid("kl_bits").shape == (llama.n_layers, seq)
    assert frame["next_token_rank"].dtype == "Int64"


def test_last_layer_is_the_model_output(llama, reading):
    ids = torch.as_tensor(reading.input_ids)[None]
    logits = llama.hf_model(ids).logits[0].float()  # [seq, vocab]
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1) / math.log(2)
    ce = -logp[:-1].gather(-1, ids[0, 1:, None])[:, 0] / math.log(2)
    last = reading.layer_index(-1)
    assert np.all(reading.kl_bits[last] == 0.0)
    np.testing.assert_allclose(reading.entropy_bits[last], entropy.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(reading.ce_bits[last, :-1], ce.detach().numpy(), rtol=1e-5, atol=1e-5)
    assert np.isnan(reading.ce_bits[:, -1]).all()
    assert np.isnan(reading.next_token_rank[:, -1]).all()
    assert reading.frame.groupby("layer").tail(1)["next_token_rank"].isna().all()
    assert (reading.final_top1_rank[last] == 1).all()
    np.testing.assert_array_equal(reading.final_top1_ids, logits.argmax(-1).numpy())


def test_kl_nonnegative_everywhere(llama, reading):
    assert np.isfinite(reading.kl_bits).all() and (reading.kl_bits >= 0).all()
    assert (reading.kl_bits[:-1] > 0).any()
    assert (reading.entropy_bits > 0).all()
    assert (reading.entropy_bits <= math.log2(llama.vocab_size) + 1e-6).all()


def test_ranks_and_topk_agree_with_argsort(llama, reading):
    ids = torch.as_tensor(reading.input_ids)[None]
    seq = ids.shape[1]
    paris = token_id(llama.tokenizer, " Paris", rule="first")
    per_layer = reference_logits(llama, ids)
    final = per_layer[-1].log_softmax(-1)
    for layer, logits in enumerate(per_layer):
        order = torch.argsort(logits, dim=-1, descending=True)  # [seq, vocab]
        rank_of = torch.empty_like(order)
        rank_of.scatter_(1, order, torch.arange(1, logits.shape[-1] + 1).expand(seq, -1))  # 1-based
        final_top1 = reading.final_top1_ids
        for p in range(seq):
            if p + 1 < seq:
                assert reading.next_token_rank[layer, p] == rank_of[p, ids[0, p + 1]]
            assert reading.final_top1_rank[layer, p] == rank_of[p, final_top1[p]]
            assert reading.pinned_ranks[" Paris"][layer, p] == rank_of[p, paris]
        np.testing.assert_array_equal(reading.top_ids[layer], order[:, :5].numpy())
        probs = logits.softmax(-1).gather(-1, order[:, :5])
        np.testing.assert_allclose(reading.top_probs[layer], probs.numpy(), rtol=1e-4, atol=1e-6)
        # KL(final || lens) and entropy at every layer, independently
        logp = logits.log_softmax(-1)
        kl = (final.exp() * (final - logp)).sum(-1) / math.log(2)
        np.testing.assert_allclose(reading.kl_bits[layer], kl.clamp_min(0).numpy(), rtol=1e-4, atol=1e-5)


def test_identity_jacobian_reads_like_logit_lens(llama, reading):
    jac = read_prompt(llama, identity_lens(llama), TEXT, top_k=5, pinned=[" Paris", "is"])
    assert jac.lens_kind == "jacobian" and reading.lens_kind == "logit"
    pd.testing.assert_frame_equal(jac.frame, reading.frame)


def test_unfitted_layers_are_absent(llama):
    lens = identity_lens(llama, layers=[0, 2])
    r = read_prompt(llama, lens, TEXT)
    assert r.layers == [0, 2, 3]
    assert sorted(r.frame["layer"].unique()) == [0, 2, 3]
    assert read_prompt(llama, lens, TEXT, layers=[1, 2, -1]).layers == [2, 3]
    with pytest.raises(ValueError, match="readable"):
        read_prompt(llama, lens, TEXT, layers=[1])
    with pytest.raises(ValueError, match="layer 7 is out of range"):
        read_prompt(llama, lens, TEXT, layers=[7])
    with pytest.raises(ValueError, match="list of layers is empty"):
        read_prompt(llama, lens, TEXT, layers=[])


@pytest.mark.parametrize("options", [{}, {"word_like": True, "positions": [0, 3, -1], "layers": [0, 1, 3]}])
def test_read_prompts_equals_each_lens_read_alone(llama, monkeypatch, options):
    from jlens_core.reading.reader import read_prompts

    lenses = {"logit": LogitLens.for_model(llama), "jacobian": random_lens(llama, [0, 2]),
              "other": random_lens(llama, [1, 2], seed=1)}
    kwargs = dict(top_k=4, pinned=[" Paris"], **options)
    monkeypatch.setattr(logit_stats, "CHUNK_ELEMENTS", 5 * llama.vocab_size)  # groups mix the lenses' rows
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)  # three workers share the groups
    together = read_prompts(llama, lenses, TEXT, **kwargs)
    assert list(together) == list(lenses)
    monkeypatch.setattr(openmp_workers, "MAX_READING_WORKERS", 1)  # each lens alone, in this thread
    for name, lens in lenses.items():
        alone = read_prompt(llama, lens, TEXT, **kwargs)
        assert together[name].layers == alone.layers and together[name].lens_kind == alone.lens_kind
        pd.testing.assert_frame_equal(together[name].frame, alone.frame, check_exact=False, rtol=1e-5, atol=1e-6)
        assert together[name].frame["top_tokens"].tolist() == alone.frame["top_tokens"].tolist()
    # the output row (shared) is the model's own distribution in every reading
    top = llama.n_layers - 1
    for name in lenses:
        r = together[name]
        np.testing.assert_array_equal(r.kl_bits[r.layer_index(top)], 0.0)
        np.testing.assert_array_equal(r.top_ids[r.layer_index(top)], together["logit"].top_ids[-1])
    # the readings do not share arrays: changing one leaves the others alone
    together["logit"].kl_bits[-1] = 5.0
    assert (together["jacobian"].kl_bits[-1] == 0).all()
    with pytest.raises(ValueError, match="lenses is empty"):
        read_prompts(llama, {}, TEXT)
    with pytest.raises(LensFileError):
        read_prompts(llama, {"logit": LogitLens(n_layers=llama.n_layers, d_model=llama.d_model + 1)}, TEXT)


def test_pinned_tokens(llama, reading):
    assert reading.pinned == {" Paris": token_id(llama.tokenizer, " Paris", rule="first"),
                              "is": token_id(llama.tokenizer, "is", rule="first")}
    raw = llama.tokenizer.convert_ids_to_tokens(reading.pinned["is"])
    by_id = read_prompt(llama, LogitLens.for_model(llama), TEXT, pinned=[reading.pinned["is"], raw])
    np.testing.assert_array_equal(by_id.pinned_ranks[str(reading.pinned["is"])], reading.pinned_ranks["is"])
    np.testing.assert_array_equal(by_id.pinned_ranks[raw], reading.pinned_ranks["is"])
    assert (reading.frame["rank_ Paris"] >= 1).all()
    with pytest.raises(ValueError, match="Unknown pinned token ''"):
        read_prompt(llama, LogitLens.for_model(llama), TEXT, pinned=[""])
    with pytest.raises(ValueError, match="Unknown pinned token 100000"):
        read_prompt(llama, LogitLens.for_model(llama), TEXT, pinned=[100000])


def test_positions_and_truncation(llama, reading):
    part = read_prompt(llama, LogitLens.for_model(llama), TEXT, top_k=5, positions=[2, -1, 0, 2])
    seq = len(reading.input_ids)
    assert part.positions.tolist() == [0, 2, seq - 1]
    # other rows in the matmuls: fp32 rounding may differ in the last digits
    np.testing.assert_allclose(part.kl_bits, reading.kl_bits[:, [0, 2, seq - 1]], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="position 99 is out of range"):
        read_prompt(llama, LogitLens.for_model(llama), TEXT, positions=[99])
    short = read_prompt(llama, LogitLens.for_model(llama), TEXT, max_seq_len=6)
    assert len(short.input_ids) == 6 and np.isnan(short.ce_bits[:, -1]).all()


def test_chunked_reading_is_identical(llama, reading, monkeypatch):
    monkeypatch.setattr(logit_stats, "CHUNK_ELEMENTS", 3 * llama.vocab_size)
    assert logit_stats.chunk_size(llama.vocab_size) == 3  # 3 positions per chunk: the setting is the one read
    chunked = read_prompt(llama, LogitLens.for_model(llama), TEXT, top_k=5, pinned=[" Paris", "is"])
    # tokens and ranks identical; the floats up to fp32 rounding (the BLAS may block other row counts differently)
    pd.testing.assert_frame_equal(chunked.frame, reading.frame, check_exact=False, rtol=1e-5, atol=1e-6)
    assert chunked.frame["top_tokens"].tolist() == reading.frame["top_tokens"].tolist()


@pytest.mark.parametrize("chunk_rows, block_rows", [(None, 2), (3, 7), (3, 1)])
def test_statistics_blocks_are_identical(llama, reading, monkeypatch, chunk_rows, block_rows):
    # block_rows 2 < positions: one layer, a run of positions per block (the remainder too);
    # 7 rows over chunks of 3 positions: two layers per block; 1: one cell per block
    vocab = llama.vocab_size
    if chunk_rows:
        monkeypatch.setattr(logit_stats, "CHUNK_ELEMENTS", chunk_rows * vocab)
    monkeypatch.setattr(logit_stats, "STATS_BLOCK_ELEMENTS", block_rows * vocab)
    blocked = read_prompt(llama, LogitLens.for_model(llama), TEXT, top_k=5, pinned=[" Paris", "is"])
    pd.testing.assert_frame_equal(blocked.frame, reading.frame, check_exact=False, rtol=1e-5, atol=1e-6)
    assert blocked.frame["top_tokens"].tolist() == reading.frame["top_tokens"].tolist()


def test_grids_and_cells(llama, reading):
    grid = reading.top1_grid()
    assert len(grid) == reading.n_layers and len(grid[0]) == reading.n_positions
    assert grid[1][3] == reading.frame.query("layer == 1 and position == 3")["top_tokens"].iloc[0][0]
    ranks = reading.grid("next_token_rank")
    assert np.isnan(ranks[:, -1]).all() and np.isfinite(ranks[:, :-1]).all()
    np.testing.assert_array_equal(reading.grid("top1_prob"), reading.top_probs[:, :, 0])
    padded = reading.grid("kl_bits", layers=[3, 9])
    assert np.isnan(padded[1]).all() and np.array_equal(padded[0], reading.kl_bits[3])
    assert set(reading.stats) >= {"kl_bits", "rank_ Paris"}
    with pytest.raises(ValueError, match="Unknown statistic 'nope'"):
        reading.grid("nope")
    cell = reading.cell(-1, -1)
    assert cell["next_token"] == "" and cell["next_token_rank"] is None and cell["kl_bits"] == 0.0
    assert reading.top_tokens(0, 0) == cell_top(reading, 0, 0)
    with pytest.raises(KeyError, match="Layer 9"):
        reading.cell(9, 0)


def cell_top(reading, layer, position):
    row = reading.frame.query(f"layer == {layer} and position == {position}").iloc[0]
    return row["top_tokens"]


def test_whitespace_display_and_word_like(llama):
    lens = LogitLens.for_model(llama)
    plain = read_prompt(llama, lens, TEXT, top_k=8)
    glyph = read_prompt(llama, lens, TEXT, top_k=8, show_whitespace=True)
    assert " capital" in plain.tokens and "·capital" in glyph.tokens
    words = read_prompt(llama, lens, TEXT, top_k=8, word_like=True)
    display = TokenDisplay.for_model(llama)
    assert all(is_word_like(display.texts[i]) for i in words.top_ids.reshape(-1))
    for stat in ("kl_bits", "entropy_bits", "next_token_rank", "final_top1_rank"):
        np.testing.assert_array_equal(words.grid(stat), plain.grid(stat))


def test_read_from_ids(llama, reading):
    by_ids = read_prompt(llama, LogitLens.for_model(llama), reading.input_ids.tolist(), top_k=5,
                         pinned=[" Paris", "is"])
    pd.testing.assert_frame_equal(by_ids.frame, reading.frame)


def test_difference_and_compare(llama, reading):
    other = read_prompt(llama, identity_lens(llama, layers=[1]), TEXT, top_k=5)
    diff = difference(reading, other, "kl_bits")
    assert diff.index.tolist() == [1, 3] and diff.shape[1] == reading.n_positions
    # the same logits, unembedded in row groups of another size: equal up to the BLAS's fp32 blocking
    np.testing.assert_allclose(diff.to_numpy(), 0.0, atol=1e-5)
    both = compare_readings(reading, other, names=("logit", "jac"))
    assert {"kl_bits_logit", "kl_bits_jac", "kl_bits_diff", "top1_logit", "same_top1"} <= set(both.columns)
    assert both["same_top1"].all() and len(both) == 2 * reading.n_positions
    elsewhere = read_prompt(llama, LogitLens.for_model(llama), "Another prompt entirely.")
    with pytest.raises(ValueError, match="different prompts"):
        difference(reading, elsewhere)


def test_bad_input(llama):
    lens = LogitLens.for_model(llama)
    with pytest.raises(ValueError, match="empty"):
        read_prompt(llama, lens, "")
    with pytest.raises(ValueError, match="top_k=0"):
        read_prompt(llama, lens, TEXT, top_k=0)
    with pytest.raises(LensFileError, match="d_model"):
        read_prompt(llama, LogitLens(llama.n_layers, 16), TEXT)
    with pytest.raises(LensFileError, match="6 layers"):
        read_prompt(llama, LogitLens(6, llama.d_model), TEXT)
    wide = JacobianLens({0: torch.eye(16)}, n_prompts=1, d_model=16, target_layer=3)
    with pytest.raises(LensFileError):
        read_prompt(llama, wide, TEXT)
    other = make_tiny("llama", seed=1)
    with pytest.raises(LensFileError, match="unembedding differs"):
        read_prompt(llama, identity_lens(other), TEXT)


@pytest.mark.parametrize("family", ["gpt2", "gemma2"])
def test_other_families_last_layer(family):
    model = make_tiny(family)
    r = read_prompt(model, LogitLens.for_model(model), LONG_TEXT[:60], top_k=3)
    logits = model.hf_model(torch.as_tensor(r.input_ids)[None]).logits[0].float()
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1) / math.log(2)
    np.testing.assert_allclose(r.entropy_bits[-1], entropy.detach().numpy(), rtol=1e-5, atol=1e-5)
    assert np.all(r.kl_bits[-1] == 0.0) and (r.kl_bits >= 0).all()


def test_two_threads_reading_with_one_model_do_not_see_each_others_passes(llama):
    # The app reads in several threads (its warm-up, one per browser session): forward hooks belong to
    # the modules, so each reading must only see its own thread's forward passes.
    import threading

    texts = [TEXT, "A much shorter prompt here."]
    expected = [read_prompt(llama, LogitLens.for_model(llama), t, top_k=3).kl_bits for t in texts]
    results, errors = {}, []
    start = threading.Barrier(2)

    def worker(i: int) -> None:
        try:
            start.wait()
            results[i] = [read_prompt(llama, LogitLens.for_model(llama), texts[i], top_k=3).kl_bits
                          for _ in range(25)]
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for i in range(2):
        for kl in results[i]:
            np.testing.assert_allclose(kl, expected[i], rtol=1e-5, atol=1e-6)
