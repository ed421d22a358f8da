"""The first heatmap of a launch, drawn while the model loads: the default view's readings, kept by the last launch.

At a launch on the embedded default model the server's warm-up imports torch and transformers and loads the model,
about 6 s of one core on a 2-core CPU, before any prompt can be read (docs/app.md, "Launch"). The default view's
plain readings do not change between launches while the model file, the lens files, the prompt, the settings and
the versions stay the same: the warm-up keeps them in the cache folder (:func:`save`), and a session's first run
that finds the model still loading draws them (:func:`draw_while_loading`), says so, and runs again as the live
page once the model is there. Anything that differs (a URL with parameters, another model or lens in the
environment, an edited file, other versions) means no snapshot: the page waits for the model, as before.

Off unless ``JLENS_APP_SNAPSHOT=1``: the live page then lays itself out anew (its controls above the heatmap, which
moves down and is gone for a moment while it is redrawn), a jump the first paint should not have.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import types
from importlib import metadata
from pathlib import Path
from typing import Any

import streamlit as st

import common
from first_paint import MODEL_READY
from jlens_core.lenses.kinds import BASELINE
from jlens_core.models.loading import DEFAULT_MODEL, cache_dir, default_gguf_path

log = logging.getLogger(__name__)
ENV_ON = "JLENS_APP_SNAPSHOT"  # "1" turns it on
LOAD_WAIT_SECONDS = 180.0  # the longest a first run waits for the model beside the snapshot (then it runs anyway)
PACKAGES = ("jacobian-lens", "torch", "transformers", "plotly")


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def _file_state(path: Path) -> list[Any]:
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def identity() -> dict[str, Any] | None:
    """What the default view's readings depend on, read without the model (the model file, the lens files each
    slot starts with, the prompt, Inspect's defaults, the versions), or None when no snapshot applies."""
    from lens_slots import SLOTS
    from warm_up import starting_path

    spec = os.environ.get(common.ENV_MODEL) or DEFAULT_MODEL
    if os.environ.get(ENV_ON) != "1" or spec != DEFAULT_MODEL:
        return None
    named = types.SimpleNamespace(name=DEFAULT_MODEL)  # a slot's starting file depends on the model's name alone
    try:
        lenses = {slot.key: starting_path(slot, named, spec) for slot in SLOTS}
        files = {key: _file_state(path) for key, path in lenses.items() if path is not None and path.is_file()}
        model_file = _file_state(default_gguf_path())
    except (OSError, ValueError, AttributeError):
        return None
    return {"model": model_file, "lenses": files, "prompt": common.default_prompt(),
            "defaults": {key: common.INSPECT_DEFAULTS[key] for key in sorted(common.INSPECT_DEFAULTS)},
            "max_tokens": common.MAX_TOKENS, "versions": {p: _version(p) for p in PACKAGES}}


def _paths(ident: dict[str, Any]) -> tuple[Path, Path]:
    key = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]
    folder = cache_dir() / "app"
    return folder / f"first-heatmap-{key}.jlens.json", folder / f"first-heatmap-{key}.json"


def save(readings: dict[str, Any], model: Any, pair: tuple[str, str]) -> Path | None:
    """Keep the default view's plain ``readings`` (``{name: PromptReading}``, ``pair`` the two drawn side by side)
    for the next launch, unless one is kept for this identity already; returns the file, or None."""
    ident = identity()
    if ident is None or set(pair) - set(readings) or set(readings) - {BASELINE} - set(ident["lenses"]):
        return None
    path, meta = _paths(ident)
    if path.is_file() and meta.is_file():
        return path
    from jlens_core.reading.reading_file import save_readings

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for old in path.parent.glob("first-heatmap-*"):  # another identity's: never drawn again
            old.unlink(missing_ok=True)
        save_readings(path, {name: readings[name] for name in pair}, model=model)
        meta.write_text(json.dumps({"identity": ident, "pair": list(pair)}, default=str))
    except OSError:  # a read-only cache: no snapshot, nothing else changes
        log.info("Could not keep the first heatmap's readings in %s.", path.parent, exc_info=True)
        return None
    return path


def load() -> tuple[dict[str, Any], tuple[str, str]] | None:
    """The kept readings and their pair when they are this launch's default view's (same identity), else None."""
    ident = identity()
    if ident is None:
        return None
    path, meta = _paths(ident)
    try:
        kept = json.loads(meta.read_text())
        if kept.get("identity") != json.loads(json.dumps(ident, default=str)):
            return None
        from jlens_core.reading.reading_file import load_readings

        readings = load_readings(path).readings
        pair = (str(kept["pair"][0]), str(kept["pair"][1]))
    except (OSError, ValueError, KeyError, IndexError):  # none kept yet, or not readable: the page waits
        return None
    return (readings, pair) if set(pair) <= set(readings) else None


def draw_while_loading(page: Any) -> bool:
    """On a session's first run of Inspect with a plain URL while the server's warm-up still loads the model: draw
    the kept side-by-side heatmap, wait for the model, and return True (the caller reruns as the live page)."""
    if MODEL_READY.is_set() or st.query_params.to_dict() or getattr(page, "url_path", "") not in ("", "inspect") \
            or st.session_state.get("_snapshot_drawn"):
        return False
    found = load()
    if found is None:
        return False
    st.session_state._snapshot_drawn = True
    readings, pair = found
    from jlens_core.figures.heatmaps import heatmap_figure

    base = readings[pair[0]]
    layers, positions = list(base.layers), [int(p) for p in base.positions]
    st.sidebar.info("Loading the model…", icon=":material/hourglass_top:")
    st.caption("Loading the model: this is the default prompt's reading from the last launch (same model file, "
               "lens files and versions). The page becomes live in a few seconds.")
    fig = heatmap_figure(readings, "side", "top1_prob", layers=layers, pair=pair, selected=(layers[-1], positions[-1]),
                         stability=False)
    st.plotly_chart(fig, key="heatmap", config={"displaylogo": False})
    MODEL_READY.wait(LOAD_WAIT_SECONDS)
    return True
