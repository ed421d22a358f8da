"""The Streamlit app (issue #6, #9's Compare runs page) under ``streamlit.testing.v1.AppTest``.

Every page runs on a tiny model saved to a temporary folder (named in the URL's ``model`` query
parameter, as a user would share a view): the widgets, the heatmap's figure JSON (cell text,
hover, last row = the model's output), an injected cell selection, a fit run as a subprocess and
followed to the end, and the error paths (bad model id, bad lens file, empty prompt).
"""

from __future__ import annotations

import base64
import html
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import LONG_TEXT
from streamlit.proto.WidgetStates_pb2 import WidgetStates
from streamlit.testing.v1 import AppTest

from jlens_core import JacobianLens, fit
from jlens_core.models.loading import load_model
from jlens_core.reading.tokens import TokenDisplay

APP = Path(__file__).resolve().parent.parent / "app" / "main.py"
PROMPT = "The capital of France is Paris. The capital of Italy is"


# -- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rlens_file(tiny_model, tmp_path_factory) -> str:
    """A tiny R-lens: the same prompts and settings as :func:`lens_file`, fitted with relevance rules."""
    texts = [LONG_TEXT, LONG_TEXT.upper(), " ".join(reversed(LONG_TEXT.split()))]
    lens = fit(tiny_model, texts, skip_first=4, max_seq_len=40, rules="relevance")
    assert lens.kind == "relevance"
    return str(lens.save(tmp_path_factory.mktemp("rlens") / "tiny.relevance.safetensors"))


@pytest.fixture(scope="module")
def expert_files(tiny_model, tmp_path_factory) -> dict[str, str]:
    """Tiny expert lenses (2 experts) of the lens_file prompts: uniform weights, learned (J++), and J++ combined
    into one matrix per layer (a plain Jacobian lens file)."""
    from jlens_core import ExpertLens

    texts = [LONG_TEXT, LONG_TEXT.upper(), " ".join(reversed(LONG_TEXT.split()))]
    lens = fit(tiny_model, texts, skip_first=4, max_seq_len=40, experts=2, cluster_prompts=3)
    assert isinstance(lens, ExpertLens)
    folder = tmp_path_factory.mktemp("experts")
    jpp = lens.with_weights({layer: torch.tensor([1.0, -0.5]) for layer in lens.source_layers}, items=["x"])
    return {"uniform": str(lens.save(folder / "uniform.safetensors")),
            "jpp": str(jpp.save(folder / "jpp.safetensors")),
            "combined": str(jpp.to_jacobian_lens().save(folder / "combined.safetensors"))}


@pytest.fixture(autouse=True)
def runs_root(tmp_path, tmp_path_factory, monkeypatch) -> Path:
    root = tmp_path / "runs"
    monkeypatch.setenv("JLENS_RUNS_DIR", str(root))
    # The app confines typed paths to its workspace: here every test's temporary folder.
    monkeypatch.setenv("JLENS_APP_WORKSPACE", str(tmp_path_factory.getbasetemp()))
    monkeypatch.delenv("JLENS_APP_ALLOW_ANY_PATH", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    yield root
    # A test that failed while a fit it started was running must not leave that process behind.
    from jlens_core.fitting import runs

    if root.exists():
        for run in runs.list_runs(root):
            runs.stop(run, force=True)


def make_app(**query) -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=180)
    # The fixtures' fits keep split halves, which turn Inspect's stability marks on (extra traces, a "stable %"
    # column): they have their own tests (tests/test_app_stability.py), so these start with them off.
    query.setdefault("stability", "0")
    at.query_params.update({k: v for k, v in query.items() if v is not None})
    return at


def ok(at: AppTest) -> AppTest:
    assert not at.exception, [e.value for e in at.exception]
    return at


def chart(at: AppTest, key: str) -> dict:
    found = [c for c in at.get("plotly_chart") if c.proto.id.endswith(f"-{key}")]
    assert found, f"no chart {key!r}; charts: {[c.proto.id for c in at.get('plotly_chart')]}"
    return json.loads(found[0].proto.spec)


def values(data) -> np.ndarray:
    """A Plotly JSON array: a plain list, or Plotly's typed-array form ``{"dtype", "bdata", "shape"}``."""
    if isinstance(data, dict) and "bdata" in data:
        flat = np.frombuffer(base64.b64decode(data["bdata"]), dtype=np.dtype(data["dtype"]))
        shape = [int(n) for n in str(data.get("shape", len(flat))).split(",")]
        return flat.reshape(shape)
    return np.asarray(data)


def hold_extras(monkeypatch) -> threading.Event:
    """Hold the app's background extras (the stability marks, the J-space labels: ``cache``'s threads) until
    the returned event is set, so that a test sees the first paint without them."""
    sys.path.insert(0, str(APP.parent))
    import cache  # the app's module, as its pages import it

    release = threading.Event()
    for name in ("_in_background", "_each_in_background"):  # the stability marks', the J-space labels'
        real = getattr(cache, name)
        monkeypatch.setattr(cache, name, lambda *a, real=real: release.wait(60) and real(*a))
    return release


def rerun_until(at: AppTest, arrived, what: str, tries: int = 240) -> AppTest:
    """Run ``at`` again until ``arrived(at)`` (an extra computed in the background is drawn: the page's poll does
    this in a browser); fails naming ``what`` after ``tries`` half-second waits."""
    for _ in range(tries):
        if arrived(at):
            return at
        time.sleep(0.5)
        ok(at.run())
    raise AssertionError(f"the {what} never arrived")


def has_chart(at: AppTest, key: str) -> bool:
    return any(c.proto.id.endswith(f"-{key}") for c in at.get("plotly_chart"))


def select_point(at: AppTest, key: str, **point) -> AppTest:
    """Send a Plotly selection event to the chart ``key``, as the browser does on a click."""
    element = next(c for c in at.get("plotly_chart") if c.proto.id.endswith(f"-{key}"))
    states = at._tree.get_widget_states()
    merged = WidgetStates()
    merged.widgets.extend([w for w in states.widgets if w.id != element.proto.id])
    widget = merged.widgets.add()
    widget.id = element.proto.id
    widget.string_value = json.dumps({"selection": {"points": [point], "point_indices": [0], "box": [], "lasso": []}})
    return at._run(merged)


def button(at: AppTest, label: str):
    return next(b for b in at.button if b.label == label)


def output_tokens(model, text: str) -> list[str]:
    """The model's own top-1 at each position (display strings, escaped as Plotly text)."""
    ids = model.encode(text)
    with torch.no_grad():
        top = model.hf_model(ids).logits[0].argmax(-1).tolist()
    strings = TokenDisplay.for_model(model).strings()
    return [html.escape(s if s.strip() else s.replace(" ", "·"), quote=False) for s in (strings[i] for i in top)]


def same_tokens(cells: list[str], tokens: list[str]) -> bool:
    """Cell texts are the tokens, or their first characters and an ellipsis when the cells are narrow."""
    return len(cells) == len(tokens) and all(
        c == t or (c.endswith("…") and t.startswith(c[:-1])) for c, t in zip(cells, tokens))


# -- Inspect ----------------------------------------------------------------------------------------
def test_inspect_logit_only_heatmap(tiny_dir, tiny_model):
    at = ok(make_app(model=tiny_dir, lens="none", prompt=PROMPT).run())
    assert any("logit lens only" in i.value for i in at.sidebar.info)
    assert "4 layers" in at.sidebar.caption[0].value and "width 32" in at.sidebar.caption[0].value
    spec = chart(at, "heatmap")
    trace, cells = spec["data"]  # the heatmap, and the invisible markers that carry hover and clicks
    assert trace["type"] == "heatmap" and cells["type"] == "scatter"
    n_tokens = tiny_model.encode(PROMPT).shape[1]
    assert spec["layout"]["yaxis"]["ticktext"] == ["L0", "L1", "L2", "output (L3)"]
    assert values(trace["z"]).shape == (4, n_tokens)
    assert same_tokens(trace["text"][-1], output_tokens(tiny_model, PROMPT))  # last row = the model's output
    hover = cells["hovertext"][-1]  # the last row's last cell
    assert "<b>L3</b>" in hover and hover.count("%<br>") + 1 >= 10 and "10. " in hover
    # one marker drawn: Plotly finds the cell under the cursor from the data, not from drawn markers
    assert cells["marker"]["maxdisplayed"] == 1 and len(values(cells["x"])) == 4 * n_tokens
    assert trace["zmin"] == 0 and trace["zmax"] == 1  # top-1 probability
    # a line above the heatmap says what was read (and how long it took, when it was not cached)
    assert any(c.value.startswith(f"{n_tokens} positions × 4 layers") for c in at.caption)
    # a Jacobian mode without a lens falls back to the logit lens and says so
    at.radio(key="mode").set_value("side").run()
    assert any("No Jacobian lens is loaded" in i.value for i in ok(at).info)
    assert len(chart(at, "heatmap")["data"]) == 2


def test_inspect_lens_modes_and_statistics(tiny_dir, tiny_model, lens_file):
    at = ok(make_app(model=tiny_dir, lens=lens_file, prompt=PROMPT).run())
    assert at.radio(key="mode").value == "side"  # the default when a lens is loaded
    assert "Jacobian lens" in at.sidebar.caption[1].value and "3 prompts" in at.sidebar.caption[1].value
    side = chart(at, "heatmap")
    assert [t["name"] for t in side["data"]] == ["Logit lens", "Logit lens cells", "Jacobian lens",
                                                 "Jacobian lens cells"]
    logit, jacobian = side["data"][0], side["data"][2]
    assert logit["text"][-1] == jacobian["text"][-1]  # both end at the model's output
    assert same_tokens(jacobian["text"][-1], output_tokens(tiny_model, PROMPT))
    assert logit["coloraxis"] == jacobian["coloraxis"] == "coloraxis"
    assert logit["yaxis"] == "y" and jacobian["yaxis"] == "y2"  # logit above, Jacobian below
    at.radio(key="mode").set_value("diff").run()
    diff, diff_cells = ok(at) and chart(at, "heatmap")["data"]
    assert diff["zmid"] == 0 and np.all(values(diff["z"])[-1] == 0)  # both lenses are the model at the output
    assert "Jacobian − logit" in diff_cells["hovertext"][0]
    at.radio(key="mode").set_value("jacobian")
    at.selectbox(key="stat").set_value("next_token_rank").run()
    jac = ok(at) and chart(at, "heatmap")["data"][0]
    assert jac["name"] == "Jacobian lens" and jac["colorbar"]["ticktext"][0] == "1"  # log-scaled ranks
    for stat in ("entropy_bits", "kl_bits", "ce_bits", "final_top1_rank"):
        at.selectbox(key="stat").set_value(stat).run()
        assert ok(at) and np.isfinite(values(chart(at, "heatmap")["data"][0]["z"])[:, :-1]).all()
    params = at.query_params
    assert params["mode"] == "jacobian"  # AppTest gives a single value as a string


