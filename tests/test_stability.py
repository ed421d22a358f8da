"""Stability marks in readings (docs/method.md §6.2): ranks of the shown token under two half lenses."""

from __future__ import annotations

import copy
import functools
import json
import logging

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import LONG_TEXT
from helpers import random_lens, tiny

from jlens_core import LogitLens, fit, read_prompt, read_prompts
from jlens_core.reading.reading_file import load_readings, save_readings

PROMPTS = [
    LONG_TEXT,
    "The capital of Italy is Rome. Water boils at one hundred degrees, and numbers like 12 appear.",
    "def add(a, b):\n    return a + b\n# Once upon a time there was a small model that read every layer.",
    "Numbers like 12, 345 and 6789 appear in text; so do symbols: #, @, %, & and *. The end.",
]
SETTINGS = {"skip_first": 2, "max_seq_len": 16, "dim_batch": 16}
TEXT = "The capital of France is Paris. Water boils at one hundred degrees."
ARRAYS = ("top_ids", "top_probs", "entropy_bits", "kl_bits", "ce_bits", "next_token_rank", "final_top1_rank",
          "final_top1_ids")


@functools.cache
def lenses():
    """(full, even, odd): fitted on all prompts, the even ones and the odd ones."""
    model = tiny()
    return fit(model, PROMPTS, **SETTINGS), fit(model, PROMPTS[0::2], **SETTINGS), fit(model, PROMPTS[1::2], **SETTINGS)


def noisy_halves():
    """Halves apart (noise 0.1 around the identity): some cells are stable under them, some not."""
    model = tiny()
    return (random_lens(model, seed=1, noise=0.1), random_lens(model, seed=2, noise=0.1))


def reference_ranks(model, lens, half, text, shown):
    """The shown token's rank under ``half`` at every (layer, position), from HF's hidden states."""
    ids = model.encode(text)
    with torch.no_grad():
        hidden = model.hf_model(ids, output_hidden_states=True).hidden_states  # [n_layers + 1] x [1, seq, d]
        out = np.zeros(shown.shape, dtype=np.int64)
        for li, layer in enumerate(lens.layers):
            if layer == model.n_layers - 1:
                z = model.hf_model(ids).logits[0].double()  # the model's own output
            else:
                z = model.unembed(half.transport(hidden[layer + 1][0], layer)).double()  # [seq, vocab]
            picked = z.gather(-1, torch.as_tensor(shown[li])[:, None])
            out[li] = ((z > picked).sum(-1) + 1).numpy()
    return out


def test_marks_match_an_independent_computation():
    model, (full, *_) = tiny(), lenses()
    even, odd = noisy_halves()
    reading = read_prompt(model, full, TEXT, halves=(even, odd), top_k=5)
    shown = reading.top_ids[:, :, 0]
    want_even = reference_ranks(model, full, even, TEXT, shown)
    want_odd = reference_ranks(model, full, odd, TEXT, shown)
    marks = reading.stability
    # fp32 logits here vs float64 there: a near tie may differ by a rank
    assert np.abs(marks.half_rank_even - want_even).max() <= 1
    assert np.abs(marks.half_rank_odd - want_odd).max() <= 1
    assert (marks.half_rank_even == want_even).mean() > 0.95
    # the default rule (STABILITY_K = 1): the shown token is top-1 under both halves
    np.testing.assert_array_equal(marks.stable, (marks.half_rank_even <= 1) & (marks.half_rank_odd <= 1))
    assert not marks.stable.all() and marks.stable[:-1].any()  # the noisy halves make some cells unstable
    assert marks.stable[-1].all()  # the output row is the model's own: every half reads it the same


def test_same_lens_twice_is_stable_everywhere():
    model, (full, *_) = tiny(), lenses()
    reading = read_prompt(model, full, TEXT, halves=(full, full), stability_k=1)
    assert (reading.stability.half_rank_even == 1).all() and reading.stability.half_top1_agree.all()
    assert reading.stability.stable.all()


