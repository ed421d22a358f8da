"""The app's stability marks (docs/method.md §6.2) and lens check banner (§4.2), under ``AppTest``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import random_lens
from streamlit.testing.v1 import AppTest
from test_app import hold_extras, rerun_until

from jlens_core import JacobianLens, LogitLens, read_prompts, save_readings

APP = Path(__file__).resolve().parent.parent / "app" / "main.py"
PROMPT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def bare_file(tiny_model, tmp_path_factory) -> str:
    """A lens without split halves (built by hand, like a file fitted before halves existed)."""
    return str(random_lens(tiny_model).save(tmp_path_factory.mktemp("bare") / "bare.safetensors"))


@pytest.fixture(autouse=True)
def workspace(tmp_path, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("JLENS_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("JLENS_APP_WORKSPACE", str(tmp_path_factory.getbasetemp()))
    monkeypatch.delenv("JLENS_APP_ALLOW_ANY_PATH", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def make_app(**query) -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=180)
    at.query_params.update(query)
    return at


def ok(at: AppTest) -> AppTest:
    assert not at.exception, [e.value for e in at.exception]
    return at


def heatmap(at: AppTest) -> dict:
    found = [c for c in at.get("plotly_chart") if c.proto.id.endswith("-heatmap")]
    return json.loads(found[0].proto.spec)


def with_marks(at: AppTest) -> AppTest:
    return rerun_until(at, lambda a: any(t.get("name") == "stable %" for t in heatmap(a)["data"]), "stability marks",
                       tries=120)


def test_stability_toggle_on_a_lens_with_halves(tiny_dir, tiny_model, lens_file, monkeypatch):
    release = hold_extras(monkeypatch)  # the first paint is seen without the marks
    at = ok(make_app(model=tiny_dir, lens=lens_file, prompt=PROMPT, mode="jacobian").run())
    assert at.toggle(key="stability").value is True  # a fit keeps its halves: on by default
    assert "stability" not in at.query_params
    # first paint: the plain heatmap, the marks computed in a thread and announced, not waited for
    assert not [t for t in heatmap(at)["data"] if t.get("name") == "stable %"]
    assert any("stability marks: computing" in c.value for c in at.caption)
    release.set()
    data = heatmap(with_marks(at))["data"]
    assert not any("stability marks: computing" in c.value for c in at.caption)
    reading = read_prompts(tiny_model, {"jacobian": JacobianLens.load(lens_file)}, PROMPT, stability=True)["jacobian"]
    strip = next(t for t in data if t.get("name") == "stable %")
    np.testing.assert_allclose([row[0] for row in strip["z"]], reading.stability_by_layer()["stable_fraction"],
                               equal_nan=True)
    cells = next(t for t in data if str(t.get("name", "")).endswith("cells"))
    assert all("halves: rank" in h for h in cells["hovertext"])
    assert any("halves' ranks" in d.value.columns for d in at.dataframe)  # the cell detail's table
    at.toggle(key="stability").set_value(False).run()
    assert not [t for t in heatmap(ok(at))["data"] if t.get("name") == "stable %"]
    assert at.query_params["stability"] == "0"


def test_stability_toggle_on_a_lens_without_halves(tiny_dir, bare_file):
    lens_file = bare_file
    at = ok(make_app(model=tiny_dir, lens=lens_file, prompt=PROMPT, mode="jacobian").run())
    assert at.toggle(key="stability").value is False  # the lens keeps no halves: off by default
    assert "stability" not in at.query_params
    at.toggle(key="stability").set_value(True).run()
    assert any("keeps no split halves" in c.value for c in ok(at).caption)  # one sentence, no marks
    assert not [t for t in heatmap(at)["data"] if t.get("name") == "stable %"]
    assert at.query_params["stability"] == "1"
    again = ok(make_app(model=tiny_dir, lens=lens_file, prompt=PROMPT, mode="jacobian", stability="1").run())
    assert again.toggle(key="stability").value is True


def test_a_reading_file_with_marks_draws_them(tiny_dir, tiny_model, lens_file, tmp_path):
    lens = JacobianLens.load(lens_file)
    halves = (random_lens(tiny_model, seed=1, noise=0.1), random_lens(tiny_model, seed=2, noise=0.1))
    readings = read_prompts(tiny_model, {"logit": LogitLens.for_model(tiny_model), "jacobian": lens}, PROMPT,
                            halves={"jacobian": halves})
    path = save_readings(tmp_path / "marks.jlens.json", readings, model=tiny_model)
    at = ok(make_app(model="no-such-org/no-such-model-xyz", reading=str(path)).run())
    at.radio(key="mode").set_value("jacobian").run()
    data = heatmap(ok(at))["data"]
    strip = next(t for t in data if t.get("name") == "stable %")
    want = readings["jacobian"].stability_by_layer()["stable_fraction"].to_numpy()
    assert np.allclose([row[0] for row in strip["z"]], want)
    assert any(t.get("legendgroup") == "unstable" and t.get("showlegend") for t in data)


def test_a_lens_whose_canary_disagrees_shows_a_banner(tiny_dir, tiny_model, lens_file, tmp_path):
    import torch
    from conftest import make_hf_model

    from jlens_core import HFLensModel
    from jlens_core.lenses.canary import make_canary

    sys.path.insert(0, str(APP.parent))
    import cache  # the app's module, as its pages import it

    at = ok(make_app(model=tiny_dir, lens=lens_file, prompt=PROMPT).run())
    def own_check():
        return next((check for (key, _), check in cache.check_store()._done.items() if str(lens_file) in key), None)

    rerun_until(at, lambda at: own_check() is not None, "lens check")  # an extra: computed after the first paint
    assert own_check().status == "same"
    assert not [w for w in at.warning if "Lens check failed" in w.value]  # its own model: no banner
    hf = make_hf_model("llama")
    with torch.no_grad():
        hf.model.layers[1].input_layernorm.weight.mul_(1.01)
    changed = HFLensModel(hf, tiny_model.tokenizer, name="changed")
    lens = JacobianLens.load(lens_file)
    lens = lens.replace(canary=make_canary(changed, lens))  # as if fitted on a model that differs from the one loaded
    path = lens.save(tmp_path / "drifted.safetensors")
    at = ok(make_app(model=tiny_dir, lens=str(path), prompt=PROMPT).run())
    rerun_until(at, lambda at: any("Lens check failed" in w.value for w in at.warning), "lens check banner")
    banner = [w.value for w in at.warning if "Lens check failed" in w.value]
    assert banner and "drifted.safetensors" in banner[0] and "layer 1" in banner[0]