def test_inspect_display_options(tiny_dir, tiny_model, lens_file):
    at = ok(make_app(model=tiny_dir, lens=lens_file, prompt=PROMPT, mode="logit").run())
    at.number_input(key="stride").set_value(2).run()
    assert chart(ok(at), "heatmap")["layout"]["yaxis"]["ticktext"] == ["L0", "L2", "output (L3)"]
    n = tiny_model.encode(PROMPT).shape[1]
    at.slider(key="pos_range").set_value((3, 9)).run()
    trace = chart(ok(at), "heatmap")["data"][0]
    assert values(trace["x"]).tolist() == list(range(3, 10))
    at.slider(key="top_k").set_value(3).run()
    hover = chart(ok(at), "heatmap")["data"][1]["hovertext"][0]
    assert "3. " in hover and "4. " not in hover
    at.toggle(key="show_ws").set_value(True).run()
    assert "·" in "".join(chart(ok(at), "heatmap")["layout"]["xaxis"]["ticktext"])
    at.toggle(key="word_like").set_value(True).run()
    ok(at)
    at.text_input(key="pinned").set_value(" Paris, Rome").run()
    assert ok(at).selectbox(key="stat").options[-2:] == ["Rank of pinned ' Paris'", "Rank of pinned ' Rome'"]
    assert has_chart(at, "pinned_ranks")
    pinned = chart(at, "pinned_ranks")
    assert len(pinned["data"]) == 4  # two tokens x two lenses
    at.selectbox(key="stat").set_value("rank_ Paris").run()
    assert chart(ok(at), "heatmap")["data"][0]["colorbar"]["ticktext"][0] == "1"
    assert n > 9


def test_inspect_examples_chat_template_and_downloads(tiny_dir):
    at = ok(make_app(model=tiny_dir, lens="none").run())
    examples = at.selectbox(key="example").options
    assert len(examples) >= 5
    at.selectbox(key="example").set_value("Counting").run()
    assert ok(at).text_area(key="prompt").value.startswith("Monday")
    plain = values(chart(at, "heatmap")["data"][0]["x"]).size
    at.toggle(key="chat").set_value(True).run()
    labels = chart(ok(at), "heatmap")["layout"]["xaxis"]["ticktext"]
    assert labels[0] == "0: &lt;|bos|&gt;"  # the template's tokens are read too (escaped for Plotly)
    assert values(chart(at, "heatmap")["data"][0]["x"]).size > plain
    assert [b.label for b in at.get("download_button")] == ["Download table (CSV)", "Download figure (HTML)"]


def test_inspect_cell_selection_opens_the_detail_panel(tiny_dir, tiny_model, lens_file):
    at = ok(make_app(model=tiny_dir, lens=lens_file, prompt=PROMPT).run())
    # default cell: the model's output at the last position
    n = tiny_model.encode(PROMPT).shape[1]
    assert at.selectbox(key="cell_layer").value == 3 and at.selectbox(key="cell_pos").value == n - 1
    shapes = chart(at, "heatmap")["layout"]["shapes"]
    outlines = [(sh["xref"], sh["x0"], sh["y0"]) for sh in shapes if sh.get("name") != "not fitted"]
    assert outlines == [("x", n - 1.5, 2.5), ("x2", n - 1.5, 2.5)]  # the default cell, in both panels
    # the lens was fitted with skip_first=4: its panel's positions 0-3 are shaded above the output row, the
    # logit panel's not, and their cells say why on hover
    shades = [(sh["xref"], sh["x0"], sh["x1"], sh["y0"], sh["y1"]) for sh in shapes if sh.get("name") == "not fitted"]
    assert shades == [("x2", -0.5, 3.5, -0.5, 2.5)]
    jacobian_hover = chart(at, "heatmap")["data"][3]["hovertext"]  # row-major: row 0's positions first
    note = "not fitted: position &lt; skip_first=4 of this lens"
    assert [note in h for h in jacobian_hover[:n]] == [p < 4 for p in range(n)]
    assert not any(note in h for h in jacobian_hover[-n:])  # the output row is the model itself
    assert not any(note in h for h in chart(at, "heatmap")["data"][1]["hovertext"])
    ok(select_point(at, "heatmap", x=5, y=1, curve_number=3))  # a click on row 1 of the Jacobian panel
    assert at.selectbox(key="cell_layer").value == 1 and at.selectbox(key="cell_pos").value == 5
    # the clicked cell is outlined in the figure of the same run
    outlines = [(sh["xref"], sh["yref"], sh["x0"], sh["x1"], sh["y0"], sh["y1"])
                for sh in chart(at, "heatmap")["layout"]["shapes"] if sh.get("name") != "not fitted"]
    assert outlines == [("x", "y", 4.5, 5.5, 0.5, 1.5), ("x2", "y2", 4.5, 5.5, 0.5, 1.5)]
    bars = chart(at, "cell_bars")
    assert [t["name"] for t in bars["data"]] == ["Logit lens", "Jacobian lens"]
    assert len(bars["data"][0]["y"]) == 10
    tokens = TokenDisplay.for_model(tiny_model).strings()
    ids = tiny_model.encode(PROMPT)[0].tolist()
    assert any(f"`{tokens[ids[5]]}`" in m.value and "position 5" in m.value for m in at.markdown)
    table = next(d.value for d in at.dataframe if "lens" in d.value.columns)  # the cell's table
    assert list(table["lens"]) == ["Logit lens", "Jacobian lens"]
    # the same point again (a rerun) does not undo a choice made in the selectboxes
    at.selectbox(key="cell_layer").set_value(2).run()
    assert ok(at).selectbox(key="cell_layer").value == 2


def test_query_params_restore_a_shared_view(tiny_dir, lens_file):
    at = ok(make_app(model=tiny_dir, lens=lens_file, prompt="Once upon a time there was", mode="diff",
                     stat="kl_bits").run())
    assert at.text_area(key="prompt").value == "Once upon a time there was"
    assert at.radio(key="mode").value == "diff" and at.selectbox(key="stat").value == "kl_bits"
    assert "Jacobian − logit" in chart(at, "heatmap")["layout"]["title"]["text"]
    at.text_area(key="prompt").set_value("The capital of France is").run()
    params = {k: (v[0] if isinstance(v, list) else v) for k, v in ok(at).query_params.items()}
    assert params == {"model": tiny_dir, "lens": lens_file, "prompt": "The capital of France is", "mode": "diff",
                      "stat": "kl_bits", "stability": "0"}  # off (make_app), unlike its default for a lens with halves


def test_inspect_generates_and_reads_the_continuation(tiny_dir, tiny_model, lens_file):
    from jlens_core.reading.generation import generate

    prompt = "The capital of France is"
    at = ok(make_app(model=tiny_dir, lens=lens_file, prompt=prompt, gen="6", band="1-2", mode="side").run())
    expected = generate(tiny_model, prompt, max_new_tokens=6)
    n_prompt, n_gen = expected.n_prompt, expected.n_generated
    assert at.number_input(key="gen_n").value == 6 and at.slider(key="band").value == (1, 2)
    assert any(m.value.startswith(f"**Continuation** ({n_gen} tokens, greedy") for m in at.markdown)
    spec = chart(at, "heatmap")
    logit, jacobian = spec["data"][0], spec["data"][2]
    assert values(logit["z"]).shape == (3, n_prompt + n_gen)  # band rows L1, L2 + the output; prompt + continuation
    assert spec["layout"]["yaxis"]["ticktext"] == ["L1", "L2", "output (L3)"]
    ticks = spec["layout"]["xaxis2"]["ticktext"]
    assert [("✎" in tick) for tick in ticks] == [False] * n_prompt + [True] * n_gen
    assert any(s.get("x0") == n_prompt - 0.5 for s in spec["layout"]["shapes"])  # the boundary line
    # the output row over the continuation is what the model wrote
    strings = TokenDisplay.for_model(tiny_model).strings()
    written = [html.escape(s if s.strip() else s.replace(" ", "·"), quote=False)
               for s in (strings[i] for i in expected.generated_ids.tolist())]
    assert same_tokens(logit["text"][-1][n_prompt - 1:-1], written)
    assert jacobian["name"] == "Jacobian lens"
    params = {k: (v[0] if isinstance(v, list) else v) for k, v in at.query_params.items()}
    assert params["gen"] == "6" and params["band"] == "1-2" and "temp" not in params

    # the most common tokens of the band (the Jacobian reading's layers 1-2); a click pins the first
    from jlens_core.reading.reader import read_prompt
    from jlens_core.reading.summaries import most_common_tokens
    from jlens_core.reading.tokens import token_id

    lens = JacobianLens.load(lens_file)
    reading = read_prompt(tiny_model, lens, expected, layers=[1, 2, 3], top_k=10)
    top = most_common_tokens(reading, layers=[1, 2], top_n=1)
    at.button(key="mc_pin_jacobian_0").click().run()
    pinned = ok(at).session_state["pinned"]
    assert token_id(tiny_model.tokenizer, pinned, rule="first") == int(top["token_id"][0])
    assert f"Rank of pinned {pinned!r}" in at.selectbox(key="stat").options

    # sampled: reproducible with the seed, in the URL
    at.number_input(key="gen_temp").set_value(1.0).run()
    at.number_input(key="gen_seed").set_value(5).run()
    sampled = generate(tiny_model, prompt, max_new_tokens=6, temperature=1.0, seed=5)
    assert any(f"`{sampled.continuation.strip() or '∅'}`" in m.value for m in ok(at).markdown)
    params = {k: (v[0] if isinstance(v, list) else v) for k, v in at.query_params.items()}
    assert params["temp"] == "1" and params["seed"] == "5"
    at.number_input(key="gen_n").set_value(0).run()
    assert "gen" not in ok(at).query_params
    assert values(chart(at, "heatmap")["data"][0]["z"]).shape[1] == n_prompt


def test_inspect_stop_keeps_the_partial_generation(tiny_dir, tiny_model):
    from jlens_core.reading.generation import generate

    prompt = "Once upon a time"
    at = ok(make_app(model=tiny_dir, lens="none", prompt=prompt).run())
    key = (at.session_state["_ctx"].model_key, prompt, 12, 0.0, None)
    partial = generate(tiny_model, prompt, max_new_tokens=12, stop_at_eos=False, progress=lambda p: p.step == 3)
    partial.stop_reason = "max_new_tokens"  # as the page holds it while generating
    at.session_state["_gen_partial"] = (key, partial)
    at.session_state["_gen_stop"] = True  # the Stop button's callback
    at.number_input(key="gen_n").set_value(12).run()
    assert any(m.value.startswith("**Continuation** (3 tokens, greedy; stopped)") for m in ok(at).markdown)
    n_prompt = tiny_model.encode(prompt).shape[1]
    assert values(chart(at, "heatmap")["data"][0]["z"]).shape[1] == n_prompt + 3


def test_inspect_generation_bad_input(tiny_dir):
    at = ok(make_app(model=tiny_dir, lens="none", prompt="hi", gen="999", temp="-3", band="9-1").run())
    assert at.number_input(key="gen_n").value == 256  # clamped to the control's range
    assert at.number_input(key="gen_temp").value == 0.0  # a negative temperature is ignored
    assert at.slider(key="band").value == (1, 3)


