"""Fill the caches a first visit reads, before any browser connects (run by ``app/serve.py``)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import common
import launch_snapshot
from cache import ReadSpec, lens_check, load_model_cached, readings_cached
from first_paint import FIRST_READINGS, MODEL_READY
from jlens_core.lenses.kinds import BASELINE
from jlens_core.lenses.lens import LogitLens
from jlens_core.lenses.shipped import default_reading_lens
from jlens_core.models.loading import DEFAULT_MODEL
from jlens_core.reading.readout_protocol import Readout
from lens_slots import FILE, NONE, RUN, SHIPPED, SLOTS, UPLOAD, LensSlot, load_slot_file


def warm_up(spec: str | None = None) -> list[str]:
    """Load what the first Inspect page reads, under the cache keys the pages use.

    Run in a thread of the server process: the model (``JLENS_APP_MODEL`` or the default, device and
    dtype "auto"), the lens each slot starts with (the shipped Jacobian lens, or the file
    ``JLENS_APP_LENS`` names), and the readings of the default prompt with Inspect's default settings
    (:data:`common.INSPECT_DEFAULTS`): plain first (the first heatmap is drawn from the cache), then the lens
    checks (their canaries: :data:`first_paint.FIRST_READINGS` holds a page's check until then), then the
    stability marks of the lenses that keep halves (Inspect draws the plain readings while the marks are
    computed). A URL naming another model, lens or prompt simply computes its own. Returns what it loaded, for
    the log.
    """
    try:
        return _warm_up(spec)
    finally:  # nothing waits for the warm-up any longer (what it did is stored, or will not be)
        MODEL_READY.set()
        FIRST_READINGS.set()


def _warm_up(spec: str | None) -> list[str]:
    spec = spec or os.environ.get(common.ENV_MODEL) or DEFAULT_MODEL
    model = load_model_cached(common.confine_spec(spec, "model folder"), "auto", "auto")
    MODEL_READY.set()
    done = [f"model {spec}"]
    model_key = f"{spec}|auto|auto"
    text = common.default_prompt()
    n_tokens = min(int(model.encode(text).shape[1]), common.MAX_TOKENS)
    layers = tuple(common.view_layers(model.n_layers, (0, model.n_layers - 1), common.INSPECT_DEFAULTS["stride"]))
    readout = Readout(k=common.INSPECT_DEFAULTS["top_k"], vocab="word" if common.INSPECT_DEFAULTS["vocab_word"] else "all")
    plain = ReadSpec(readout, (), common.INSPECT_DEFAULTS["show_ws"], common.INSPECT_DEFAULTS["word_like"], layers,
                     common.default_positions(n_tokens), common.MAX_TOKENS, None)
    # Inspect opens side by side (the logit lens and the lens files' first): their plain readings first (the first
    # heatmap), then the lens checks (canaries) and the stability marks (extras Inspect adds when there)
    lenses = {BASELINE: (LogitLens.for_model(model), BASELINE)}
    for slot in SLOTS:
        path = starting_path(slot, model, spec)
        if path is not None and path.is_file():
            loaded = load_slot_file(slot, path, path.name, model, check=False)  # checked below
            lenses[slot.key] = (loaded.lens, loaded.key)
            done.append(f"lens {path.name}")
    drawn = readings_cached(model, model_key, lenses, text, plain)
    FIRST_READINGS.set()
    pair = (BASELINE, default_reading_lens(str(model.name)))  # Inspect's first view, side by side
    if pair[1] in drawn:  # the next launch draws these while its model loads
        launch_snapshot.save(drawn, model, pair)
    files = {name: value for name, value in lenses.items() if name != BASELINE}
    for lens, key in files.values():
        lens_check(key, model, lens)
    with_halves = {name: value for name, value in files.items() if common.stability_default([value[0]])}
    if with_halves:  # only the marks: the plain readings are reused (read_prompts' reuse)
        readings_cached(model, model_key, with_halves, text, dataclasses.replace(plain, stability=True), plain=drawn)
    done.append(f"{' and '.join(lenses)} readings of the default prompt")
    return done


def starting_path(slot: LensSlot, model: Any, spec: str) -> Path | None:
    """The file ``slot`` starts with when the URL names none (its environment variable, else its default)."""
    request = (os.environ.get(slot.env) if slot.env else None) or "auto"
    if request == "auto":
        request = slot.default_for(model)
    if request == SHIPPED:
        return next((s.path for s in slot.sources(model, spec) if s.choice == SHIPPED), None)
    if request in (NONE, FILE, UPLOAD) or request.startswith((RUN, "hf://")):
        return None  # nothing to warm, or a fetch better left to the page (it shows its progress)
    return common.confine(request, slot.path_what)