def test_reading_without_stability_is_unchanged():
    model, (full, even, odd) = tiny(), lenses()
    plain = read_prompt(model, full, TEXT, pinned=[" Paris"])
    marked = read_prompt(model, full, TEXT, pinned=[" Paris"], halves=(even, odd))
    assert plain.stability is None and plain.stability_note == ""
    for name in ARRAYS:
        np.testing.assert_array_equal(getattr(plain, name), getattr(marked, name))
    assert list(marked.frame.columns) == list(plain.frame.columns) + ["half_top1_agree", "half_rank_even",
                                                                       "half_rank_odd", "stable"]


def test_stability_k_one_is_the_strict_rule():
    model, (full, *_) = tiny(), lenses()
    wide = read_prompt(model, full, TEXT, halves=noisy_halves(), stability_k=10)
    strict = read_prompt(model, full, TEXT, halves=noisy_halves(), stability_k=1)
    np.testing.assert_array_equal(strict.stability.half_rank_even, wide.stability.half_rank_even)
    np.testing.assert_array_equal(strict.stability.stable, (wide.stability.half_rank_even == 1)
                                  & (wide.stability.half_rank_odd == 1))
    assert strict.stability.stable.sum() < wide.stability.stable.sum()
    with pytest.raises(ValueError, match="stability_k=0"):
        read_prompt(model, full, TEXT, stability=True, stability_k=0)


def test_stability_by_layer_counts_fitted_cells():
    model, (full, *_) = tiny(), lenses()
    reading = read_prompt(model, full, TEXT, halves=noisy_halves())
    table = reading.stability_by_layer()
    fitted = reading.fitted
    assert table["layer"].tolist() == reading.layers
    assert (table["n_cells"] == fitted.sum()).all()
    np.testing.assert_array_equal(table["n_stable"], reading.stability.stable[:, fitted].sum(axis=1))
    np.testing.assert_allclose(table["stable_fraction"], reading.stability.stable[:, fitted].mean(axis=1))
    every = reading.stability_by_layer(fitted_only=False)
    assert (every["n_cells"] == reading.n_positions).all()


def test_frame_and_cell_carry_the_marks():
    model, (full, *_) = tiny(), lenses()
    reading = read_prompt(model, full, TEXT, halves=noisy_halves())
    frame = reading.frame
    np.testing.assert_array_equal(frame["half_rank_odd"].to_numpy(), reading.stability.half_rank_odd.reshape(-1))
    np.testing.assert_array_equal(frame["stable"].to_numpy(), reading.stability.stable.reshape(-1))
    cell = reading.cell(1, 4)
    li, pi = reading.layer_index(1), reading.position_index(4)
    assert cell["half_rank_even"] == reading.stability.half_rank_even[li, pi]
    assert cell["stable"] == bool(reading.stability.stable[li, pi])


def test_lens_without_halves_reads_without_marks(caplog):
    model, bare = tiny(), random_lens(tiny())  # a lens without halves (built by hand, like a file from before them)
    with caplog.at_level(logging.WARNING, logger="jlens_core.reading.stability"):
        reading = read_prompt(model, bare, TEXT, stability=True)
    assert reading.stability is None
    assert "keeps no split halves" in reading.stability_note and "jlens fit" in reading.stability_note
    assert any("keeps no split halves" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="keeps no split halves"):
        reading.stability_by_layer()
    logit = read_prompt(model, LogitLens.for_model(model), TEXT, stability=True)
    assert logit.stability is None and "logit lens fits nothing" in logit.stability_note