def test_inspect_intervene_panel(tiny_dir, tiny_model, lens_file):
    from jlens_core.interventions import Swap
    from jlens_core.reading.generation import generate

    at = ok(make_app(model=tiny_dir, lens=lens_file, prompt=PROMPT).run())
    # the token is prefilled from the selected cell's top-1 (here the default cell: the output's last position)
    top1 = tiny_model.hf_model(tiny_model.encode(PROMPT)).logits[0, -1].argmax().item()
    assert at.text_input(key="iv_token").value == tiny_model.decode([top1])
    assert at.slider(key="iv_layers").value == (1, 2)  # n_layers // 3 .. the lens's last source layer
    at.text_input(key="iv_token").set_value(" capital")
    at.selectbox(key="iv_replacement").set_value(" time")
    at.number_input(key="iv_alpha").set_value(4.0)
    at.number_input(key="iv_new").set_value(6)
    at.button(key="iv_run").click().run()
    lens = JacobianLens.load(lens_file)
    swap = Swap(tiny_model, lens, " capital", " time", 4.0, layers=[1, 2])
    clean = generate(tiny_model, PROMPT, max_new_tokens=6)
    edited = generate(tiny_model, PROMPT, max_new_tokens=6, edits=[swap])
    assert any(c.value == f"Edit: `{swap!r}`" for c in ok(at).caption)
    bars = chart(at, "iv_bars")
    assert [d["name"] for d in bars["data"]] == ["clean", "edited"]
    np.testing.assert_allclose(values(bars["data"][1]["x"])[::-1], edited.top_probs[0], rtol=1e-5)
    texts = [m.value for m in at.markdown]
    i = texts.index("**Edited continuation**")
    first = next((k for k, (a, b) in enumerate(zip(clean.generated_ids, edited.generated_ids)) if a != b), None)
    # the first token that differs is highlighted in both continuations, and nothing when none differs
    marked = [":orange-background[**" in texts[i + 1], ":orange-background[**" in texts[i - 1]]
    assert marked == [first is not None] * 2
    # beside the effect, what else moved: compare_runs' side effects, as the library gives them
    from jlens_core.interventions.compare import compare_runs

    effects = compare_runs(tiny_model, PROMPT, [swap], max_new_tokens=6).side_effects()
    assert effects.startswith("readout KL ")
    assert any(c.value == f"What else moved: {effects} (KL(edited ‖ clean); docs/interventions.md)."
               for c in at.caption)
    # the heatmap of the edited run
    at.toggle(key="iv_edited_heatmap").set_value(True).run()
    assert chart(ok(at), "heatmap")["layout"]["title"]["text"].startswith(f"Edited run ({swap!r})")
    # steer and ablate; a changed setting asks for a new run
    at.radio(key="iv_op").set_value("steer").run()
    assert any("Settings changed" in c.value for c in ok(at).caption)
    at.slider(key="iv_strength").set_value(2.0)
    at.button(key="iv_run").click().run()
    assert any(c.value.startswith("Edit: `Steer(' capital', strength=2") for c in ok(at).caption)
    # bad input: one sentence naming the pieces
    at.radio(key="iv_op").set_value("ablate")
    at.text_input(key="iv_token").set_value(" capital city")
    at.button(key="iv_run").click().run()
    assert any("' capital city' is not a single vocabulary token: it is" in e.value for e in ok(at).error)


def test_intervene_centred_directions_and_the_r_lens(tiny_dir, tiny_model, lens_file, rlens_file):
    from jlens_core.interventions import Swap

    at = ok(make_app(model=tiny_dir, lens=lens_file, rlens=rlens_file, prompt=PROMPT).run())
    assert at.selectbox(key="iv_lens").options == ["Jacobian lens", "R-lens", "Logit lens"]
    at.text_input(key="iv_token").set_value(" capital")
    at.selectbox(key="iv_replacement").set_value(" time")
    at.number_input(key="iv_new").set_value(3)
    at.button(key="iv_run").click().run()
    raw = Swap(tiny_model, JacobianLens.load(lens_file), " capital", " time", 1.0, layers=[1, 2])
    assert any(c.value == f"Edit: `{raw!r}`" for c in ok(at).caption)
    # centred directions: another edit (the same readings), a new run asked for, and the choice in the URL
    at.checkbox(key="iv_centred").check().run()
    assert any("Settings changed" in c.value for c in ok(at).caption)
    assert ok(at).query_params["centred"] == "1"
    at.button(key="iv_run").click().run()
    centred = Swap(tiny_model, JacobianLens.load(lens_file), " capital", " time", 1.0, layers=[1, 2], centred=True)
    assert repr(centred) != repr(raw) and any(c.value == f"Edit: `{centred!r}`" for c in ok(at).caption)
    # the R-lens's directions
    at.selectbox(key="iv_lens").set_value("relevance")
    at.button(key="iv_run").click().run()
    r_swap = Swap(tiny_model, JacobianLens.load(rlens_file), " capital", " time", 1.0, layers=[1, 2], centred=True)
    assert "relevance lens" in repr(r_swap) and any(c.value == f"Edit: `{r_swap!r}`" for c in ok(at).caption)


def test_intervene_panel_with_the_logit_lens_only(tiny_dir):
    at = ok(make_app(model=tiny_dir, lens="none", prompt=PROMPT).run())
    at.radio(key="iv_op").set_value("ablate")
    at.text_input(key="iv_token").set_value(" capital")
    at.button(key="iv_run").click().run()
    assert any(c.value.startswith("Edit: `Ablate(' capital', layers 1..2, logit lens)`") for c in ok(at).caption)


def select_row(at: AppTest, key: str, row: int) -> AppTest:
    """Pick row ``row`` of the dataframe ``key`` (a single-row selection), as the browser does on a click."""
    element = next(d for d in at.dataframe if d.proto.id.endswith(f"-{key}"))
    states = at._tree.get_widget_states()
    merged = WidgetStates()
    merged.widgets.extend([w for w in states.widgets if w.id != element.proto.id])
    widget = merged.widgets.add()
    widget.id = element.proto.id
    widget.string_value = json.dumps({"selection": {"rows": [row], "columns": [], "cells": []}})
    return at._run(merged)


def test_make_it_say_box(tiny_dir, tiny_model, lens_file):
    """Intervene's "Make it say…" box: the search's recipes in a table (the library's, with its controls); a picked
    recipe shows the clean and the edited heatmap side by side or their difference, and both continuations."""
    from jlens_core.interventions.compare import compare_runs
    from jlens_core.interventions.say import make_it_say

    lens = JacobianLens.load(lens_file)
    settings = {"layers": [1, 2], "ops": ["steer", "swap"], "positions": ["readout"], "max_replays": 6}
    target, expected = next((t, r) for t in ("of", "time", "is", "capital", "The", "one") if (r := make_it_say(
        tiny_model, lens, PROMPT, t, **settings)).recipes or r.controls["logit"].recipes)
    at = ok(make_app(model=tiny_dir, lens=lens_file, prompt=PROMPT).run())
    at.button(key="say_run").click().run()
    assert "Cannot search: The target is empty: type the word the model should say." in [e.value for e in ok(at).error]
    at.text_input(key="say_target").set_value(target)
    at.multiselect(key="say_ops").set_value(["steer", "swap"])
    at.multiselect(key="say_where").set_value(["readout"])
    at.number_input(key="say_replays").set_value(6)
    at.button(key="say_run").click().run()
    shown = [m.value for m in [*ok(at).success, *at.info]]
    assert expected.message in shown
    assert any(c.value.startswith(f"{expected.n_ranked} candidates ranked, {expected.n_replayed} replayed")
               for c in at.caption)
    table = next(d for d in at.dataframe if d.proto.id.endswith("-say_table")).value
    verified = [r for arm in expected.arms.values() for r in arm.recipes]
    assert len(table) == len(verified) and list(table["arm"]) == [r.arm for r in verified]
    assert list(table["layers"]) == [r.band for r in verified]
    np.testing.assert_allclose(table["target_prob"], [r.target_prob for r in verified], rtol=1e-4)
    for column in ("readout_kl_bits", "downstream_kl_bits", "prompt_kl_bits"):  # the library's side effects
        np.testing.assert_allclose(table[column].astype(float),
                                   [np.nan if r.row()[column] is None else r.row()[column] for r in verified],
                                   rtol=1e-3, atol=1e-6)
    # each arm's minimal recipe under its own name, as the CLI and the JSON give it
    listed = next(m.value for m in at.markdown if m.value.startswith("Minimal recipe per arm"))
    for name, arm in expected.arms.items():
        found = arm.minimal.describe(expected.target_text) if arm.minimal else "none found"
        assert f"- **{name}** ({arm.directions}): {found}" in listed
    # pick the first row: the recipe applied
    select_row(at, "say_table", 0)
    spec = chart(ok(at), "say_heatmap")
    assert [t["name"] for t in spec["data"]] == ["clean", "clean cells", "edited", "edited cells"]
    assert spec["layout"]["title"]["text"].startswith(verified[0].describe(expected.target_text))
    compared = compare_runs(tiny_model, PROMPT, verified[0].edits, max_new_tokens=20)
    codes = [c.value for c in at.code]
    assert codes[-2:] == [compared.clean.continuation or "∅", compared.edited.continuation or "∅"]
    at.radio(key="say_view").set_value("diff").run()
    diff = chart(ok(at), "say_heatmap")["data"][0]
    assert diff["zmid"] == 0
    # Stop: Streamlit ends the run; the partial result the progress callback kept is shown, marked as stopped
    partial = make_it_say(tiny_model, lens, PROMPT, target, **settings, progress=lambda p: p.done >= 4)
    assert partial.stopped
    partial.message = ""  # as it is in the middle of a search
    at.session_state["_say_partial"] = (at.session_state["say_result"]["key"], partial)
    at.session_state["_say_stop"] = True
    at.run()
    assert f"Stopped after {partial.n_replayed} replays: {len(partial.recipes)} verified" in ok(at).warning[0].value
    # a changed setting asks for a new search
    at.text_input(key="say_target").set_value(target + "x").run()
    assert any(c.value == "Settings changed: Search again." for c in ok(at).caption)


@pytest.mark.slow  # a fit or training in a subprocess
def test_tune_page_and_three_lenses(tiny_dir, tiny_model, lens_file, runs_root):
    at = ok(make_app(model=tiny_dir, lens=lens_file, prompt=PROMPT).run())
    at.switch_page("views/tune.py").run()
    for key, value in (("tune_n", 20), ("tune_steps", 4), ("tune_tokens", 32), ("tune_heldout", 2)):
        at.number_input(key=key).set_value(value)
    at.button(key="tune_go").click().run()
    assert any(s.value.startswith("Trained:") for s in ok(at).success)
    assert has_chart(at, "tune_chart_4")  # the loss curve, drawn live at every step
    trained = sorted((runs_root / "tuned").glob("*.safetensors"))
    assert len(trained) == 1
    from jlens_core.lenses.tuned import TunedLens

    assert TunedLens.load(trained[0], model=tiny_model).settings["steps"] == 4
    at.button(key="tune_use").click().run()
    assert at.session_state["tuned_choice"] == f"run:{trained[0].stem}"
    assert any(c.value.startswith("**Tuned lens** · layers 0..2 → 3 · 4 steps") for c in ok(at).sidebar.caption)
    at.switch_page("views/inspect.py").run()
    assert ok(at).radio(key="mode").options[-1] == "All three"
    at.radio(key="mode").set_value("three").run()
    spec = chart(ok(at), "heatmap")
    assert [t["name"] for t in spec["data"][::2]] == ["Logit lens", "Jacobian lens", "Tuned lens"]
    assert [a["text"] for a in spec["layout"]["annotations"][:3]] == ["Logit lens", "Jacobian lens", "Tuned lens"]
    # any two: the difference tuned - Jacobian
    at.radio(key="mode").set_value("diff").run()
    at.selectbox(key="pair_a").set_value("jacobian")
    at.selectbox(key="pair_b").set_value("tuned").run()
    assert chart(ok(at), "heatmap")["layout"]["title"]["text"].startswith("Tuned − jacobian")
    params = {k: (v[0] if isinstance(v, list) else v) for k, v in at.query_params.items()}
    assert params["tuned"] == f"run:{trained[0].stem}" and params["pair"] == "jacobian,tuned"
    # Evaluate: three curves
    at.switch_page("views/evaluate.py").run()
    at.radio(key="eval_source").set_value("paste").run()
    at.text_area(key="eval_paste").set_value(LONG_TEXT)
    button(at, "Evaluate").click().run()
    assert {t["name"] for t in chart(ok(at), "eval_curves")["data"]} == {"Logit lens", "Jacobian lens", "Tuned lens"}


