"""The app's Study page (docs/app.md) under AppTest, on the tiny model: the figure holds one line per lens with
the fractions :func:`study` computes, the band, the unscored concepts, the URL, the refusal of a path outside the
workspace, the no-answer sentence, and an item opened in Inspect with its concept pinned."""

from __future__ import annotations

import json
from urllib.parse import parse_qs, urlparse

import numpy as np
import test_app
from test_app import button, chart, make_app, ok, values

from jlens_core import JacobianLens, LogitLens
from jlens_core.evaluation.study import study

runs_root = test_app.runs_root  # its fixture (tiny_model and lens_file come from conftest)
ITEMS = [{"name": "france", "prompt": "The capital of France is", "intermediates": ["capital", "Paris"]},
         {"name": "story", "prompt": "Once upon a time there was a", "intermediates": ["time"]},
         {"name": "water", "prompt": "Water boils at one", "intermediates": ["capital"]}]


def params(at) -> dict:
    return {k: (v[0] if isinstance(v, list) else v) for k, v in at.query_params.items()}


def test_study_page_lines_band_items_and_open_in_inspect(tiny_dir, tiny_model, lens_file, tmp_path):
    path = tmp_path / "mine.jsonl"  # inside the workspace (the tests' temporary folder)
    path.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    at = ok(make_app(model=tiny_dir, lens=lens_file).run())
    at.switch_page("views/study.py").run()
    at.multiselect(key="st_sets").set_value([])
    at.text_input(key="st_path").set_value(str(path))
    at.number_input(key="st_k").set_value(40)
    at.checkbox(key="st_filter").set_value(False)
    button(ok(at), "Run study").click().run()
    spec = chart(ok(at), "study_fig")
    lines = [t for t in spec["data"] if t.get("mode") == "lines+markers"]
    assert [t["name"] for t in lines] == ["Logit lens", "Jacobian lens"]
    direct = study(tiny_model, {"logit": LogitLens.for_model(tiny_model), "jacobian": JacobianLens.load(lens_file)},
                   {"mine": ITEMS}, k=40, answered_only=False)
    for trace, lens in zip(lines, ["logit", "jacobian"]):
        assert np.allclose(values(trace["y"]), direct.curve("mine", lens)["fraction"])
    bands = [direct.band("mine", lens) for lens in ["logit", "jacobian"]]
    rects = [s for s in spec["layout"].get("shapes", []) if s["type"] == "rect"]
    assert len(rects) == 2 * sum(b is not None for b in bands)
    assert any("Paris" in c.value for c in at.caption)  # unscored: listed, not dropped silently
    assert params(at)["set_path"] == str(path) and params(at)["k"] == "40" and params(at)["filter"] == "0"
    at.selectbox(key="st_item").set_value("story · time").run()
    link = next(b for b in ok(at).get("link_button") if b.proto.label == "Open in Inspect")
    query = {k: v[0] for k, v in parse_qs(urlparse(link.proto.url).query).items()}
    assert query["prompt"] == ITEMS[1]["prompt"] and query["pin"] == " time" and query["model"] == tiny_dir
    assert "set_path" not in query  # the Study page's own settings stay behind
    inspect = ok(make_app(**query).run())  # the link opens Inspect from its URL, as a shared view
    assert inspect.text_input(key="pinned").value == " time" and inspect.session_state["prompt"] == ITEMS[1]["prompt"]
    assert "Rank of pinned ' time'" in inspect.selectbox(key="stat").options  # the pin is read: its rank can colour the map


def test_study_page_refusals_and_url(tiny_dir, lens_file, tmp_path):
    at = ok(make_app(model=tiny_dir, lens=lens_file, sets="two_hop,antonym_chain", k="5", n="3", filter="0").run())
    at.switch_page("views/study.py").run()
    assert ok(at).multiselect(key="st_sets").value == ["two_hop", "antonym_chain"]
    assert (at.number_input(key="st_k").value, at.number_input(key="st_n").value) == (5, 3)
    assert at.checkbox(key="st_filter").value is False
    at.text_input(key="st_path").set_value("/etc/passwd")
    button(at, "Run study").click().run()
    assert any("outside the workspace" in e.value for e in ok(at).error)
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"prompt": "The capital of France is", "intermediates": ["capital"],
                                 "answer": "zzzz"}) + "\n")
    at.multiselect(key="st_sets").set_value([])
    at.text_input(key="st_path").set_value(str(wrong))
    at.checkbox(key="st_filter").set_value(True)
    button(at, "Run study").click().run()
    assert any("No item is left after the capability filter" in e.value for e in ok(at).error)