def test_a_fitted_lens_gives_its_own_halves(tmp_path):
    """The lens-derived path: fit keeps the even and odd prompts' lenses (lens.halves()), in memory and in its file."""
    from jlens_core import JacobianLens

    model, (full, even, odd) = tiny(), lenses()
    own = full.halves()
    assert own is not None and own[0].n_prompts == even.n_prompts and own[1].n_prompts == odd.n_prompts
    for layer in full.source_layers:  # the fit's halves are the fits of the even and of the odd prompts
        torch.testing.assert_close(own[0].jacobians[layer], even.jacobians[layer], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(own[1].jacobians[layer], odd.jacobians[layer], rtol=1e-5, atol=1e-6)
    derived = read_prompt(model, full, TEXT, stability=True, stability_k=1)
    explicit = read_prompt(model, full, TEXT, halves=(even, odd), stability_k=1)
    assert derived.stability_note == ""
    np.testing.assert_array_equal(derived.stability.half_rank_even, explicit.stability.half_rank_even)
    np.testing.assert_array_equal(derived.stability.half_rank_odd, explicit.stability.half_rank_odd)
    loaded = JacobianLens.load(full.save(tmp_path / "lens.safetensors"))
    from_file = read_prompt(model, loaded, TEXT, stability=True, stability_k=1)
    np.testing.assert_array_equal(from_file.stability.half_rank_even, derived.stability.half_rank_even)


def test_several_lenses_take_halves_by_name():
    model, (full, even, odd) = tiny(), lenses()
    both = read_prompts(model, {"logit": LogitLens.for_model(model), "j": full}, TEXT, halves={"j": (even, odd)})
    assert both["logit"].stability is None and both["j"].stability is not None
    alone = read_prompt(model, full, TEXT, halves=(even, odd))
    np.testing.assert_array_equal(both["j"].stability.half_rank_even, alone.stability.half_rank_even)
    with pytest.raises(ValueError, match="ambiguous"):
        read_prompts(model, {"logit": LogitLens.for_model(model), "j": full}, TEXT, halves=(even, odd))
    with pytest.raises(ValueError, match="lacks layers"):
        read_prompt(model, full, TEXT, halves=(random_lens(model, layers=[0]), odd))


def test_marks_added_to_readings_taken_before_equal_a_marked_reading():
    """``reuse``: the app draws the plain readings first and then adds the marks without reading those lenses again;
    the result equals reading with marks from the start (every array and mark), and the given readings stay plain."""
    model, (full, even, odd) = tiny(), lenses()
    logit = LogitLens.for_model(model)
    lens_map = {"logit": logit, "j": full}
    args = {"pinned": [" Paris"], "top_k": 5, "halves": {"j": (even, odd)}, "word_like": True}
    plain = read_prompts(model, lens_map, TEXT, **{**args, "halves": None})
    marked = read_prompts(model, lens_map, TEXT, **args)
    reused = read_prompts(model, lens_map, TEXT, reuse={"j": plain["j"]}, **args)
    for name in lens_map:
        for field in ARRAYS:
            np.testing.assert_array_equal(getattr(reused[name], field), getattr(marked[name], field))
    for mark in ("half_rank_even", "half_rank_odd", "half_top1_agree", "stable"):
        np.testing.assert_array_equal(getattr(reused["j"].stability, mark), getattr(marked["j"].stability, mark))
    assert reused["j"] is not plain["j"] and plain["j"].stability is None  # a copy carries the marks
    assert reused["logit"].stability is None
    # not read again: a reused reading's own numbers come back as given (here entropies changed on purpose)
    given = copy.copy(plain["j"])
    given.entropy_bits = plain["j"].entropy_bits + 1.0
    np.testing.assert_array_equal(read_prompts(model, lens_map, TEXT, reuse={"j": given}, **args)["j"].entropy_bits,
                                  given.entropy_bits)
    with pytest.raises(ValueError, match=r"reuse\['j'\] was read with another top_k"):
        read_prompts(model, lens_map, TEXT, reuse={"j": plain["j"]}, **{**args, "top_k": 3})
    with pytest.raises(ValueError, match=r"reuse\['j'\] was read with another input_ids"):
        read_prompts(model, lens_map, TEXT + " More.", reuse={"j": plain["j"]}, **args)
    with pytest.raises(ValueError, match="not among the lenses read"):
        read_prompts(model, {"j": full}, TEXT, reuse={"logit": plain["logit"]}, halves=(even, odd))


def test_reading_file_keeps_the_marks(tmp_path):
    model, (full, even, odd) = tiny(), lenses()
    readings = read_prompts(model, {"logit": LogitLens.for_model(model), "j": full}, TEXT,
                            halves={"j": (even, odd)}, stability=True, stability_k=3)
    path = save_readings(tmp_path / "r.jlens.json", readings, model=model)
    loaded = load_readings(path).readings
    marks = loaded["j"].stability
    assert marks.stability_k == 3
    for name in ("half_rank_even", "half_rank_odd", "half_top1_agree"):
        np.testing.assert_array_equal(getattr(marks, name), getattr(readings["j"].stability, name))
    assert loaded["logit"].stability is None and loaded["logit"].stability_note == readings["logit"].stability_note
    assert loaded["j"].frame.equals(readings["j"].frame)


def test_version_one_files_still_load(tmp_path):
    import json

    model, (full, *_) = tiny(), lenses()
    reading = read_prompt(model, full, TEXT)
    path = reading.save(tmp_path / "r.jlens.json", model=model)
    data = json.loads(path.read_text())
    assert data["version"] == 2 and data["readings"]["jacobian"]["stability"] is None
    data["version"] = 1  # what a version 1 writer wrote: no stability field
    del data["readings"]["jacobian"]["stability"]
    path.write_text(json.dumps(data))
    opened = load_readings(path)
    assert opened.version == 1 and opened.readings["jacobian"].stability is None
    assert opened.readings["jacobian"].frame.equals(reading.frame)


def test_inspect_table_marks_unstable_cells(capsys):
    from jlens_core.cli.inspect import print_grid

    model, (full, *_) = tiny(), lenses()
    reading = read_prompt(model, full, TEXT, halves=noisy_halves())
    print_grid(reading, "jacobian", 6, 9)
    lines = capsys.readouterr().out.splitlines()
    print_grid(reading, "jacobian", 0, 9)  # every position: the unfitted ones get their own mark row
    assert "(unfit)" in capsys.readouterr().out
    print_grid(read_prompt(model, full, TEXT), "jacobian", 0, 9)  # no marks, unfitted columns
    assert "(unfit)" in capsys.readouterr().out
    rows = [line for line in lines if line.split() and line.split()[0] in {"0", "1", "2", "out"}]
    by_layer = reading.stability_by_layer()["stable_fraction"].tolist()
    cols = list(range(reading.n_positions))[-6:]
    for i, row in enumerate(rows):
        assert row.rstrip().endswith(f"{by_layer[i]:.0%}")
        cells = [row[7 + j * 10: 7 + j * 10 + 9] for j in range(6)]
        assert [c.rstrip().endswith("?") for c in cells] == [not reading.stability.stable[i, c] for c in cols]


def test_cli_inspect_stability_without_halves_says_so(tmp_path, capsys):
    from conftest import save_tiny

    from jlens_core.cli.main import main

    folder = save_tiny(tmp_path / "tiny")
    path = random_lens(tiny()).save(tmp_path / "lens.safetensors")  # no halves
    code = main(["inspect", "--model", folder, "--lens", str(path), "--prompt", TEXT, "--stability", "--last", "3"])
    captured = capsys.readouterr()
    assert code == 0
    assert "keeps no split halves" in captured.err and "jlens fit" in captured.err
    assert "?: unstable" not in captured.out and "%" not in captured.out  # the table without marks
    fitted = lenses()[0].save(tmp_path / "fitted.safetensors")  # a fit keeps its halves
    saved = tmp_path / "r.jlens.json"
    assert main(["inspect", "--model", folder, "--lens", str(fitted), "--prompt", TEXT, "--stability", "--last", "3",
                 "--save", str(saved)]) == 0
    captured = capsys.readouterr()
    assert "?: unstable" in captured.out and "keeps no split halves" not in captured.err
    assert load_readings(saved).readings["jacobian"].stability is not None
    assert main(["inspect", "--model", folder, "--lens", str(path), "--prompt", TEXT, "--stability-k", "0"]) == 2


def test_heatmap_marks_unstable_cells_hover_and_strip():
    from jlens_core.figures.heatmaps import heatmap_figure

    model, (full, *_) = tiny(), lenses()
    readings = read_prompts(model, {"logit": LogitLens.for_model(model), "jacobian": full}, TEXT,
                            halves={"jacobian": noisy_halves()})
    reading = readings["jacobian"]
    fig = heatmap_figure(readings, "jacobian", "top1_prob")
    fades = [t for t in fig.data if t.type == "scatter" and t.legendgroup == "unstable"]
    assert len(fades) == 2 and fades[0].showlegend and "not top-1 under both halves" in fades[0].name
    layers = reading.layers
    drawn = {(int(y), int(x)) for x, y in zip(fades[0].x, fades[0].y)}
    want = {(row, int(p)) for row in range(len(layers)) for pi, p in enumerate(reading.positions)
            if not reading.stability.stable[row, pi]}
    assert drawn == want
    strip = next(t for t in fig.data if t.type == "heatmap" and t.name == "stable %")
    np.testing.assert_allclose([row[0] for row in strip.z], reading.stability_by_layer()["stable_fraction"])
    assert "stable %" in fig.layout.xaxis.ticktext
    cells = next(t for t in fig.data if t.type == "scatter" and t.name.endswith("cells"))
    li, pi = 1, 5
    hover = cells.hovertext[li * reading.n_positions + pi]
    assert (f"halves: rank {reading.stability.half_rank_even[li, pi]} / rank "
            f"{reading.stability.half_rank_odd[li, pi]}") in hover
    off = heatmap_figure(readings, "jacobian", "top1_prob", stability=False)
    assert not [t for t in off.data if t.legendgroup == "unstable" or t.name == "stable %"]
    assert "halves:" not in next(t for t in off.data if t.type == "scatter").hovertext[0]
    side = heatmap_figure(readings, "side", "top1_prob", pair=("logit", "jacobian"))
    assert len([t for t in side.data if t.name == "stable %"]) == 1  # the logit panel has no marks
    assert "stable %" in side.layout.xaxis2.ticktext


def test_heatmap_of_a_reading_without_marks_is_unchanged():
    from jlens_core.figures.heatmaps import heatmap_figure

    model, (full, *_) = tiny(), lenses()
    plain = read_prompts(model, {"logit": LogitLens.for_model(model), "jacobian": full}, TEXT)
    assert heatmap_figure(plain, "side", "kl_bits").to_json() == \
        heatmap_figure(plain, "side", "kl_bits", stability=False).to_json()


def test_html_page_carries_the_marks():
    import base64
    import gzip
    import re

    from jlens_core.figures.html_page import detail_data, reading_page

    model, (full, *_) = tiny(), lenses()
    readings = read_prompts(model, {"logit": LogitLens.for_model(model), "jacobian": full}, TEXT,
                            halves={"jacobian": noisy_halves()})
    detail = detail_data(readings)
    marks = readings["jacobian"].stability
    assert detail["lenses"]["logit"]["halves"] is None
    halves = detail["lenses"]["jacobian"]["halves"]
    assert halves["even"] == marks.half_rank_even.ravel().tolist() and halves["k"] == 1
    assert halves["stable"] == marks.stable.ravel().astype(int).tolist()
    page = reading_page(readings)
    text = re.search(r'<script id="reading-packed" type="application/octet-stream">(.*?)</script>', page,
                     re.DOTALL).group(1)
    figure = json.loads(gzip.decompress(base64.b64decode(text)))["figure"]
    assert any(t.get("name") == "stable %" for t in figure["data"])
    assert "halves: rank" in page  # the click detail's line (the script)


ITEMS = [{"prompt": "The capital of France is", "intermediates": ["Paris", "capital"], "target": "Paris"},
         {"prompt": "Water boils at one hundred", "intermediates": ["degrees", "Water"]},
         {"prompt": "Once upon a time there was a small", "intermediates": ["model", "time"]}]


def test_pass_at_k_found_by_both_halves():
    from jlens_core import pass_at_k
    from jlens_core.evaluation.passk import PASS_COLUMNS, pass_at_k_detail

    model, (full, *_) = tiny(), lenses()
    even, odd = noisy_halves()
    plain_summary, plain = pass_at_k(model, {"j": full}, ITEMS, k=(1, 10), return_detail=True)
    summary, detail = pass_at_k(model, {"logit": LogitLens.for_model(model), "j": full}, ITEMS, k=(1, 10),
                                return_detail=True, halves={"j": (even, odd)})
    assert list(plain_summary.columns) == list(PASS_COLUMNS) and "best_rank_even" not in plain
    j = detail[detail["lens"] == "j"].reset_index(drop=True)
    pd.testing.assert_frame_equal(j[list(plain.columns)], plain)  # the lens's own ranks are unchanged
    assert detail[detail["lens"] == "logit"]["best_rank_even"].isna().all()
    # independent: each half read alone as a lens gives the same best ranks
    for which, half in (("even", even), ("odd", odd)):
        alone = pass_at_k_detail(model, {"j": half}, ITEMS)
        np.testing.assert_array_equal(j[f"best_rank_{which}"].to_numpy(), alone["best_rank"].to_numpy())
    inter = j[(j["role"] == "intermediate") & j["scored"]]
    for k in (1, 10):
        both = ((inter["best_rank_even"] <= k) & (inter["best_rank_odd"] <= k)).groupby(inter["item"]).mean().mean()
        row = summary[(summary["lens"] == "j") & (summary["k"] == k)].iloc[0]
        assert row["found_by_both_halves"] == pytest.approx(both)
        assert row["both_ci_low"] <= row["found_by_both_halves"] <= row["both_ci_high"]
    assert np.isnan(summary[summary["lens"] == "logit"]["found_by_both_halves"]).all()


def test_lens_comparison_reports_both_halves():
    from jlens_core.evaluation.lens_comparison import COMPARISON_COLUMNS, macro_comparison
    from jlens_core.evaluation.passk import pass_at_k_detail

    model, (full, *_) = tiny(), lenses()
    lenses_read = {"logit": LogitLens.for_model(model), "jacobian": full}
    marked = pass_at_k_detail(model, lenses_read, ITEMS, halves={"jacobian": noisy_halves()}).assign(set="s")
    plain = pass_at_k_detail(model, lenses_read, ITEMS).assign(set="s")
    without = macro_comparison(plain, k=10, n_boot=200)
    table = macro_comparison(marked, k=10, n_boot=200)
    assert list(without.columns) == list(COMPARISON_COLUMNS)
    pd.testing.assert_frame_equal(table[list(COMPARISON_COLUMNS)], without)  # the comparison itself unchanged
    row = table.set_index("lens").loc["jacobian"]
    inter = marked[(marked["lens"] == "jacobian") & (marked["role"] == "intermediate") & marked["scored"]]
    want = ((inter["best_rank_even"] <= 10) & (inter["best_rank_odd"] <= 10)).groupby(inter["item"]).mean().mean()
    assert row["both_halves"] == pytest.approx(want)  # one set: the macro is the mean over items
    assert row["both_low"] <= row["both_halves"] <= row["both_high"]
    assert np.isnan(table.set_index("lens").loc["logit", "both_halves"])


def test_cli_eval_stability(tmp_path, capsys):
    from conftest import save_tiny

    from jlens_core.cli.main import main

    folder = save_tiny(tmp_path / "tiny")
    path = lenses()[0].save(tmp_path / "lens.safetensors")  # with the fit's halves
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    out = tmp_path / "eval"
    code = main(["eval", "--model", folder, "--lens", str(path), "--pass-at-k", str(items), "--stability",
                 "--k", "10", "--out", str(out), "--no-progress"])
    assert code == 0
    detail = pd.read_csv(out / "pass_at_k_detail.csv")
    summary = pd.read_csv(out / "pass_at_k.csv")
    model, (_, even, odd) = tiny(), lenses()
    from jlens_core.evaluation.passk import pass_at_k_detail

    explicit = pass_at_k_detail(model, {"jacobian": lenses()[0]}, ITEMS, halves={"jacobian": (even, odd)})
    np.testing.assert_array_equal(detail["best_rank_even"].to_numpy(), explicit["best_rank_even"].to_numpy())
    assert detail["best_rank_odd"].notna().any()
    assert summary["found_by_both_halves"].notna().all()
    assert "found_by_both_halves" in capsys.readouterr().out


def test_stability_figures_script(tmp_path, capsys):
    from conftest import save_tiny
    from helpers import load_script

    script = load_script("scripts/stability_figures.py")
    model, (full, even, odd) = tiny(), lenses()
    texts = PROMPTS[:3]
    halves = noisy_halves()
    per_layer, summary = script.stability_figures(model, full, texts, halves=halves, max_seq_len=16)
    cells = unstable = agree_unstable = 0
    by_layer = {}
    for text in texts:  # the counts, from readings taken here
        r = read_prompt(model, full, text, halves=halves, max_seq_len=16)
        fitted = r.fitted
        for li, layer in enumerate(r.layers[:-1]):
            s = r.stability.stable[li, fitted]
            a = r.top_ids[li, fitted, 0] == r.final_top1_ids[fitted]
            by_layer.setdefault(layer, []).append((~s).sum())
            cells, unstable, agree_unstable = cells + len(s), unstable + (~s).sum(), agree_unstable + (a & ~s).sum()
    assert per_layer["layer"].tolist() == sorted(by_layer)
    assert per_layer["n_unstable"].tolist() == [sum(v) for _, v in sorted(by_layer.items())]
    assert summary["n_cells"] == cells and summary["n_unstable"] == unstable
    assert summary["agree_unstable"] == pytest.approx(agree_unstable / unstable)
    both = per_layer[(per_layer["n_unstable"] > 0) & (per_layer["n_unstable"] < per_layer["n_cells"])]
    weights = both["n_unstable"] / both["n_unstable"].sum()
    assert summary["matched_layers"] == len(both) > 0
    assert summary["agree_stable_layer_matched"] == pytest.approx(float((weights * both["agree_stable"]).sum()))
    assert summary["agree_unstable_layer_matched"] == pytest.approx(float((weights * both["agree_unstable"]).sum()))
    with pytest.raises(ValueError, match="keeps no split halves"):
        script.stability_figures(model, random_lens(model), texts)
    folder = save_tiny(tmp_path / "tiny")
    paths = [str(lens.save(tmp_path / f"{name}.safetensors")) for name, lens in
             (("full", full), ("even", even), ("odd", odd))]
    out = tmp_path / "out"
    assert script.main(["--model", folder, "--lens", paths[0], "--halves", *paths[1:], "--n-texts", "2",
                        "--max-seq-len", "24", "--out", str(out)]) == 0
    written = json.loads((out / "stability_summary.json").read_text())
    assert written["split"] == "eval" and written["n_texts"] == 2
    assert len(pd.read_csv(out / "stability_by_layer.csv")) == 3  # the tiny lens's source layers
    assert "unstable" in capsys.readouterr().out