def test_a_tuned_lens_folder_from_the_url(tiny_dir, tiny_model, tmp_path):
    folder = tmp_path / "tl"
    from jlens_core.lenses.tuned import TunedLens

    TunedLens.zeros(tiny_model).save_tuned_lens_folder(folder)
    at = ok(make_app(model=tiny_dir, lens="none", tuned=str(folder), prompt=PROMPT, mode="tuned").run())
    assert at.session_state["tuned_choice"] == "file"
    assert any("tuned-lens format" in c.value for c in at.sidebar.caption)
    assert chart(at, "heatmap")["data"][0]["name"] == "Tuned lens"
    bad = tmp_path / "bad"
    bad.mkdir()
    at = ok(make_app(model=tiny_dir, lens="none", tuned=str(bad), prompt=PROMPT).run())
    assert any("needs config.json and params.pt" in e.value for e in at.sidebar.error)


def test_lens_slots_share_one_rule_for_what_the_url_asks(tiny_dir):
    """Every slot (app/lens_slots.py): a shipped lens or run that is not there falls back to the slot's default."""
    at = ok(make_app(model=tiny_dir, lens="run:gone", rlens="shipped", jpp="shipped", rpp="run:gone", tuned="shipped",
                     prompt=PROMPT).run())
    # (none ships for this model)
    assert [at.session_state[f"{p}_choice"] for p in ("lens", "rlens", "jpp", "rpp", "tuned")] == ["none"] * 5
    assert not at.sidebar.error
    params = {k: (v[0] if isinstance(v, list) else v) for k, v in at.query_params.items()}
    # "none" stays in the URL where the default would load a lens (the Jacobian slot: the shipped one)
    assert params["lens"] == "none" and not {"tuned", "rlens", "jpp", "rpp", "extra"} & set(params)
    assert [s.label for s in at.sidebar.selectbox][-5:] == ["Lens", "R-lens", "J++ lens", "R++ lens", "Tuned lens"]
    assert at.sidebar.selectbox(key="jpp_choice").options == [
        "None (no shipped J++ lens for this model)", "J++ lens file (path)…", "Upload a J++ lens file…"]
    # the R-lens slot says that no R-lens ships for this model, and offers a file, an upload or hf://
    assert at.sidebar.selectbox(key="rlens_choice").options == [
        "None (no shipped R-lens for this model)", "R-lens file (path)…", "Upload an R-lens file…"]


def test_side_by_side_reads_an_undrawn_lens_at_the_selected_position_only(tiny_dir, tiny_model, lens_file, tmp_path,
                                                                            monkeypatch):
    from jlens_core.lenses.tuned import TunedLens
    from jlens_core.reading import reader as readings_mod

    torch.manual_seed(3)
    tuned = TunedLens.zeros(tiny_model)
    for a, b in tuned.translators.values():  # a trained-looking lens: not the logit lens
        a.copy_(0.1 * torch.randn_like(a))
        b.copy_(0.1 * torch.randn_like(b))
    path = tuned.save(tmp_path / "tuned.safetensors")
    prompt = PROMPT + " Rome, and of Spain"  # read by no other test: nothing cached
    calls = []  # one entry per read_prompts call: ([lens kinds], positions)
    real_many, real = readings_mod.read_prompts, readings_mod.read_prompt
    monkeypatch.setattr(readings_mod, "read_prompts", lambda model, lenses, *a, **k: calls.append(
        (sorted(lens.kind for lens in lenses.values()), k["positions"])) or real_many(model, lenses, *a, **k))
    at = ok(make_app(model=tiny_dir, lens=lens_file, tuned=str(path), prompt=prompt, mode="side").run())
    n_tokens = len(values(chart(at, "heatmap")["data"][0]["x"]))
    last = n_tokens - 1
    # the heatmap's two lenses together over every position; the tuned lens (not drawn) at the selected
    # cell's only
    assert calls == [(["jacobian", "logit"], list(range(n_tokens))), (["tuned"], [last])]
    table = next(d.value for d in at.dataframe if "lens" in d.value.columns)
    row = table.set_index("lens").loc["Tuned lens"]
    expected = real(tiny_model, TunedLens.load(path, model=tiny_model), prompt).cell(tiny_model.n_layers - 1, last)
    assert row["top-1"] == expected["top_tokens"][0]
    assert row["p(top-1)"] == pytest.approx(expected["top_probs"][0], rel=1e-5)
    # another cell: the tuned lens is read there, and its row follows
    at.selectbox(key="cell_pos").set_value(1)
    at.selectbox(key="cell_layer").set_value(1).run()
    assert calls[-1] == (["tuned"], [1])
    row = next(d.value for d in ok(at).dataframe if "lens" in d.value.columns).set_index("lens").loc["Tuned lens"]
    expected = real(tiny_model, TunedLens.load(path, model=tiny_model), prompt).cell(1, 1)
    assert row["entropy (bits)"] == pytest.approx(expected["entropy_bits"], rel=1e-5)


def test_the_r_lens_slot_side_by_side_with_any_lens(tiny_dir, tiny_model, lens_file, rlens_file):
    from jlens_core.reading.reader import read_prompt

    at = ok(make_app(model=tiny_dir, lens=lens_file, rlens=rlens_file, prompt=PROMPT).run())
    assert at.session_state["rlens_choice"] == "file"
    assert any(c.value.startswith("**R-lens** · 3 prompts") for c in at.sidebar.caption)
    # one mode per loaded lens, and every loaded lens stacked
    assert at.radio(key="mode").options == ["Logit lens", "Jacobian lens", "R-lens", "Side by side",
                                             "Difference (Jacobian − logit)", "All three"]
    at.radio(key="mode").set_value("relevance").run()
    r_lens = JacobianLens.load(rlens_file)
    expected = read_prompt(tiny_model, r_lens, PROMPT).top1_grid()
    trace = chart(ok(at), "heatmap")["data"][0]
    assert trace["name"] == "R-lens" and same_tokens(trace["text"][1], [html.escape(t, quote=False) for t in expected[1]])
    # side by side: any two of the loaded lenses, picked in two selectboxes and kept in the URL
    at.radio(key="mode").set_value("side").run()
    assert ok(at).selectbox(key="pair_a").options == ["Logit lens", "Jacobian lens", "R-lens"]
    at.selectbox(key="pair_a").set_value("jacobian")
    at.selectbox(key="pair_b").set_value("relevance").run()
    spec = chart(ok(at), "heatmap")
    assert [t["name"] for t in spec["data"][::2]] == ["Jacobian lens", "R-lens"]
    assert [a["text"] for a in spec["layout"]["annotations"][:2]] == ["Jacobian lens", "R-lens"]
    params = {k: (v[0] if isinstance(v, list) else v) for k, v in at.query_params.items()}
    assert params["rlens"] == rlens_file and params["pair"] == "jacobian,relevance"
    at.radio(key="mode").set_value("diff").run()
    assert chart(ok(at), "heatmap")["layout"]["title"]["text"].startswith("R-lens − jacobian")
    at.radio(key="mode").set_value("three").run()
    assert [t["name"] for t in chart(ok(at), "heatmap")["data"][::2]] == ["Logit lens", "Jacobian lens", "R-lens"]
    # the cell detail reads every loaded lens
    table = next(d.value for d in at.dataframe if "lens" in d.value.columns)
    assert list(table["lens"]) == ["Logit lens", "Jacobian lens", "R-lens"]
    # a shared URL with the pair restores it
    shared = ok(make_app(model=tiny_dir, lens=lens_file, rlens=rlens_file, prompt=PROMPT, mode="side",
                         pair="logit,relevance").run())
    assert [t["name"] for t in chart(shared, "heatmap")["data"][::2]] == ["Logit lens", "R-lens"]
    # with the R-lens alone, side by side pairs it with the logit lens
    alone = ok(make_app(model=tiny_dir, lens="none", rlens=rlens_file, prompt=PROMPT).run())
    assert alone.radio(key="mode").value == "side"
    assert [t["name"] for t in chart(alone, "heatmap")["data"][::2]] == ["Logit lens", "R-lens"]
    # each slot takes its own kind of lens, and says where the other goes
    swapped = ok(make_app(model=tiny_dir, lens=rlens_file, rlens=lens_file, prompt=PROMPT).run())
    errors = [e.value for e in swapped.sidebar.error]
    assert any("this file is an R-lens (fitted with rules='relevance'): pick it in the R-lens slot" in e
               for e in errors)
    assert any("not an R-lens: pick it in the Lens slot" in e for e in errors)
    # the Jacobians page shows either lens; Evaluate draws every loaded lens
    at.switch_page("views/jacobians.py").run()
    at.radio(key="jac_lens").set_value("relevance").run()
    assert any(c.value.startswith("R-lens: 3 prompts") for c in ok(at).caption)
    at.switch_page("views/evaluate.py").run()
    at.radio(key="eval_source").set_value("paste").run()
    at.text_area(key="eval_paste").set_value(LONG_TEXT)
    button(at, "Evaluate").click().run()
    assert {t["name"] for t in chart(ok(at), "eval_curves")["data"]} == {"Logit lens", "Jacobian lens", "R-lens"}


def test_the_default_reading_lens_opens_beside_the_logit_lens(tiny_dir, tiny_model, lens_file, expert_files, tmp_path,
                                                              monkeypatch):
    """A model whose default reading lens is a shipped variant (here a J++ lens, shipped as its combined file, as
    the default model's would be: jlens_core.lenses.shipped.DEFAULT_READING_LENS): the app loads it unasked and
    Inspect opens comparing the logit lens with it (a pair the URL leaves out, as it is the default); turned
    off, the URL says so, and a view shared by it keeps it off."""
    import shutil

    from jlens_core.lenses import shipped

    lens_dir = tmp_path / "lenses"
    lens_dir.mkdir()
    shutil.copyfile(expert_files["combined"], lens_dir / f"{Path(tiny_model.name).name}.jpp.safetensors")
    monkeypatch.setattr(shipped, "LENS_DIR", lens_dir)
    at = ok(make_app(model=tiny_dir, lens=lens_file, prompt=PROMPT).run())
    assert at.selectbox(key="jpp_choice").value == "none"  # shipped, but J stays the default reading lens
    assert "J++" not in at.radio(key="mode").options

    monkeypatch.setattr(shipped, "DEFAULT_READING_LENS", {str(tiny_model.name): "jpp"})
    at = ok(make_app(model=tiny_dir, lens=lens_file, prompt=PROMPT).run())
    assert at.selectbox(key="jpp_choice").value == "shipped"
    assert at.radio(key="mode").value == "side"
    name = next(n for n in at.radio(key="mode").options if n.startswith("J++"))  # the combined file's kind
    assert (at.session_state["pair_a"], at.session_state["pair_b"]) == ("logit", name)
    heatmap = chart(at, "heatmap")
    assert [t["name"] for t in heatmap["data"][::2]] == ["Logit lens", name]
    params = {k: (v[0] if isinstance(v, list) else v) for k, v in at.query_params.items()}
    assert params["jpp"] == "shipped" and "pair" not in params  # the default pair is left out
    at.selectbox(key="jpp_choice").set_value("none").run()  # turned off: the URL says so
    params = {k: (v[0] if isinstance(v, list) else v) for k, v in ok(at).query_params.items()}
    assert params["jpp"] == "none"
    assert ok(make_app(**params).run()).selectbox(key="jpp_choice").value == "none"  # and a shared view keeps it


