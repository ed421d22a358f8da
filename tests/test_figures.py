"""jlens_core.figures: every figure drawn from a tiny model, its traces checked against the numbers it draws."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
from conftest import LONG_TEXT
from helpers import random_lens

from jlens_core import LogitLens, evaluate, fit, generate, pass_at_k, read_prompts
from jlens_core.figures import debugging, evaluation, fitting, heatmaps, interventions, ranks, tokens
from jlens_core.figures import generation as generation_figures
from jlens_core.figures.labels import LENS_NAMES, fmt, shown
from jlens_core.interventions.compare import compare_runs
from jlens_core.interventions.lens_edits import Steer
from jlens_core.reading.summaries import most_common_tokens

TEXT = "The capital of France is Paris. Water boils at one hundred degrees."


@pytest.fixture(scope="module")
def lenses(llama):
    return {"logit": LogitLens.for_model(llama), "jacobian": random_lens(llama, layers=[0, 2], settings={"skip_first": 2})}


@pytest.fixture(scope="module")
def readings(llama, lenses):
    return read_prompts(llama, lenses, TEXT, top_k=5, pinned=[" Paris", "is"])


def same(a, b) -> bool:
    return np.allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float), equal_nan=True)


def test_one_lens_heatmap_draws_the_reading(readings):
    r = readings["jacobian"]
    fig = heatmaps.heatmap_figure(readings, "jacobian", "top1_prob")
    heat, cells = fig.data
    assert isinstance(heat, go.Heatmap) and same(heat.z, r.grid("top1_prob", layers=readings["logit"].layers))
    assert list(heat.x) == r.positions.tolist() and len(cells.hovertext) == readings["logit"].n_layers * r.n_positions
    # a cell's hover: its statistic and its top-k with probabilities, in order
    pi = 3
    hover = cells.hovertext[2 * r.n_positions + pi]
    cell = r.cell(2, int(r.positions[pi]))
    assert f"top-1 probability: {fmt('top1_prob', cell['top_probs'][0])}" in hover
    assert hover.index(f"1. {shown(cell['top_tokens'][0])}") < hover.index(f"2. {shown(cell['top_tokens'][1])}")
    assert f"{cell['top_probs'][4]:.1%}" in hover
    # layer 1 is not fitted in this lens: a NaN row that says so
    assert np.isnan(heat.z[1]).all() and "L1: not fitted" in cells.hovertext[1 * r.n_positions]
    # positions before skip_first are shaded
    assert any(shape.name == "not fitted" for shape in fig.layout.shapes)
    assert fig.layout.yaxis.ticktext[-1] == f"output (L{r.output_layer})"


def test_label_cells_writes_other_labels_and_adds_to_the_hover(readings):
    r = readings["jacobian"]
    layers = readings["logit"].layers
    fig = heatmaps.heatmap_figure(readings, "jacobian", "top1_prob", layers=layers)
    before_text = [list(row) for row in fig.data[0].text]
    before_hover = list(fig.data[1].hovertext)
    n = r.n_positions
    labels = {2: [f"atom{i}" for i in range(n)]}
    heatmaps.label_cells(fig, layers, labels, {2: [f"extra {i}" for i in range(n)]}, title="new")
    chars = heatmaps.text_chars(n, len(layers) * n)
    assert list(fig.data[0].text[2]) == [heatmaps.cell_text(t, chars) for t in labels[2]]
    assert [list(row) for i, row in enumerate(fig.data[0].text) if i != 2] == \
        [row for i, row in enumerate(before_text) if i != 2]  # unlabelled rows keep their top-1 tokens
    assert fig.data[1].hovertext[2 * n + 3] == before_hover[2 * n + 3] + "<br><br>extra 3"
    assert fig.data[1].hovertext[0] == before_hover[0] and fig.layout.title.text == "new"
    with pytest.raises(ValueError, match="one per position"):
        heatmaps.label_cells(fig, layers, {2: ["x"]}, {})
    with pytest.raises(ValueError, match="several panels"):
        heatmaps.label_cells(heatmaps.heatmap_figure(readings, "side", "top1_prob"), layers, labels, {})


@pytest.mark.parametrize("stat", ["kl_bits", "next_token_rank", "rank_ Paris"])
def test_side_by_side_diff_and_stacked(readings, stat):
    layers = readings["logit"].layers
    a, b = readings["logit"].grid(stat, layers=layers), readings["jacobian"].grid(stat, layers=layers)
    rank = stat != "kl_bits"
    drawn = (lambda v: np.log10(np.clip(v, 1, None))) if rank else (lambda v: v)
    side = heatmaps.heatmap_figure(readings, "side", stat)
    assert [t.type for t in side.data] == ["heatmap", "scatter"] * 2
    assert same(side.data[0].z, drawn(a)) and same(side.data[2].z, drawn(b))
    assert [a.text for a in side.layout.annotations[:2]] == [LENS_NAMES["logit"], LENS_NAMES["jacobian"]]
    diff = heatmaps.heatmap_figure(readings, "diff", stat)
    expected = (np.log10(np.clip(b, 1, None)) - np.log10(np.clip(a, 1, None))) if stat in heatmaps.RANK_STATS \
        else b - a
    assert same(diff.data[0].z, expected) and diff.data[0].zmid == 0
    stacked = heatmaps.heatmap_figure(readings, "three", stat, selected=(1, 4))
    assert len(stacked.data) == 4 and sum(s.line.color == "#ff2b2b" for s in stacked.layout.shapes) == 2


def test_reading_figure_and_cell_from_point(readings):
    r = readings["jacobian"]
    alone = r.figure("entropy_bits")
    assert same(alone.data[0].z, r.grid("entropy_bits"))
    both = r.figure("entropy_bits", others={"logit": readings["logit"]})
    assert same(both.data[0].z, r.grid("entropy_bits", layers=readings["logit"].layers))  # this reading above
    assert same(both.data[2].z, readings["logit"].grid("entropy_bits"))
    assert r.figure(others={"logit": readings["logit"]}, mode="diff").data[0].name == "difference"
    with pytest.raises(ValueError, match="Unknown mode 'sideways'"):
        heatmaps.heatmap_figure(readings, "sideways", "kl_bits")
    assert heatmaps.cell_from_point({"x": 4.0, "y": 2.0}, [0, 1, 2, 3]) == (2, 4)
    assert heatmaps.cell_from_point({"x": 1, "y": 9}, [0, 1]) is None


def test_the_reading_shows_a_compact_heatmap_in_jupyter(readings):
    page = readings["logit"]._repr_html_()
    # the figure without plotly.js (written once per notebook) and nothing fetched from a CDN
    assert "plotly-graph-div" in page and "Plotly.newPlot" in page and len(page) < 200_000
    assert "plotly.js v" not in page and "cdn.plot.ly" not in page and "<script src" not in page
    assert '"hovertext":["\\u003cb\\u003eL0' in page and "5. " in page and "6. " not in page  # 5 tokens per hover


def test_pinned_ranks_topk_and_most_common(readings):
    r = readings["jacobian"]
    position = int(r.positions[4])
    fig = ranks.pinned_ranks_figure(readings, position)
    assert len(fig.data) == 4  # 2 pinned tokens x 2 lenses
    assert list(fig.data[0].y) == readings["logit"].pinned_ranks[" Paris"][:, 4].tolist()
    assert list(fig.data[2].x) == r.layers
    assert ranks.pinned_ranks_figure({"logit": None}, position) is None
    cells = {name: reading.cell(2, position) for name, reading in readings.items()}
    bars = tokens.topk_bars(cells, k=5)
    assert list(bars.data[1].x) == cells["jacobian"]["top_probs"][::-1]
    assert bars.data[0].y[-1] == f"1. {shown(cells['logit']['top_tokens'][0])}"
    table = most_common_tokens(r)
    common = tokens.most_common_figure({"jacobian": table}, top_n=3)
    assert list(common.data[0].x) == table["count"].head(3).tolist()[::-1]


def test_generation_and_comparison(llama, lenses):
    gen = generate(llama, TEXT, max_new_tokens=4, top_k=5)
    fig = gen.figure(llama)
    step = 0
    chosen = gen.top_probs[step][list(gen.top_ids[step]).index(gen.generated_ids[step])]
    assert fig.data[0].y[step] == pytest.approx(chosen) and same(fig.data[1].y, gen.top_probs[:, 0])
    assert fig.layout.xaxis.ticktext[0] == shown(llama.decode([int(gen.generated_ids[0])]))
    assert generation_figures.generation_figure(gen, llama.decode).data[0].hovertext == fig.data[0].hovertext
    steer = Steer(llama, lenses["jacobian"], "is", 4.0, layers=[2])
    result = compare_runs(llama, TEXT, [steer], max_new_tokens=3, top_k=5)
    comparison = result.figure(k=5)
    assert list(comparison.data[0].x) == result.next_tokens["clean_prob"].tolist()[::-1]
    assert list(comparison.data[1].x) == result.next_tokens["edited_prob"].tolist()[::-1]
    assert "clean vs edited" in comparison.layout.title.text


def test_evaluation_pass_at_k_and_swap_success(llama, lenses):
    frame = evaluate(llama, lenses, [LONG_TEXT], skip_first=1)
    fig = frame.figure()
    assert type(frame).__name__ == "Evaluation" and type(frame[frame["lens"] == "logit"]).__name__ == "Evaluation"
    logit = frame[frame["lens"] == "logit"].sort_values("layer")
    assert list(fig.data[0].y) == logit["kl_bits"].tolist() and list(fig.data[1].y) == logit["ce_bits"].tolist()
    assert same(evaluation.eval_curves_figure(frame).data[2].y, frame[frame["lens"] == "jacobian"]["kl_bits"])
    items = [{"prompt": "The capital of France is", "intermediates": ["is"]}]  # one token in the tiny vocabulary
    summary = pass_at_k(llama, lenses, items, k=(1, 50)).assign(set="inline")  # the Evaluate page adds the set
    bars = evaluation.pass_at_k_figure(summary)
    logit_at_1 = summary[(summary["k"] == 1) & (summary["lens"] == "logit")]["pass_rate"]
    assert len(bars.data) == 4 and same(bars.data[0].y, logit_at_1) and not logit_at_1.isna().any()
    report = pd.DataFrame({"lens": ["jacobian", "jacobian", "random"], "alpha": [1.0, 4.0, 1.0],
                           "rate": [0.5, 0.75, 0.0], "ci_low": [0.1, 0.3, 0.0], "ci_high": [0.9, 0.95, 0.4],
                           "eligible": [4, 4, 4]})
    swap = interventions.swap_success_figure(report)
    assert list(swap.data[0].y) == [0.5, 0.75] and list(swap.data[0].error_y.arrayminus) == pytest.approx([0.4, 0.45])


def test_fit_figures(llama):
    from jlens_core.lenses.spectra import layer_stats_and_spectra

    lens = fit(llama, [LONG_TEXT, TEXT], source_layers=[0, 2], skip_first=2, max_seq_len=16, dim_batch=16)
    convergence, norms = fitting.fit_figures(lens.diagnostics)
    assert {t.name for t in convergence.data} == {"L0", "L2", "1/n guide"}
    assert np.asarray(norms.data[0].z).shape == (2, 2)  # layers x prompts
    with pytest.raises(ValueError, match="no fit diagnostics"):
        fitting.fit_figures([])
    stats, spectra = layer_stats_and_spectra(lens)
    assert list(fitting.layer_stats_figure(stats).data[0].y) == stats["fro_norm"].tolist()
    spectrum = fitting.spectrum_figure(spectra)
    assert same(spectrum.data[0].y, spectra[0]) and len(spectrum.data) == 2
    history = [{"step": 1, "train_kl_bits": 3.0, "heldout_kl_bits": 3.5}, {"step": 2, "train_kl_bits": 2.0}]
    tune = fitting.tune_figure(history)
    assert list(tune.data[0].y) == [3.0, 2.0] and list(tune.data[1].x) == [1]


def test_divergence_figure(llama, tmp_path):
    from jlens_core import diff_dumps, dump_hidden_states
    from jlens_core.debugging.diff import divergence_curve

    a = dump_hidden_states(llama, TEXT, tmp_path / "a")
    b = dump_hidden_states(llama, TEXT, tmp_path / "b")
    diff = diff_dumps(a, b)
    curve = divergence_curve(diff)
    fig = debugging.divergence_figure(curve, op="residual", atol=diff.atol, first_layer=diff.first_divergence)
    assert list(fig.data[0].x) == curve["layer"].tolist() and (np.asarray(fig.data[0].y) == 1e-12).all()