def test_any_number_of_lenses_expert_slots_and_lenses_added_from_files(tiny_dir, tiny_model, lens_file, rlens_file,
                                                                         expert_files):
    """The J++ slot and "Add a lens from a file" (issue #32 §4): every loaded lens is offered by Inspect's modes and
    pair pickers, stacked, compared by Evaluate and usable by Intervene, each under a unique name; the URL keeps it."""
    from jlens_core import ExpertLens
    from jlens_core.interventions import Swap
    from jlens_core.reading.reader import read_prompt

    extra = f"{rlens_file},{expert_files['uniform']}"
    at = ok(make_app(model=tiny_dir, lens=lens_file, jpp=expert_files["jpp"], extra=extra, prompt=PROMPT).run())
    assert not at.sidebar.error
    assert any(c.value.startswith("**J++** · 3 prompts") and "2 experts, learned weights" in c.value
               for c in at.sidebar.caption)
    assert any(c.value.startswith("**uniform (J-experts (uniform))** · 3 prompts") for c in at.sidebar.caption)
    names = ["Logit lens", "Jacobian lens", "J++", "tiny.relevance (R)", "uniform (J-experts (uniform))"]
    assert at.radio(key="mode").options == names + ["Side by side", "Difference (Jacobian − logit)", "All 5"]
    # a lens read through its mode: the J++ lens's own reading
    at.radio(key="mode").set_value("J++").run()
    expected = read_prompt(tiny_model, ExpertLens.load(expert_files["jpp"]), PROMPT).top1_grid()
    trace = chart(ok(at), "heatmap")["data"][0]
    assert trace["name"] == "J++" and same_tokens(trace["text"][1], [html.escape(t, quote=False) for t in expected[1]])
    # any two as a difference, in the URL by name
    at.radio(key="mode").set_value("diff").run()
    assert ok(at).selectbox(key="pair_a").options == names
    at.selectbox(key="pair_a").set_value("uniform (J-experts (uniform))")
    at.selectbox(key="pair_b").set_value("J++").run()
    assert chart(ok(at), "heatmap")["layout"]["title"]["text"].startswith("J++ − uniform (j-experts")
    params = {k: (v[0] if isinstance(v, list) else v) for k, v in at.query_params.items()}
    assert params["jpp"] == expert_files["jpp"] and params["extra"] == extra
    assert params["pair"] == "uniform (J-experts (uniform)),J++" and params["mode"] == "diff"
    # all of them stacked; the cell detail reads every one
    at.radio(key="mode").set_value("three").run()
    assert [t["name"] for t in chart(ok(at), "heatmap")["data"][::2]] == names
    assert list(next(d.value for d in at.dataframe if "lens" in d.value.columns)["lens"]) == names
    # Intervene: the directions of any linear lens (the J++ lens's matrices are its combined ones)
    assert at.selectbox(key="iv_lens").options == ["Jacobian lens", "J++", "tiny.relevance (R)",
                                                   "uniform (J-experts (uniform))", "Logit lens"]
    at.selectbox(key="iv_lens").set_value("J++")
    at.text_input(key="iv_token").set_value(" capital")
    at.selectbox(key="iv_replacement").set_value(" time")
    at.number_input(key="iv_new").set_value(2)
    at.button(key="iv_run").click().run()
    swap = Swap(tiny_model, ExpertLens.load(expert_files["jpp"]), " capital", " time", 1.0, layers=[1, 2])
    assert "jacobian++" in repr(swap) and any(c.value == f"Edit: `{swap!r}`" for c in ok(at).caption)
    assert at.query_params["iv_lens"] == "J++"
    # a shared URL restores the pair and a lens mode by name
    shared = ok(make_app(model=tiny_dir, lens=lens_file, jpp=expert_files["jpp"], extra=extra, prompt=PROMPT,
                         mode="side", pair="J++,tiny.relevance (R)").run())
    assert [t["name"] for t in chart(shared, "heatmap")["data"][::2]] == ["J++", "tiny.relevance (R)"]
    by_name = ok(make_app(model=tiny_dir, lens="none", extra=rlens_file, prompt=PROMPT, mode="tiny.relevance (R)").run())
    assert by_name.radio(key="mode").value == "tiny.relevance (R)"
    # Evaluate: one curve per loaded lens
    at.switch_page("views/evaluate.py").run()
    at.radio(key="eval_source").set_value("paste").run()
    at.text_area(key="eval_paste").set_value(LONG_TEXT)
    button(at, "Evaluate").click().run()
    assert {t["name"] for t in chart(ok(at), "eval_curves")["data"]} == set(names)
    at.multiselect(key="pak_sets").set_value(["two_hop"])
    at.multiselect(key="pak_k").set_value([10])
    button(at, "Run pass@k").click().run()
    assert sorted(ok(at).dataframe[-2].value["lens"]) == sorted(["logit", "jacobian", *names[2:]])


def test_expert_slots_take_their_kind_and_lenses_are_added_and_removed(tiny_dir, lens_file, rlens_file, expert_files):
    # the combined one-matrix J++ file loads into the J++ slot; uniform experts show as such; each slot refuses
    # another kind with a sentence naming the right slot
    at = ok(make_app(model=tiny_dir, lens=expert_files["combined"], jpp=expert_files["combined"],
                     rpp=expert_files["uniform"], prompt=PROMPT).run())
    errors = [e.value for e in at.sidebar.error]
    assert any("jacobian++" in e and "the Lens slot does not take: pick it in the J++ lens slot" in e for e in errors)
    assert any("jacobian-experts" in e and "the R++ lens slot does not take: pick it in the J++ lens slot" in e
               for e in errors)
    assert any(c.value.startswith("**J++** · 3 prompts") and "combined into one matrix" in c.value
               for c in at.sidebar.caption)
    assert "J++" in at.radio(key="mode").options
    uniform = ok(make_app(model=tiny_dir, lens="none", jpp=expert_files["uniform"], prompt=PROMPT).run())
    assert "J-experts (uniform)" in uniform.radio(key="mode").options
    # "Add a lens from a file": a typed path (confined to the workspace), twice the same kind, then removed
    at = ok(make_app(model=tiny_dir, lens=lens_file, prompt=PROMPT).run())
    for path in (lens_file, lens_file, rlens_file):
        at.sidebar.text_input(key="extra_path").set_value(path)
        button(at.sidebar, "Add the lens").click().run()
    assert ok(at).session_state["extra_lenses"] == [lens_file, rlens_file]  # a file is added once
    assert at.radio(key="mode").options[:4] == ["Logit lens", "Jacobian lens", "tiny (J)", "tiny.relevance (R)"]
    at.sidebar.text_input(key="extra_path").set_value("/etc/passwd")
    button(at.sidebar, "Add the lens").click().run()
    assert any("outside the workspace" in e.value for e in ok(at).sidebar.error)
    at.sidebar.button(key="extra_remove_2").click().run()
    at.sidebar.button(key="extra_remove_0").click().run()
    assert ok(at).session_state["extra_lenses"] == [rlens_file] and not at.sidebar.error
    params = {k: (v[0] if isinstance(v, list) else v) for k, v in at.query_params.items()}
    assert params["extra"] == rlens_file
    # an added lens's name never clashes with another: the same file twice by two spellings
    again = f"{Path(rlens_file).parent}/./{Path(rlens_file).name}"
    twice = ok(make_app(model=tiny_dir, lens="none", extra=f"{rlens_file},{again}", prompt=PROMPT).run())
    assert [n for n in twice.radio(key="mode").options if n.startswith("tiny")] == [
        "tiny.relevance (R)", "tiny.relevance (R) #2"]


def test_word_tokens_only_reads_with_the_word_readout(tiny_dir, tiny_model, lens_file):
    from jlens_core.reading.reader import read_prompt
    from jlens_core.reading.word_readout import word_mask

    at = ok(make_app(model=tiny_dir, lens=lens_file, prompt=PROMPT, mode="jacobian").run())
    assert "vocab" not in at.query_params
    at.toggle(key="vocab_word").set_value(True).run()
    assert ok(at).query_params["vocab"] == "word"
    lens = JacobianLens.load(lens_file)
    word = read_prompt(tiny_model, lens, PROMPT, vocab="word")
    every = read_prompt(tiny_model, lens, PROMPT)
    assert word.top1_grid() != every.top1_grid()  # this prompt's cells have non-word top-1 tokens
    kept = word_mask(TokenDisplay.for_model(tiny_model))
    assert kept[word.top_ids].all()
    texts = chart(at, "heatmap")["data"][0]["text"]
    assert same_tokens(texts[1], [html.escape(t, quote=False) for t in word.top1_grid()[1]])
    # a shared URL reads the same way
    shared = ok(make_app(model=tiny_dir, lens=lens_file, prompt=PROMPT, mode="jacobian", vocab="word").run())
    assert shared.toggle(key="vocab_word").value
    assert chart(shared, "heatmap")["data"][0]["text"] == texts


def test_the_components_preload_is_gone_once_the_sidebar_has_run(tiny_dir):
    def preload_charts(at):
        return [c for c in at.get("plotly_chart") if c.proto.id.endswith("-_preload_chart")]

    def title_index(at):
        return next(i for i, child in at.main.children.items() if type(child).__name__ == "Title")

    at = ok(make_app(model=tiny_dir, lens="none", prompt=PROMPT).run())
    assert at.session_state["_components_preloaded"] and not preload_charts(at)
    assert len(values(chart(at, "heatmap")["data"][0]["x"])) > 0
    first = title_index(at)
    # later runs draw no preload, but the page keeps its elements' places (else the browser rebuilds it)
    at.text_area(key="prompt").set_value(PROMPT + " Rome").run()
    assert title_index(ok(at)) == first and not preload_charts(at)


def test_lens_upload_and_state_across_pages(tiny_dir, lens_file):
    at = ok(make_app(model=tiny_dir, lens="none").run())
    at.selectbox(key="lens_choice").set_value("upload").run()
    at.file_uploader(key="lens_upload").set_value(("tiny.safetensors", Path(lens_file).read_bytes(),
                                                  "application/octet-stream"))
    at.run()
    assert any("Jacobian lens" in c.value and "3 prompts" in c.value for c in ok(at).sidebar.caption)
    assert len(chart(at, "heatmap")["data"]) == 4  # a lens just loaded: side by side
    at.text_area(key="prompt").set_value("Water boils at one hundred degrees.").run()
    at.switch_page("views/jacobians.py").run()
    assert has_chart(ok(at), "jac_stats")
    at.switch_page("views/inspect.py").run()
    assert ok(at).text_area(key="prompt").value == "Water boils at one hundred degrees."  # kept across pages
    assert at.radio(key="mode").value == "side"


# -- error paths --------------------------------------------------------------------------------------
def test_bad_model_id_keeps_the_app_usable(tiny_dir):
    at = ok(make_app(model="no-such-org/no-such-model-xyz").run())
    assert any("Could not load the model" in e.value for e in at.sidebar.error)
    assert any("No model is loaded" in i.value for i in at.info)
    button(at, "Retry").click().run()  # tries again, and says so again
    assert any("Could not load the model" in e.value for e in ok(at).sidebar.error)
    for page in ("views/fit.py", "views/jacobians.py", "views/evaluate.py", "views/compare.py"):
        ok(at.switch_page(page).run())
    at.switch_page("views/inspect.py").run()
    at.text_input(key="model_spec").set_value(tiny_dir).run()
    assert not ok(at).sidebar.error and has_chart(at, "heatmap")


def test_bad_lens_files_show_their_error(tiny_dir, tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"this is not a lens" * 10)
    at = ok(make_app(model=tiny_dir, lens=str(junk), prompt=PROMPT).run())
    assert any("Could not load the lens" in e.value for e in at.sidebar.error)
    assert has_chart(at, "heatmap")  # the logit lens still reads
    other = JacobianLens({0: torch.eye(16)}, n_prompts=1, d_model=16, target_layer=1)
    other_path = other.save(tmp_path / "other.safetensors")
    at.text_input(key="lens_path").set_value(str(other_path)).run()
    assert any("d_model=16" in e.value for e in ok(at).sidebar.error)
    at.text_input(key="lens_path").set_value(str(tmp_path / "missing.safetensors")).run()
    assert any("No lens file" in e.value for e in ok(at).sidebar.error)


def test_empty_prompt_is_a_message(tiny_dir):
    at = ok(make_app(model=tiny_dir, lens="none").run())
    at.text_area(key="prompt").set_value("").run()
    assert any("prompt is empty" in w.value for w in ok(at).warning)
    assert not has_chart(at, "heatmap")


# -- Fit --------------------------------------------------------------------------------------------
def _wait(at: AppTest, until, timeout: float = 150.0) -> AppTest:
    start = time.time()
    while time.time() - start < timeout:
        at.run()
        ok(at)
        if until(at):
            return at
        time.sleep(0.5)
    pytest.fail(f"timed out; markdown: {[m.value for m in at.markdown][:4]}, errors: {[e.value for e in at.error]}")


def _state(at: AppTest) -> str:
    line = next(m.value for m in at.markdown if m.value.startswith("**") and " · " in m.value)
    return line.split(" · ")[1]


N_FIT = 40  # prompts of the fit started from the page (each ~1 s with its checkpoint and status files)


@pytest.mark.slow  # a 40-prompt fit in a subprocess, stopped and resumed
def finished_fit(root: Path, name: str, model: str, lens: str, args: list[str], **info) -> Path:
    """A finished fit of 3 prompts, its files as `jlens fit` leaves them: ``root/name/lens.safetensors`` (a copy of
    ``lens``), its ``run.json`` (``args`` and ``info``) and a done status. Returns the lens file."""
    folder = root / name
    folder.mkdir(parents=True)
    out = folder / "lens.safetensors"
    out.write_bytes(Path(lens).read_bytes())
    (folder / "run.json").write_text(json.dumps({"name": name, "model": model, "out": str(out), "args": args, **info}))
    (folder / "lens.status.json").write_text(json.dumps({"state": "done", "pid": None, "n_total": 3, "n_done": 3,
                                                         "next_idx": 3, "model": model, "out": str(out)}))
    return out


def use_finished_fit(at: AppTest, name: str, slot: str, choice: str, caption: str) -> None:
    """Pick the fit ``name`` on the Fit page and use its lens: the page names the slot that takes it (``slot``),
    the slot's ``choice`` becomes the run, and a sidebar caption starts with ``caption``."""
    at.switch_page("views/fit.py").run()
    at.selectbox(key="fit_run").set_value(name).run()
    assert any(f"({slot} → Fitted here)" in s.value for s in ok(at).success)
    button(at, "Use this lens").click().run()
    assert ok(at).session_state[choice] == f"run:{name}"
    assert any(c.value.startswith(caption) for c in at.sidebar.caption)


@pytest.mark.slow  # a fit or training in a subprocess
def test_fit_page_start_stop_resume_and_use_the_lens(tiny_dir, tmp_path, runs_root):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Text number {i}. {LONG_TEXT}" for i in range(N_FIT)))
    at = ok(make_app(model=tiny_dir, lens="none").run())
    at.switch_page("views/fit.py").run()
    assert any("No fits yet" in i.value for i in ok(at).info)
    at.text_input(key="fit_name").set_value("tiny-fit")
    at.radio(key="fit_source").set_value("path").run()
    at.text_input(key="fit_corpus_path").set_value(str(corpus))
    at.number_input(key="fit_n").set_value(N_FIT)
    at.number_input(key="fit_len").set_value(32)
    at.number_input(key="fit_min_chars").set_value(50)
    at.number_input(key="fit_dim_batch").set_value(1)
    button(at, "Start fit").click().run()
    assert ok(at).selectbox(key="fit_run").value == "tiny-fit"
    _wait(at, lambda a: _state(a) == "running" and has_chart(a, "fit_convergence")
          and a.get("progress")[0].proto.value > 0)  # the bar shows whole percent
    progress = at.get("progress")[0]
    assert 0 < progress.proto.value < 100
    button(at, "Stop").click().run()
    _wait(at, lambda a: _state(a) == "stopped")
    assert any("Resume continues" in w.value for w in at.warning)
    # a new browser session (a reload) finds the run again from its files
    again = ok(make_app(model=tiny_dir, lens="none").run())
    again.switch_page("views/fit.py").run()
    assert ok(again).selectbox(key="fit_run").value == "tiny-fit"
    button(again, "Resume").click().run()
    _wait(again, lambda a: _state(a) == "done")
    assert any(f"Finished: {N_FIT} prompts" in s.value for s in again.success)
    conv = chart(again, "fit_convergence")
    assert conv["data"][-1]["name"] == "1/n guide" and conv["layout"]["xaxis"]["type"] == "log"
    assert values(chart(again, "fit_norms")["data"][0]["z"]).shape[0] == 3  # three source layers
    halves = chart(again, "fit_halves")  # the split halves' agreement by layer (docs/method.md §3.3)
    assert halves["data"][0]["type"] == "bar" and len(halves["data"][0]["x"]) == 3
    assert f"Fitted here: tiny-fit ({N_FIT} prompts)" in again.selectbox(key="lens_choice").options
    button(again, "Use this lens").click().run()
    assert ok(again).session_state["lens_choice"] == "run:tiny-fit"
    assert any("Jacobian lens" in c.value and f"{N_FIT} prompts" in c.value for c in again.sidebar.caption)
    again.switch_page("views/inspect.py").run()
    assert len(chart(ok(again), "heatmap")["data"]) == 4  # side by side with the new lens


@pytest.mark.slow  # a fit or training in a subprocess
def test_fit_page_reports_a_failed_fit(tiny_dir, tmp_path):
    at = ok(make_app(model=tiny_dir, lens="none").run())
    at.switch_page("views/fit.py").run()
    at.text_input(key="fit_name").set_value("bad-corpus")
    at.radio(key="fit_source").set_value("path").run()
    at.text_input(key="fit_corpus_path").set_value(str(tmp_path / "no-such-corpus.txt"))
    button(at, "Start fit").click().run()
    _wait(at, lambda a: _state(a) == "failed")
    assert any("No corpus file" in e.value for e in at.error)
    # the same name again is refused with a sentence
    at.text_input(key="fit_name").set_value("bad-corpus")
    button(at, "Start fit").click().run()
    assert any("exists already" in e.value for e in ok(at).error)


@pytest.mark.slow  # a fit or training in a subprocess
def test_fit_page_rules_and_a_finished_r_fit_loads_into_the_r_lens_slot(tiny_dir, rlens_file, tmp_path, runs_root):
    at = ok(make_app(model=tiny_dir, lens="none").run())
    at.switch_page("views/fit.py").run()
    at.text_input(key="fit_name").set_value("r-bad-corpus")
    at.radio(key="fit_rules").set_value("relevance")
    at.radio(key="fit_source").set_value("path").run()
    at.text_input(key="fit_corpus_path").set_value(str(tmp_path / "no-such-corpus.txt"))
    button(at, "Start fit").click().run()
    args = json.loads((runs_root / "r-bad-corpus" / "run.json").read_text())["args"]
    assert args[args.index("--rules") + 1] == "relevance"  # `jlens fit --rules relevance`
    _wait(at, lambda a: _state(a) == "failed")
    # a finished fit with relevance rules (its files, as `jlens fit` leaves them) is offered by the R-lens slot only
    out = finished_fit(runs_root, "r-fit", tiny_dir, rlens_file, ["--rules", "relevance"],
                       settings={"rules": "relevance"})
    at = ok(make_app(model=tiny_dir, lens="none").run())
    assert "Fitted here: r-fit (3 prompts)" in at.selectbox(key="rlens_choice").options
    assert not any("r-fit" in o for o in at.selectbox(key="lens_choice").options)
    use_finished_fit(at, "r-fit", "R-lens", "rlens_choice", "**R-lens** · 3 prompts")
    # followed by its --out path, its header says where it goes
    fresh = ok(make_app(model=tiny_dir, lens="none").run())
    fresh.switch_page("views/fit.py").run()
    fresh.text_input(key="fit_follow").set_value(str(out)).run()
    button(fresh, "Use this lens").click().run()
    assert (ok(fresh).session_state["rlens_choice"], fresh.session_state["rlens_path"]) == ("file", str(out))
    assert fresh.session_state["lens_choice"] == "none"


def test_a_finished_expert_fit_loads_into_the_j_plus_plus_slot(tiny_dir, expert_files, runs_root):
    # a finished `jlens fit --experts` run (its files, as `jlens fit` leaves them): the J++ slot offers it, the J slot not
    finished_fit(runs_root, "x-fit", tiny_dir, expert_files["uniform"], ["--experts", "2"],
                 settings={"rules": "jacobian"})
    at = ok(make_app(model=tiny_dir, lens="none").run())
    assert "Fitted here: x-fit (3 prompts)" in at.selectbox(key="jpp_choice").options
    assert not any("x-fit" in o for k in ("lens_choice", "rlens_choice", "rpp_choice")
                   for o in at.selectbox(key=k).options)
    use_finished_fit(at, "x-fit", "J++ lens", "jpp_choice", "**J-experts (uniform)** · 3 prompts")


def test_fit_page_follows_a_fit_started_elsewhere(tiny_dir, lens_file, tmp_path):
    lens = JacobianLens.load(lens_file)
    out = tmp_path / "shell-fit.safetensors"
    out.write_bytes(Path(lens_file).read_bytes())
    (tmp_path / "shell-fit.diagnostics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lens.diagnostics))
    (tmp_path / "shell-fit.status.json").write_text(json.dumps(
        {"state": "done", "pid": None, "n_total": 3, "n_done": 3, "next_idx": 3, "model": tiny_dir,
         "corpus": "a shell", "out": str(out)}))
    at = ok(make_app(model=tiny_dir, lens="none").run())
    at.switch_page("views/fit.py").run()
    at.text_input(key="fit_follow").set_value(str(out)).run()
    assert _state(ok(at)) == "done" and has_chart(at, "fit_convergence")
    button(at, "Use this lens").click().run()
    assert any("Jacobian lens" in c.value and "3 prompts" in c.value for c in ok(at).sidebar.caption)
    at.text_input(key="fit_follow").set_value(str(tmp_path / "nothing.safetensors")).run()
    assert any("No fit status" in e.value for e in ok(at).error)


# -- paths confined to the workspace, fits limited (docs/security.md) ------------------------------------
def test_paths_outside_the_workspace_are_refused_and_nothing_is_written(tiny_dir, lens_file, tmp_path, monkeypatch):
    outside = tmp_path.parent.parent / "outside-the-workspace"  # above the test's temporary folders
    workspace = tmp_path / "ws"
    monkeypatch.setenv("JLENS_APP_WORKSPACE", str(workspace))
    monkeypatch.setenv("JLENS_APP_ALLOWED_PATHS", tiny_dir)  # the operator's --model
    at = ok(make_app(model=tiny_dir, lens="none").run())
    at.switch_page("views/fit.py").run()
    at.text_input(key="fit_name").set_value("escape")
    at.text_input(key="fit_ckpt").set_value(str(outside / "x.ckpt"))
    button(at, "Start fit").click().run()
    assert any(e.value.startswith("Could not start the fit: The checkpoint") and "outside the workspace" in e.value
               for e in ok(at).error)
    assert not outside.exists() and not (tmp_path / "runs" / "escape").exists()
    at.text_input(key="fit_ckpt").set_value("../../x.ckpt")  # relative to the run folder, then out through ..
    at.radio(key="fit_source").set_value("path").run()
    at.text_input(key="fit_corpus_path").set_value("/etc/passwd")
    button(at, "Start fit").click().run()
    assert any("The corpus path '/etc/passwd'" in e.value for e in ok(at).error)
    assert not (tmp_path / "runs" / "escape").exists()
    at.text_input(key="fit_follow").set_value(lens_file).run()  # a real fit's lens, but outside
    assert any("The followed lens path" in e.value and "outside the workspace" in e.value for e in ok(at).error)
    # the sidebar's lens and model boxes (and the URL that seeds them) obey the same rule
    at = ok(make_app(model=tiny_dir, lens=lens_file).run())
    assert at.session_state["lens_choice"] == "file"
    assert any("Could not load the lens: The lens file" in e.value and "outside the workspace" in e.value
               for e in at.sidebar.error)
    other_model = Path(tiny_dir).parent / "another-model"
    at = ok(make_app(model=str(other_model), lens="none").run())
    assert any("The model folder" in e.value and "outside the workspace" in e.value for e in at.sidebar.error)
    # inside the workspace the same lens loads
    inside = workspace / "lenses" / "tiny.safetensors"
    inside.parent.mkdir(parents=True)
    inside.write_bytes(Path(lens_file).read_bytes())
    at = ok(make_app(model=tiny_dir, lens="lenses/tiny.safetensors").run())  # relative: against the workspace
    assert not at.sidebar.error and any("Jacobian lens" in c.value for c in at.sidebar.caption)
    # --allow-any-path lifts it
    monkeypatch.setenv("JLENS_APP_ALLOW_ANY_PATH", "1")
    at = ok(make_app(model=tiny_dir, lens=lens_file).run())
    assert not at.sidebar.error and any("Jacobian lens" in c.value for c in at.sidebar.caption)


def test_fit_page_says_when_the_fits_allowed_at_once_are_running(tiny_dir, runs_root, monkeypatch):
    from jlens_core.fitting import runs

    folder = runs_root / "busy"
    folder.mkdir(parents=True)
    lens = folder / runs.LENS_FILE
    # a run whose process is alive (this one) and whose status says running
    (folder / runs.RUN_FILE).write_text(json.dumps({"name": "busy", "model": tiny_dir, "out": str(lens),
                                                    "args": ["--model", tiny_dir], "pid": os.getpid()}))
    lens.with_name("lens.status.json").write_text(json.dumps({"state": "running", "pid": os.getpid()}))
    assert runs.load_run(folder).state == "running"
    monkeypatch.setenv("JLENS_APP_MAX_FITS", "1")
    at = ok(make_app(model=tiny_dir, lens="none").run())
    at.switch_page("views/fit.py").run()
    assert any("1 of at most 1 fits at once are running (busy)" in i.value for i in ok(at).info)
    assert button(at, "Start fit").disabled
    with pytest.raises(ValueError, match="runs at most 1 at once"):
        runs.start(runs_root, "second", model=tiny_dir, corpus="x.txt", max_active=1)
    assert not (runs_root / "second").exists()
    monkeypatch.setenv("JLENS_APP_MAX_FITS", "2")
    at.run()
    assert not any("fits at once" in i.value for i in ok(at).info) and not button(at, "Start fit").disabled


# -- Jacobians, Evaluate, Compare runs ----------------------------------------------------------------
def test_jacobians_page(tiny_dir, lens_file):
    at = ok(make_app(model=tiny_dir, lens="none").run())
    at.switch_page("views/jacobians.py").run()
    assert any("No Jacobian lens" in i.value for i in ok(at).info)
    at = ok(make_app(model=tiny_dir, lens=lens_file).run())
    at.switch_page("views/jacobians.py").run()
    stats = chart(ok(at), "jac_stats")
    assert [t["name"] for t in stats["data"]] == ["‖J‖F / √d", "spectral norm", "‖J − I‖F / √d", "effective rank"]
    assert values(stats["data"][0]["x"]).tolist() == [0, 1, 2]
    assert [t["name"] for t in chart(at, "jac_spectrum")["data"]] == ["L0", "L1", "L2"]
    at.multiselect(key="jac_layers").set_value([1]).run()
    assert [t["name"] for t in chart(ok(at), "jac_spectrum")["data"]] == ["L1"]
    at.selectbox(key="jac_dir_layer").set_value(2).run()
    directions = ok(at).dataframe[-1].value
    assert set(directions["side"]) == {"output", "input"} and set(directions["sign"]) == {"+", "-"}
    assert has_chart(at, "jac_convergence") and has_chart(at, "jac_norms")


def test_evaluate_page(tiny_dir, lens_file):
    at = ok(make_app(model=tiny_dir, lens=lens_file).run())
    at.switch_page("views/evaluate.py").run()
    at.radio(key="eval_source").set_value("paste").run()
    at.text_area(key="eval_paste").set_value(f"{LONG_TEXT}\n\n{LONG_TEXT.upper()}")
    button(at, "Evaluate").click().run()
    curves = chart(ok(at), "eval_curves")
    names = {t["name"] for t in curves["data"]}
    assert names == {"Logit lens", "Jacobian lens"}
    logit_kl = next(t for t in curves["data"] if t["name"] == "Logit lens" and t["xaxis"] == "x")
    assert values(logit_kl["x"]).tolist() == [0, 1, 2, 3] and values(logit_kl["y"])[-1] == 0  # KL 0 at the output
    at.multiselect(key="pak_sets").set_value(["two_hop"])
    at.multiselect(key="pak_k").set_value([1, 10])
    button(at, "Run pass@k").click().run()
    assert has_chart(ok(at), "pak_chart")
    summary = at.dataframe[-2].value
    assert len(summary) == 4 and set(summary["k"]) == {1, 10}
    assert {"ci_low", "ci_high", "items_scored", "words_scored", "n_words"} <= set(summary.columns)
    at.multiselect(key="pak_sets").set_value(["two_hop", "antonym_chain"])
    at.selectbox(key="pak_readout").set_value("last_newline")
    button(at, "Run pass@k").click().run()  # no newline in these prompts: one sentence, no traceback
    assert any("the prompt has no token with a newline" in e.value for e in ok(at).error)
    at.selectbox(key="pak_readout").set_value("set")
    button(at, "Run pass@k").click().run()
    summary = ok(at).dataframe[-2].value
    assert summary["set"].tolist()[-2:] == ["macro mean", "macro mean"]
    # no texts is a message, not a traceback
    at.text_area(key="eval_paste").set_value("   ")
    button(at, "Evaluate").click().run()
    assert any("Paste at least one text" in e.value for e in ok(at).error)


def test_compare_runs_page(tiny_dir, tmp_path):
    at = ok(make_app(model=tiny_dir, lens="none").run())
    at.switch_page("views/compare.py").run()
    at.selectbox(key="cmp_dtype_a").set_value("float32")
    at.selectbox(key="cmp_dtype_b").set_value("float64")
    button(at, "Compare").click().run()
    fig = chart(ok(at), "cmp_chart")
    assert fig["data"][0]["name"] == "max abs error" and len(values(fig["data"][0]["x"])) >= 4
    # float32 against float64 on a 4-layer model: differences near 1e-7, far inside atol 1e-4: a match
    assert not at.warning and len(at.success) == 1
    assert at.success[0].value.startswith("Match: all ") and "within atol 0.0001 / rtol 0.001" in at.success[0].value
    at.radio(key="cmp_how").set_value("load").run()
    at.text_input(key="cmp_a").set_value(str(tmp_path / "nope-a"))
    at.text_input(key="cmp_b").set_value(str(tmp_path / "nope-b"))
    button(at, "Compare").click().run()
    assert any("does not exist" in e.value for e in ok(at).error)


def test_jlens_app_command(capsys):
    from jlens_core.cli.main import main

    assert main(["app", "--print-command", "--server.port", "8999", "--headless", "--", "--theme.base", "dark"]) == 0
    out = capsys.readouterr().out
    words = out.strip().split()
    assert words[1].endswith("app/serve.py") and words[2] == "run" and words[3].endswith("app/main.py")
    assert "--server.port 8999" in out and "--server.headless true" in out and "--theme.base dark" in out


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_jlens_app_stops_its_server_with_it(signum, tmp_path):
    """``kill`` of ``jlens app`` stops the Streamlit server it started: nothing is left serving."""
    import subprocess
    import sys

    from conftest import free_port, serving, wait_serving

    port = free_port()
    env = dict(os.environ, JLENS_RUNS_DIR=str(tmp_path / "runs"), HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "jlens_core", "app", "--headless", "--port", str(port),
                             "--address", "127.0.0.1", "--server.fileWatcherType", "none"],
                            cwd=str(APP.parent.parent), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_serving(url, proc), "the app did not start"
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert children, "jlens app runs the server as its child"
        proc.send_signal(signum)
        assert proc.wait(30) == 128 + signum
        assert not serving(url)
        for pid in children:
            assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_warm_up_fills_the_caches_the_first_inspect_run_reads(tiny_dir, lens_file, monkeypatch):
    import sys

    sys.path.insert(0, str(APP.parent))
    import cache
    from warm_up import warm_up

    from jlens_core.reading import reader as readings_mod

    monkeypatch.setenv("JLENS_APP_MODEL", tiny_dir)
    monkeypatch.setenv("JLENS_APP_LENS", lens_file)
    cache._load_model.clear()  # no model left by earlier tests: the warm-up loads it, and the page must not again
    loads = []
    real_load = cache.load_model
    monkeypatch.setattr(cache, "load_model", lambda *a, **k: loads.append(a[0]) or real_load(*a, **k))
    done = warm_up()
    assert done[0] == f"model {tiny_dir}" and f"lens {Path(lens_file).name}" in done
    assert done[-1] == "logit and jacobian readings of the default prompt"
    computed = []
    real = readings_mod.read_prompts
    monkeypatch.setattr(readings_mod, "read_prompts", lambda *a, **k: computed.append(sorted(a[1])) or real(*a, **k))
    at = ok(make_app().run())  # no URL: the env's model and lens, the default prompt, default settings
    assert len(values(chart(at, "heatmap")["data"][0]["x"])) > 0 and at.radio(key="mode").value == "side"
    assert computed == []  # both readings came from the warm cache
    assert loads == [tiny_dir]  # the sidebar's load hit the warm-up's entry (Streamlit keys calls as passed)
    at.text_area(key="prompt").set_value("A different prompt, read now.").run()
    assert computed == [["jacobian", "logit"]]  # ...and a new prompt is read, both lenses in one pass


def test_reading_store_keeps_readings_per_lens_and_waits_for_one_being_read():
    import sys
    import threading

    sys.path.insert(0, str(APP.parent))
    import cache

    store = cache.ReadingStore(capacity=3)
    calls, release = [], threading.Event()

    def compute(names):
        calls.append(list(names))
        release.wait(10)
        return {name: f"reading of {name}" for name in names}

    out = {}
    first = threading.Thread(target=lambda: out.update(a=store.get({"logit": ("p", "l"), "jac": ("p", "j")}, compute)))
    first.start()
    while not calls:  # the first thread is reading both lenses
        time.sleep(0.01)
    second = threading.Thread(target=lambda: out.update(b=store.get({"jac": ("p", "j")}, compute)))
    second.start()
    time.sleep(0.2)
    assert second.is_alive()  # waits for the reading under way instead of starting its own
    release.set()
    first.join(10), second.join(10)
    assert calls == [["logit", "jac"]]
    assert out == {"a": {"logit": "reading of logit", "jac": "reading of jac"}, "b": {"jac": "reading of jac"}}
    # a failed read stores nothing and is retried by the next request
    with pytest.raises(ValueError, match="bad prompt"):
        store.get({"x": ("q", "l")}, lambda names: (_ for _ in ()).throw(ValueError("bad prompt")))
    assert store.get({"x": ("q", "l")}, compute) == {"x": "reading of x"} and calls[-1] == ["x"]
    # the least recently used reading goes past the capacity: "logit" (read first, never asked for again)
    store.get({"y": ("r", "l")}, compute)
    store.get({"logit": ("p", "l"), "jac": ("p", "j")}, compute)
    assert calls[-1] == ["logit"]


def test_fit_page_experts_and_learn_weights_build_their_commands_under_the_fits_limit(tiny_dir, expert_files,
                                                                                     runs_root, monkeypatch):
    import subprocess
    import sys

    sleeper = subprocess.Popen(["sleep", "120"])  # stands for the launched processes: alive, not a jlens process
    launched: list[tuple[str, list[str]]] = []
    try:
        monkeypatch.setenv("JLENS_APP_MAX_FITS", "1")
        at = ok(make_app(model=tiny_dir, lens="none").run())
        monkeypatch.setattr(sys.modules["jlens_core.fitting.runs"], "_launch",
                            lambda folder, args, command="fit", log="fit.log": launched.append((command, args))
                            or sleeper.pid)
        at.switch_page("views/fit.py").run()
        assert not ok(at).error, [e.value for e in at.error]
        assert at.number_input(key="fit_cluster_prompts").disabled  # no experts: no clustering to set
        at.number_input(key="fit_experts").set_value(2).run()
        at.number_input(key="fit_cluster_prompts").set_value(3).run()
        at.text_input(key="fit_name").set_value("ex").run()
        button(at, "Start fit").click().run()
        command, args = launched[-1]
        assert command == "fit" and args[args.index("--experts"):][:4] == ["--experts", "2", "--cluster-prompts", "3"]
        assert json.loads((runs_root / "ex" / "run.json").read_text())["args"] == args
        # the started fit fills the one place: Start fit and Learn weights wait
        out = finished_fit(runs_root, "x-fit", tiny_dir, expert_files["uniform"], ["--experts", "2"], created=1,
                           settings={"rules": "jacobian", "device": "cpu"})  # a finished `jlens fit --experts` run
        folder = out.parent
        at.run()
        at.selectbox(key="fit_run").set_value("x-fit").run()
        assert any("1 of at most 1 fits at once are running (ex)" in i.value for i in ok(at).info)
        assert button(at, "Start fit").disabled and button(at, "Learn weights").disabled
        monkeypatch.setenv("JLENS_APP_MAX_FITS", "2")
        at.run()
        at.multiselect(key="fit_weigh_sets").set_value(["two_hop"]).run()
        button(at, "Learn weights").click().run()
        command, args = launched[-1]
        weighted = folder / "weighted.safetensors"
        assert command == "weigh" and args == [str(out), "--model", tiny_dir, "--out", str(weighted),
                                               "--sets", "two_hop", "--device", "cpu"]
        # the weight run counts against the limit like a fit: two running of at most two
        assert any("2 of at most 2 fits at once are running (ex, x-fit (weights))" in i.value for i in ok(at).info)
        assert button(at, "Learn weights").disabled and button(at, "Start fit").disabled
        assert any(p.text.startswith("Learning weights") for p in at.get("progress"))
        # done: the weighted lens and its scores are written; it loads into the J++ slot in one click
        weighted.write_bytes(Path(expert_files["jpp"]).read_bytes())
        weighted.with_suffix(".weigh.json").write_text(json.dumps(
            {"macro": {"learned/held-out": {"1": 0.5, "5": 0.75, "10": 1.0}}}))
        info = json.loads((folder / "weigh.json").read_text())
        (folder / "weigh.json").write_text(json.dumps({**info, "pid": None}))
        at.run()
        assert any("Weights learned" in s.value for s in ok(at).success)
        button(at, "Use the weighted lens (J++ lens)").click().run()
        assert ok(at).session_state["jpp_choice"] == "file" and at.session_state["jpp_path"] == str(weighted)
        assert any(c.value.startswith("**J++**") for c in at.sidebar.caption)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_sidebar_placement_fields_check_and_pass_the_placement(tiny_dir, monkeypatch):
    import sys

    from jlens_core.models.loading import placement_settings

    real_load = load_model

    at = ok(make_app(model=tiny_dir, lens="none", prompt=PROMPT).run())
    at.text_input(key="max_memory").set_value("0:lots").run()
    with pytest.raises(ValueError) as bad:
        placement_settings(max_memory="0:lots")
    assert any(str(bad.value) in e.value for e in ok(at).sidebar.error)  # the library's one sentence
    assert any("No model is loaded" in i.value for i in at.info) and not has_chart(at, "heatmap")
    at.text_input(key="max_memory").set_value("").run()
    at.text_input(key="offload_folder").set_value("/etc/offload").run()  # outside the workspace: refused
    assert any("offload folder" in e.value and "workspace" in e.value for e in ok(at).sidebar.error)
    assert not Path("/etc/offload").exists()
    at.text_input(key="offload_folder").set_value("").run()
    cache_module = sys.modules["cache"]  # the app's own module: its loader sees what the sidebar passes
    calls = []
    monkeypatch.setattr(cache_module, "load_model", lambda *a, **kw: calls.append(kw) or real_load(*a, **kw))
    at.text_input(key="device_map").set_value('{"model": "cpu", "lm_head": "cpu"}').run()
    assert not ok(at).sidebar.error and has_chart(at, "heatmap")
    assert calls[-1]["device_map"] == '{"model": "cpu", "lm_head": "cpu"}' and calls[-1]["device"] is None
    assert "cpu" in at.sidebar.caption[0].value and "4 layers" in at.sidebar.caption[0].value


def test_a_reading_file_opens_without_a_model(tiny_dir, tiny_model, lens_file, tmp_path):
    from jlens_core import LogitLens, read_prompts, save_readings

    lenses = {"logit": LogitLens.for_model(tiny_model), "jacobian": JacobianLens.load(lens_file)}
    readings = read_prompts(tiny_model, lenses, PROMPT)
    path = save_readings(tmp_path / "france.jlens.json", readings, model=tiny_model, lenses=lenses)
    # a model that cannot load: asking for it would say so; with a reading file nothing is loaded
    at = ok(make_app(model="no-such-org/no-such-model-xyz", reading=str(path)).run())
    assert at.session_state["_ctx"].model is None and not at.sidebar.error
    assert any("Opened from a reading file: load the model to read new prompts" in i.value for i in at.info)
    assert at.text_area(key="reading_prompt").disabled and at.text_area(key="reading_prompt").value == PROMPT
    assert at.number_input(key="reading_gen").disabled and button(at, "Intervene").disabled
    header = next(m.value for m in at.markdown if m.value.startswith("From `france.jlens.json`"))
    assert tiny_model.name in header and "Jacobian lens: jacobian" in header
    at.radio(key="mode").set_value("jacobian").run()
    trace = chart(ok(at), "heatmap")["data"][0]
    assert np.allclose(values(trace["z"]), readings["jacobian"].grid("top1_prob"), equal_nan=True)
    at.radio(key="mode").set_value("side").run()
    at.selectbox(key="stat").set_value("kl_bits").run()
    top, bottom = (values(t["z"]) for t in chart(ok(at), "heatmap")["data"] if t["type"] == "heatmap")
    assert np.allclose(top, readings["logit"].grid("kl_bits"), equal_nan=True)
    assert np.allclose(bottom, readings["jacobian"].grid("kl_bits"), equal_nan=True)
    # the cell detail: the selected cell's top-k of both lenses, from the file
    select_point(at, "heatmap", x=2, y=1, curve_number=1).run()
    cell = readings["jacobian"].cell(1, 2)
    assert ok(at).session_state["cell_layer"] == 1 and at.session_state["cell_pos"] == 2
    assert cell["top_tokens"][0] in at.dataframe[0].value["top-1"].tolist()
    at.switch_page("views/evaluate.py").run()
    assert any("Opened from a reading file" in i.value for i in ok(at).info)
    # a bad file is ReadingFileError's sentence; closing it loads the model
    bad = tmp_path / "bad.jlens.json"
    bad.write_text(json.dumps({"format": "jlens-reading", "version": 99}))
    at = ok(make_app(model=tiny_dir, reading=str(bad)).run())
    from jlens_core.reading.reading_file import ReadingFileError, load_readings

    with pytest.raises(ReadingFileError) as sentence:
        load_readings(bad)
    assert any(str(sentence.value) in e.value for e in at.sidebar.error) and at.session_state["_ctx"].model is None
    button(at, "Close it and load the model").click().run()
    assert ok(at).session_state["_ctx"].model is not None and has_chart(at, "heatmap") and "reading" not in at.query_params


def test_lens_describe_says_combined_only_for_a_combination_of_experts(llama):
    """The sidebar line (lens.describe(), which app/lens_slots.py shows): a pooled lens of an expert fit reads as a
    plain lens; the one-matrix combination says how many experts it combines."""
    experts = fit(llama, [LONG_TEXT, LONG_TEXT.upper(), LONG_TEXT.lower()], experts=2, cluster_prompts=3,
                  skip_first=2, max_seq_len=32)
    pooled = experts.pooled_lens().describe()
    assert "experts" not in pooled and pooled.startswith("3 prompts") and "max_seq_len 32" in pooled
    assert "2 experts, uniform weights, combined into one matrix" in experts.to_jacobian_lens().describe()
    assert "2 experts, uniform weights" in experts.describe()
    assert "shrinkage 0.25" in experts.pooled_lens().with_shrinkage(0.25).describe()
