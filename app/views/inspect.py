"""Inspect: read a prompt through the logit and the Jacobian lens, at every layer x position.

:func:`render` draws the page, one function per section, top to bottom: the prompt and its
continuation, the lens and statistic controls, the display options, the heatmap, the most common
tokens, the cell detail, the Intervene panel and the downloads.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

import pandas as pd
import streamlit as st

import cache
import common
import intervene
import jspace_panel
from jlens_core.figures.heatmaps import cell_from_point, heatmap_figure, label_cells
from jlens_core.figures.labels import LENS_SHORT, esc, row_labels, shown
from jlens_core.figures.ranks import pinned_ranks_figure
from jlens_core.figures.tokens import topk_bars
from jlens_core.lenses.kinds import BASELINE, PLAIN
from jlens_core.reading.generation import generate
from jlens_core.reading.readout_protocol import Readout
from jlens_core.reading.summaries import most_common_tokens
from jlens_core.reading.tokens import pin_spec, token_id

MAX_TOKENS = common.MAX_TOKENS
MAX_GEN = common.MAX_GEN_TOKENS
GEN_KEEP = 8  # generations kept per session (the last ones)

ss = st.session_state


@dataclass
class View:
    """What this run reads and shows: the text (prompt, then any continuation) and the cells drawn."""

    text: str  # the prompt as the model reads it (chat template applied)
    prompt: str  # the prompt as typed
    generation: Any  # the continuation read with the prompt, or None
    n_prompt_tokens: int
    tokens: list[str]  # display strings of the positions read
    positions: tuple[int, ...]
    layers: list[int]
    band: tuple[int, int]
    pins: list[str]
    pair: tuple[str, str]  # the two lenses of "side by side" and "difference"
    ids: Any = None  # the token ids read, [1, seq] (the J-space labels record their residuals)

    @property
    def source(self) -> str | tuple[int, ...]:
        """What is read: the text, or a generation's token ids."""
        return tuple(int(x) for x in self.generation.ids) if self.generation is not None else self.text

    @property
    def n_prompt(self) -> int | None:
        return self.generation.n_prompt if self.generation is not None else None


class Reader:
    """Reads the view through the loaded lenses (together, cached per lens), each (lens, positions) once a run."""

    def __init__(self, ctx: common.Context, view: View, edits: list | None, edits_key: str) -> None:
        self.ctx, self.view, self.edits, self.edits_key = ctx, view, edits, edits_key
        self.readings: dict[str, Any] = {}
        self._tried: set[tuple[str, tuple[int, ...]]] = set()  # (lens, positions) read or failed this run
        # the stability readings being computed in the background, as (lenses, (text, spec, edits key)) for
        # cache.readings_ready: the page draws the plain readings meanwhile, and reruns once they are there
        self.marks_pending: list[tuple[dict, tuple]] = []

    def read(self, names: list[str], into: dict | None = None, at: tuple[int, ...] | None = None) -> None:
        """Read the loaded lenses among ``names`` at positions ``at`` (default: every shown one) into ``into``."""
        into = self.readings if into is None else into
        at = self.view.positions if at is None else at
        lenses, keys = self.ctx.lenses(), self.ctx.lens_keys()
        todo = [name for name in names if name in lenses and name not in into and (name, at) not in self._tried]
        if not todo:
            return
        self._tried.update((name, at) for name in todo)
        v = self.view
        spec = cache.ReadSpec(Readout(k=int(ss.top_k), vocab=vocab()), tuple(v.pins), bool(ss.show_ws),
                              bool(ss.word_like), tuple(v.layers), at, MAX_TOKENS, v.n_prompt,
                              stability=bool(ss.get("stability")))  # docs/method.md §6.2: lenses with halves
        model, model_key = self.ctx.model, self.ctx.model_key
        # docs/method.md §6.2: only lenses with halves get marks. They are an extra: computed in a thread, the page
        # drawn from the plain readings meanwhile (cached under stability=False), then again with them (the others
        # then read plain too, in one pass: the one-sentence note of a lens without halves shows when none has them)
        with_halves = {n: (lenses[n], keys[n]) for n in todo if common.stability_default([lenses[n]])}
        marks = None
        if spec.stability and with_halves:
            spec = dataclasses.replace(spec, stability=False)
            marks = (v.source, dataclasses.replace(spec, stability=True), self.edits_key)
            found = cache.readings_stored(model_key, with_halves, *marks)
            if found is not None:
                into.update(found)
                todo = [n for n in todo if n not in found]
                marks = None
        if todo:
            self._read_plain(todo, (v.source, spec, self.edits_key, self.edits), into)
        if marks is not None:
            # started once the plain readings are there: the marks' three heads would otherwise share the cores
            # with the plain reading the first paint waits for (a side-by-side redraw took 5.9 s instead of 2.8 s)
            found = cache.readings_soon(model, model_key, with_halves, *marks, self.edits, plain=into)
            if found is not None:
                into.update(found)
            elif not cache.readings_ready(model_key, with_halves, *marks):  # failed: drawn without marks
                self.marks_pending.append((with_halves, marks))

    def _read_plain(self, todo: list[str], settings: tuple, into: dict) -> None:
        lenses, keys, model, model_key = self.ctx.lenses(), self.ctx.lens_keys(), self.ctx.model, self.ctx.model_key
        try:
            into.update(cache.readings_cached(model, model_key, {n: (lenses[n], keys[n]) for n in todo}, *settings))
            return
        except common.EXPECTED_ERRORS:
            pass  # then one lens at a time, to say which cannot read the prompt (the others still can)
        for name in todo:
            try:
                into.update(cache.readings_cached(model, model_key, {name: (lenses[name], keys[name])}, *settings))
            except common.EXPECTED_ERRORS as exc:
                st.error(f"The {common.lens_label(name)} cannot read this prompt: {exc}")

    def everything(self) -> dict:
        """Every loaded lens at every shown position (the download table); cached readings are reused."""
        self.read(list(self.ctx.lenses()))
        return self.readings


def render(ctx: common.Context) -> None:
    """Draw the page for the loaded model and lenses."""
    model = ctx.model
    _init_state(model.n_layers)
    if ss.get("stability") is None:  # on by default when a loaded lens keeps split halves (URL key `stability`)
        ss.stability = stability_default(ctx)
    examples = common.example_prompts()
    has_template = bool(getattr(model.tokenizer, "chat_template", None))
    prompt_inputs(examples, has_template)
    pins, bad_pins = _valid_pins(model)
    pair = lens_controls(ctx, pins)
    prompt, text, full_ids = _encode(model, has_template)
    n_prompt_tokens = int(full_ids.shape[1])  # the prompt alone (a continuation is appended below)
    generation = continuation(ctx, text)
    if generation is not None:
        full_ids = generation.ids[None, :]
    view = display_options(model, prompt, text, full_ids, generation, n_prompt_tokens, pins, pair, bad_pins)
    intervene.init(model, intervene.directions_lens(ctx)[1])
    intervene.apply_link(ctx)
    intervene.run_if_requested(ctx, prompt, text)
    intervene.link_notice(ctx, text)
    edited_view = intervene.heatmap_edits(ctx, text)
    edits, edits_key = edited_view if edited_view else (None, "")
    reader = Reader(ctx, view, edits, edits_key)
    fig, mode = heatmap(view, reader, edits, edits_key)
    most_common_panel(model, view, reader.readings, mode)
    detail, layer, position = cell_detail(view, reader)
    jspace_panel.panel(ctx, full_ids, text, layer, position, layers=view.layers, positions=view.positions,
                       tokens=view.tokens)
    intervene.prefill_token(model, detail, layer, position)
    intervene.panel(ctx, detail, text, view.n_prompt_tokens)
    downloads(reader, fig)


def _init_state(n_layers: int) -> None:
    """Inspect's widgets' defaults, and the layer band (the URL's, clamped to the model's layers)."""
    for key, value in common.INSPECT_DEFAULTS.items():
        ss.setdefault(key, value)
    if not isinstance(ss.get("mode"), str):  # a lens's name is a mode too: lens_controls checks it is loaded
        ss.mode = "logit"
    if "band_request" in ss:  # from the URL, once the model's depth is known
        lo, hi = sorted(max(0, min(int(x), n_layers - 1)) for x in ss.pop("band_request"))
        ss.band = (lo, hi)
    if not isinstance(ss.get("band"), (tuple, list)) or max(ss.band) > n_layers - 1:
        ss.band = (0, n_layers - 1)
    ss.band_is_custom = tuple(ss.band) != (0, n_layers - 1)


def stability_default(ctx: common.Context) -> bool:
    """Whether the Stability toggle starts on: when some loaded lens keeps split halves (docs/method.md §6.2)."""
    return common.stability_default(ctx.lenses().values())


def _request_stop() -> None:
    ss._gen_stop = True


def _pin(spec: str) -> None:
    current = [p for p in (ss.get("pinned") or "").split(",") if p.strip()]
    if spec not in current:
        ss.pinned = ",".join(current + [spec])


def _use_example(examples: list[dict], has_template: bool) -> None:
    for example in examples:
        if example["label"] == ss.get("example"):
            ss.prompt = example["prompt"]
            ss.chat = example["chat"] and has_template
    ss.example = None


def prompt_inputs(examples: list[dict], has_template: bool) -> None:
    """The title, the prompt box, the examples, the chat toggle and the Generate controls."""
    st.title("Inspect a prompt")
    st.caption("What each layer already predicts: the logit lens reads `unembed(h_l)`, the Jacobian lens "
               "`unembed(J_l h_l)`. Hover a cell for its top-k tokens; click it for the detail panel below.")
    left, right = st.columns([4, 1])
    left.text_area("Prompt", key="prompt", height=110, placeholder="Type a prompt…")
    right.selectbox("Examples", [e["label"] for e in examples], index=None, key="example",
                    placeholder="Pick an example…", on_change=_use_example, args=(examples, has_template))
    right.toggle("Chat template", key="chat", disabled=not has_template,
                 help="Wrap the prompt in the model's chat template (instruct models); the reading then starts "
                      "inside the assistant's answer." if has_template else "This tokenizer has no chat template.")
    with st.expander("Generate a continuation", expanded=int(ss.gen_n) > 0):
        g1, g2, g3 = st.columns(3)
        g1.number_input("New tokens", min_value=0, max_value=MAX_GEN, step=1, key="gen_n",
                        help=f"0 reads the prompt alone. 1-{MAX_GEN}: the model writes that many tokens first (it "
                             "stops early at its end-of-sequence token) and the heatmap reads prompt + continuation.")
        g2.number_input("Temperature", min_value=0.0, max_value=2.0, step=0.1, key="gen_temp",
                        help="0 = greedy (the model's top-1 at each step); above 0 samples, reproducibly with the "
                             "seed.")
        g3.number_input("Seed", min_value=0, max_value=2**31 - 1, step=1, key="gen_seed", disabled=not ss.gen_temp,
                        help="The sampling seed (used when the temperature is above 0).")


def _valid_pins(model: Any) -> tuple[list[str], list[str]]:
    """The pinned tokens the tokenizer can read, and the others with the reason (for a warning)."""
    pins, bad_pins = [], []
    for pin in (p for p in (ss.get("pinned") or "").split(",") if p.strip()):
        try:
            token_id(model.tokenizer, pin, rule="first", vocab_size=model.vocab_size)
            pins.append(pin)
        except ValueError as exc:
            bad_pins.append(f"{pin!r} ({exc})")
    return pins, bad_pins


def lens_controls(ctx: common.Context, pins: list[str]) -> tuple[str, str]:
    """The lens mode, the statistic to colour by and, with three lenses or more, which two to compare; returns the pair.

    Every loaded lens is a mode of its own and a choice of the pair (expert lenses and lenses added from files
    by their names); "all" stacks every loaded lens.
    """
    stat_options = list(common.STATS) + [f"rank_{p}" for p in pins]
    if ss.get("stat") not in stat_options:
        ss.stat = "top1_prob"
    available = list(ctx.lenses())
    # the Jacobian lens is always offered (without one, Inspect says so); the other lenses once loaded
    singles = [BASELINE, PLAIN] + [k for k in available if k not in (BASELINE, PLAIN)]
    mode_options = singles + ["side", "diff"] + (["three"] if len(available) >= 3 else [])
    if ss.get("mode_request") in mode_options:  # a lens's name from the URL, now loaded
        ss.mode = ss.pop("mode_request")
    if ss.mode not in mode_options:
        ss.mode = "logit"
    pair = _pick_pair(available, common.default_pair(ctx))

    def mode_label(m: str) -> str:
        if m == "diff":
            return f"Difference ({LENS_SHORT.get(pair[1], pair[1])} − {pair[0]})"
        if m == "three":
            return f"All {dict(enumerate(('', 'one', 'two', 'three', 'four'))).get(len(available), len(available))}"
        return common.MODES.get(m, m)

    c1, c2, c3 = st.columns([3, 2, 1])
    c1.radio("Lens", mode_options, key="mode", format_func=mode_label, horizontal=True)
    c2.selectbox("Colour by", stat_options, key="stat",
                 format_func=lambda s: common.STATS.get(s) or f"Rank of pinned {s[5:]!r}")
    c3.selectbox("Cells show", list(CELL_TEXTS), key="cell_text", format_func=CELL_TEXTS.get,
                 help="Top-1 token: each cell's most probable token under the lens. J-space: each cell's largest "
                      "atom in a lens's J-space (docs/method.md §11.2; the hover lists every atom with its "
                      "coefficient, and the explained fraction beside a random dictionary's). The J-space labels "
                      "are computed after the heatmap is drawn, and written in when ready; the dictionary, k and "
                      "gauge are those of the J-space panel below.")
    if ss.mode in ("side", "diff") and len(available) > 2:
        # the loaded lenses, and a pair member that is not loaded (from the URL: the heatmap says so)
        offered = available + [k for k in pair if k not in available]
        q1, q2, _ = st.columns([1, 1, 3])
        q1.selectbox("Lens A", offered, key="pair_a", format_func=common.lens_label)
        q2.selectbox("Lens B", offered, key="pair_b", format_func=common.lens_label,
                     help="Side by side: A above B. Difference: B − A.")
        pair = (ss.pair_a, ss.pair_b)
    return pair


def _pick_pair(available: list[str], default: tuple[str, str] = ("logit", "jacobian")) -> tuple[str, str]:
    """The two lenses of side by side and difference (``pair_a``, ``pair_b``; kept in the URL's ``pair``).

    By default ``default`` (the logit lens and the model's default reading lens, :func:`common.default_pair`)
    when its second lens is loaded, else the logit lens and the first other lens loaded (J, R, J++, R++,
    tuned, added). A pair member that is not loaded gives way to a loaded lens outside the pair, when there
    is one (else the heatmap says what is missing).
    """
    fitted = [k for k in available if k != BASELINE]
    second = default[1] if default[1] in fitted else (fitted[0] if fitted else PLAIN)
    for key, value in (("pair_a", default[0]), ("pair_b", second)):
        if not isinstance(ss.get(key), str) or not ss.get(key):
            ss[key] = value
    if ss.pair_a == ss.pair_b:
        ss.pair_b = next(k for k in [*available, *common.LENS_KINDS] if k != ss.pair_a)
    for key in ("pair_a", "pair_b"):
        if ss[key] not in available:
            spare = [k for k in available if k not in (ss.pair_a, ss.pair_b)]
            if spare:
                ss[key] = spare[0]
    return ss.pair_a, ss.pair_b


def vocab() -> str:
    """The readout the Display options ask for: ``"word"`` (word tokens only) or ``"all"``."""
    return "word" if ss.get("vocab_word") else "all"


def _encode(model: Any, has_template: bool) -> tuple[str, str, Any]:
    """The prompt, the text the model reads (chat template applied) and its ids; stops the page on bad input."""
    prompt = ss.get("prompt") or ""
    if not prompt.strip():
        st.warning("The prompt is empty: type some text, or pick an example.")
        st.stop()
    try:
        text = model.chat(prompt) if ss.chat and has_template else prompt
        return prompt, text, model.encode(text)
    except ValueError as exc:
        st.error(f"Cannot read this prompt: {exc}")
        st.stop()
        raise  # st.stop() ends the run; this line is never reached


def continuation(ctx: common.Context, text: str) -> Any:
    """The continuation the Generate controls ask for (generated once, kept per session), or ``None``."""
    n_new = int(ss.gen_n)
    if n_new <= 0:
        return None
    temp = float(ss.gen_temp)
    gen_key = (ctx.model_key, text, n_new, temp, int(ss.gen_seed) if temp else None)
    store = ss.setdefault("_generations", {})
    generation = store.get(gen_key)
    partial = ss.get("_gen_partial")
    if generation is None and ss.get("_gen_stop") and partial is not None and partial[0] == gen_key:
        generation = partial[1]  # Stop: keep what was generated
        if generation.n_generated < n_new and generation.stop_reason == "max_new_tokens":
            generation.stop_reason = "stopped"
        store[gen_key] = generation
    ss._gen_stop = False
    if generation is None:
        generation = _generate(ctx.model, text, n_new, temp, gen_key)
        store[gen_key] = generation
        for old in list(store)[:-GEN_KEEP]:
            del store[old]
    how = "greedy" if not temp else f"temperature {temp:g}, seed {int(ss.gen_seed)}"
    ended = {"eos": "it ended its answer", "stopped": "stopped", "max_new_tokens": "the token budget"}
    st.markdown(f"**Continuation** ({generation.n_generated} tokens, {how}; {ended[generation.stop_reason]}): "
                f"`{generation.continuation.strip() or '∅'}`")
    return generation


def _generate(model: Any, text: str, n_new: int, temp: float, gen_key: tuple) -> Any:
    """Generate with a progress bar and a Stop button (the partial generation is kept in the session)."""
    bar = st.progress(0.0, text=f"Generating {n_new} tokens…")
    stop_slot = st.empty()
    stop_slot.button("Stop generating", key="gen_stop", on_click=_request_stop, icon=":material/stop:",
                     help="Keep the tokens generated so far.")

    def progress(p) -> None:
        ss._gen_partial = (gen_key, p.generation)
        bar.progress(p.step / p.total, text=f"Generating… {p.step}/{p.total} tokens: "
                                            f"{p.generation.continuation[-80:]!r}")

    try:
        generation = generate(model, text, max_new_tokens=n_new, temperature=temp,
                              seed=int(ss.gen_seed) if temp else None, progress=progress)
    except common.EXPECTED_ERRORS as exc:
        st.error(f"Cannot generate: {exc}")
        st.stop()
        raise  # st.stop() ends the run; this line is never reached
    bar.empty()
    stop_slot.empty()
    return generation


def display_options(model: Any, prompt: str, text: str, full_ids: Any, generation: Any, n_prompt_tokens: int,
                    pins: list[str], pair: tuple[str, str], bad_pins: list[str]) -> View:
    """The Display options (top-k, pins, layers, positions, token display) and the :class:`View` they give."""
    n_layers = model.n_layers
    n_tokens = min(int(full_ids.shape[1]), MAX_TOKENS)
    tokens = common.token_strings(model, [int(x) for x in full_ids[0, :n_tokens]], ss.show_ws)
    with st.expander("Display options", expanded=False):
        d1, d2, d3 = st.columns(3)
        d1.slider("Top-k tokens", 1, 20, key="top_k")
        d1.text_input("Pin tokens", key="pinned", placeholder=" Paris, Rome",
                      help="Comma-separated; typed as is, so ' Paris' (with its space) is the token after a space. "
                           "Their rank over layers shows in the cell detail; colour by it above.")
        d2.number_input("Layer stride", min_value=1, max_value=max(1, n_layers - 1), step=1, key="stride",
                        help="Show every n-th layer (the model's output row is always shown).")
        if n_layers > 1:
            d1.slider("Layer band", 0, n_layers - 1, key="band",
                      help="Layers the heatmap and the most common tokens cover (the output row is always shown). "
                           "The first layers of a Jacobian lens are often degenerate (it reads every token the "
                           "same way there): start the band above them to see what the middle layers hold.")
        if n_tokens > 1:
            if ss.get("_pos_for") != (text, n_tokens) or "pos_range" not in ss:
                positions = common.default_positions(n_tokens)
                ss.pos_range = (positions[0], positions[-1])
                ss._pos_for = (text, n_tokens)
            d2.slider("Positions", 0, n_tokens - 1, key="pos_range")
        d3.toggle("Whitespace as glyphs", key="show_ws", help="Show spaces as ·, newlines as ↵, tabs as →.")
        d3.toggle("Word tokens only", key="vocab_word",
                  help="The word-token readout (vocab='word'): top-k lists and every rank leave out tokens whose "
                       "text has no letter or digit (punctuation, whitespace, byte pieces, special tokens); "
                       "probabilities, entropy, KL and CE stay over the full vocabulary.")
        d3.toggle("Word-like tokens only", key="word_like",
                  help="A stricter display filter: top-k lists keep word-like tokens only (letters and inner "
                       "apostrophes or hyphens, no digits); ranks are those of the readout above.")
        d3.toggle("Stability", key="stability",
                  help="Mark unstable cells (faded and hatched): the shown token is not top-1 under both of "
                       "the lens's split halves, the lenses fitted on its even and its odd prompts. The hover gives "
                       "each half's rank, the strip right of the heatmap each layer's stable share. Needs a lens "
                       "fitted with halves (docs/method.md §6.2).")
    if bad_pins:
        st.warning("Not pinned: " + "; ".join(bad_pins))
    if int(full_ids.shape[1]) > MAX_TOKENS:
        st.info(f"The prompt has {int(full_ids.shape[1])} tokens; the first {MAX_TOKENS} are read.")
    lo, hi = ss.pos_range if n_tokens > 1 else (0, 0)
    band = (int(ss.band[0]), int(ss.band[1]))
    return View(text=text, prompt=prompt, generation=generation, n_prompt_tokens=n_prompt_tokens, tokens=tokens,
                positions=tuple(range(int(lo), int(hi) + 1)), layers=common.view_layers(n_layers, band, int(ss.stride)),
                band=band, pins=pins, pair=pair, ids=full_ids)


def heatmap(view: View, reader: Reader, edits: list | None, edits_key: str = "") -> tuple[Any, str]:
    """Read the lenses the heatmap draws and draw it; returns the figure and the mode drawn."""
    pair, mode = view.pair, ss.mode
    # The lenses the heatmap draws are read over every shown position (the logit lens always: the output
    # row uses it); the cell detail reads any other loaded lens at the selected position only, below.
    loaded = list(reader.ctx.lenses())
    shown_now = {"side": list(pair), "diff": list(pair), "three": loaded}.get(mode, [mode])
    # A line of text, not a spinner: the spinner's animation, and the page below it moving down and up as
    # it comes and goes, cost the browser CPU the reading needs (a new prompt's redraw took ~0.15 s longer).
    reading_note = st.empty()
    reading_note.caption("Reading the prompt…")
    read_started = time.perf_counter()
    reader.read([BASELINE] + shown_now)
    read_seconds = time.perf_counter() - read_started
    reading_note.caption(f"{len(view.positions)} positions × {len(view.layers)} layers"
                         + (f", read in {read_seconds:.1f} s" if read_seconds >= 0.05 else ""))
    readings = reader.readings
    if BASELINE not in readings:
        st.stop()
    missing = [name for name in shown_now if name not in readings]
    if missing or (mode in ("side", "diff") and pair[0] == pair[1]):
        what = " and ".join(common.lens_label(m) for m in missing) or "second lens"
        st.info(f"No {what} {'are' if len(missing) > 1 else 'is'} loaded, so this shows the logit lens. Pick, fit "
                "or train a lens (sidebar, Fit and Tune pages) to compare.")
        mode = "logit"
    _select_cell(view)
    fig = heatmap_figure(readings, mode, ss.stat, layers=view.layers, pair=pair,
                         selected=(int(ss.cell_layer), int(ss.cell_pos)), stability=bool(ss.stability))
    if ss.stability:
        notes = {readings[n].stability_note for n in shown_now if n in readings and n != BASELINE}
        for note in sorted(n for n in notes if n):
            st.caption(note)
    waits = [lambda: all(cache.readings_ready(reader.ctx.model_key, asked, *marks)
                         for asked, marks in reader.marks_pending)] if reader.marks_pending else []
    coming = ["stability marks: computing…"] if reader.marks_pending else []  # the extras still computing
    if ss.get("cell_text") == "jspace":
        jspace_wait, jspace_note = jspace_labels(reader.ctx, view, fig, mode, edits, edits_key)
        if jspace_wait is not None:
            waits.append(jspace_wait)
            coming.append(jspace_note)
    if waits:
        _await(waits)
        reading_note.caption(f"{len(view.positions)} positions × {len(view.layers)} layers"
                             + (f", read in {read_seconds:.1f} s" if read_seconds >= 0.05 else "")
                             + "".join(f" · {what}" for what in coming))
    if edits:
        fig.update_layout(title=f"Edited run ({'; '.join(repr(e) for e in edits)}) · " + fig.layout.title.text)
    st.plotly_chart(fig, key="heatmap", on_select="rerun", selection_mode="points",
                    config={"displaylogo": False, "toImageButtonOptions": {"filename": "jlens-heatmap"}})
    return fig, mode


MARKS_POLL_SECONDS = 0.5
CELL_TEXTS = {"top-1": "Top-1 token", "jspace": "J-space atom"}  # what the heatmap's cells show (key `cell_text`)


def _await(waits: list) -> None:
    """A rerun of the page as soon as one of the extras computed in the background has news (the stability marks
    are there, more J-space layers are: ``waits``, each a function saying so): the heatmap drawn without them stays
    until then (the reading's caption says what is coming), and the prompt box stays free for the next prompt. One
    extra never waits for another."""

    @st.fragment(run_every=MARKS_POLL_SECONDS)
    def poll() -> None:
        if any(wait() for wait in waits):
            st.rerun(scope="app")

    poll()


def jspace_labels(ctx: common.Context, view: View, fig: Any, mode: str, edits: list | None,
                  edits_key: str) -> tuple[Any, str]:
    """The J-space display mode (docs/method.md §11.2): each cell of the heatmap labelled with its largest atom in a
    lens's J-space, every atom in its hover. An extra: computed in the background layer by layer
    (:func:`cache.jspace_labels_soon`), the layers done so far written into ``fig``. Returns, while layers are still
    coming, the function that says whether more are there and what the caption says of them; else (None, "")."""
    if mode in ("side", "three"):
        st.caption("J-space labels are written on one lens's heatmap (or the difference): pick one lens above.")
        return None, ""
    name = jspace_panel.jspace_lens(ctx, mode)
    if name is None:
        st.caption("No loaded lens has a J-space (it needs a lens with matrices: J, R, J++, R++, the logit lens).")
        return None, ""
    lens = ctx.lenses()[name]
    layers = [layer for layer in view.layers if layer in lens.source_layers]
    if not layers:
        st.caption(f"The {common.lens_label(name)} reads none of the shown layers: no J-space labels (widen the band).")
        return None, ""
    k = min(int(ss.get("js_k") or 25), int(ctx.model.d_model))
    gauge = ss.get("js_gauge") if ss.get("js_gauge") in ("centred", "raw") else "centred"
    spec = cache.JSpaceSpec(k=k, gauge=gauge, positions=tuple(view.positions), edits_key=edits_key,
                            n_prompt=view.n_prompt)
    lens_ref = (lens, ctx.lens_keys()[name])
    found, done = cache.jspace_labels_soon(ctx.model, ctx.model_key, lens_ref, view.source, view.ids[:, :MAX_TOKENS],
                                           layers, spec, edits)
    where = f"the {common.lens_label(name)}'s J-space, k = {k}, {gauge} gauge"
    if done and len(found) < len(layers):
        st.caption(f"The J-space labels ({where}) could not be computed for {len(layers) - len(found)} of the shown "
                   "layers: their cells show the top-1 token (the server's log says why).")
    if found:
        labels = {layer: [cell.atoms[0][0] if cell.atoms else "" for cell in cells] for layer, cells in found.items()}
        hovers = {layer: [_atoms_hover(cell, where) for cell in cells] for layer, cells in found.items()}
        said = f"cells show their largest atom in {where} (output row: top-1)" + (
            "" if done else f", {len(found)} of {len(layers)} layers so far")
        title = str(fig.layout.title.text)
        label_cells(fig, view.layers, labels, hovers, title=title.replace("cells show the top-1 token", said)
                    if "cells show the top-1 token" in title else f"{title} · {said}")
    if done:
        return None, ""

    def more() -> bool:  # or the job stopped for another prompt's (another session's): asking again restarts it
        now, finished = cache.jspace_labels_stored(ctx.model_key, lens_ref, view.source, layers, spec)
        return finished or len(now) > len(found) or not cache.jspace_labels_running(ctx.model_key, lens_ref,
                                                                                     view.source, layers, spec)

    return more, f"J-space labels: computing… ({len(found)} of {len(layers)} layers done)"


def _atoms_hover(cell: cache.CellAtoms, where: str) -> str:
    """A cell's J-space in its hover: the explained fraction beside the random dictionary's, then every atom."""
    atoms = [f"{esc(shown(token))} {coef:.2f}" for token, coef in cell.atoms]
    lines = [", ".join(atoms[i:i + 5]) for i in range(0, len(atoms), 5)]
    return (f"<b>J-space</b> ({esc(where)}): {len(atoms)} atoms explain {cell.explained:.1%} "
            f"(random dictionary {cell.random_explained:.1%})<br>" + "<br>".join(lines))


def _select_cell(view: View) -> None:
    """The selected cell: the heatmap's clicked marker, else the last one kept in view.

    Decided before the figure is built, so that the figure outlines the cell the detail panel shows.
    """
    selection = (ss.get("heatmap") or {}).get("selection") or {}
    points = list(selection.get("points") or [])
    if points:
        signature = json.dumps({k: points[0].get(k) for k in ("x", "y", "curve_number")}, default=str)
        if signature != ss.get("_last_point"):
            ss._last_point = signature
            cell = cell_from_point(points[0], view.layers)
            if cell is not None and cell[1] in view.positions:
                ss.cell_layer, ss.cell_pos = cell
    if ss.get("cell_layer") not in view.layers:
        ss.cell_layer = view.layers[-1]
    if ss.get("cell_pos") not in view.positions:
        ss.cell_pos = view.positions[-1]


def most_common_panel(model: Any, view: View, readings: dict, mode: str) -> None:
    """Each drawn lens's most frequent top-1 tokens over the band, a button per token to pin it."""
    shown_lenses = list(view.pair) if mode in ("side", "diff") else (list(readings) if mode == "three" else [mode])
    band_rows = [layer for layer in view.layers if layer != model.n_layers - 1]
    with st.expander(f"Most common tokens, layers {view.band[0]}–{view.band[1]}", expanded=True):
        st.toggle("Word-like tokens only", key="mc_word_like",
                  help="Count each cell's most probable word-like token instead of its top-1.")
        if not band_rows:
            st.caption("The band holds only the output row: widen it (Display options) to count the layers' top-1 "
                       "tokens.")
            return
        for panel, name in zip(st.columns(len(shown_lenses)), shown_lenses):
            table = most_common_tokens(readings[name], layers=band_rows, word_like=bool(ss.mc_word_like), top_n=10,
                                       vocab=readings[name].vocab)
            panel.markdown(f"**{common.lens_label(name)}**: top-1 most often across {len(view.positions)} positions "
                           f"× {len(band_rows)} layers. Click a token to pin it.")
            if table.empty:
                panel.caption("No word-like token in these cells' top-k.")
                continue
            table["by layer"] = [[row["per_layer"].get(layer, 0) for layer in band_rows]
                                 for _, row in table.iterrows()]
            table["token"] = [shown(token) for token in table["token"]]
            panel.dataframe(table[["token", "count", "n_layers", "by layer"]], hide_index=True, width="stretch",
                            column_config={"token": st.column_config.TextColumn("token"),
                                           "n_layers": st.column_config.NumberColumn("layers"),
                                           "by layer": st.column_config.BarChartColumn(
                                               f"count by layer ({band_rows[0]}…{band_rows[-1]})", y_min=0)})
            pin_cols = panel.columns(5)
            for i, (_, row) in enumerate(table.head(10).iterrows()):
                spec = pin_spec(model.tokenizer, int(row["token_id"]), vocab_size=model.vocab_size)
                pin_cols[i % 5].button(f"{shown(row['token'])}", key=f"mc_pin_{name}_{i}",
                                       on_click=_pin, args=(spec,), help=f"Pin {spec!r} ({row['count']} cells)",
                                       width="stretch")


def cell_detail(view: View, reader: Reader) -> tuple[dict, int, int]:
    """The selected cell through every loaded lens: top-k bars, statistics, pinned ranks.

    The lenses the heatmap does not draw are read at the selected position only (every shown layer): a
    whole reading per lens would compete with the browser drawing the heatmap, for one column of it.
    Returns the readings used (``{lens: reading}``) and the cell (layer, position).
    """
    readings = reader.readings
    detail = dict(readings)
    with st.spinner("Reading the selected position through the other lenses…"):
        reader.read(list(reader.ctx.lenses()), into=detail, at=(int(ss.cell_pos),))
    st.subheader("Cell detail")
    n_layers = reader.ctx.model.n_layers
    labels = dict(zip(view.layers, row_labels(view.layers, n_layers - 1)))
    p1, p2, p3 = st.columns([1, 2, 3])
    p1.selectbox("Layer", view.layers, key="cell_layer", format_func=labels.get)
    p2.selectbox("Position", view.positions, key="cell_pos", format_func=lambda p: f"{p}: {view.tokens[p]}")
    layer, position = int(ss.cell_layer), int(ss.cell_pos)
    cells = {name: (r.cell(layer, position) if layer in r.layers else None) for name, r in detail.items()}
    base = cells[BASELINE]
    final_top1 = readings[BASELINE].final_top1_tokens[readings[BASELINE].position_index(position)]
    p3.markdown(f"Token **`{base['token']}`** at position {position}"
                + (f", next token **`{base['next_token']}`**" if base["next_token"] else "")
                + f"; the model's own top-1 is **`{final_top1}`**.")
    if cells.get(PLAIN) is None and PLAIN in detail:
        st.caption(f"The Jacobian lens was not fitted at layer {layer}.")
    st.plotly_chart(topk_bars({k: v for k, v in cells.items() if v is not None}, k=int(ss.top_k)),
                    key="cell_bars", config={"displaylogo": False})
    st.dataframe(pd.DataFrame([_cell_row(name, cell) for name, cell in cells.items() if cell is not None]),
                 hide_index=True, width="stretch")
    pinned_fig = pinned_ranks_figure(detail, position)
    if pinned_fig is not None:
        st.plotly_chart(pinned_fig, key="pinned_ranks", config={"displaylogo": False})
    elif not view.pins:
        st.caption("Pin tokens (Display options) to follow their rank across layers here.")
    return detail, layer, position


def _cell_row(name: str, cell: dict) -> dict:
    """One lens's row of the cell detail's table."""
    row = {"lens": common.lens_label(name), "top-1": cell["top_tokens"][0], "p(top-1)": cell["top_probs"][0],
           "entropy (bits)": cell["entropy_bits"], "KL to final (bits)": cell["kl_bits"],
           "next-token CE (bits)": cell["ce_bits"], "next-token rank": cell["next_token_rank"],
           "final top-1 rank": cell["final_top1_rank"]}
    row.update({f"rank {k[5:]!r}": v for k, v in cell.items() if k.startswith("rank_")})
    if "half_rank_even" in cell:  # docs/method.md §6.2
        row["halves' ranks"] = f"{cell['half_rank_even']} / {cell['half_rank_odd']}"
        row["stable"] = cell["stable"]
    return row


def downloads(reader: Reader, fig: Any) -> None:
    """The reading as a table (every loaded lens, built when pressed) and the heatmap as HTML."""
    def table_csv() -> str:
        return pd.concat([r.frame.assign(lens=name) for name, r in reader.everything().items()],
                         ignore_index=True).to_csv(index=False)

    b1, b2, _ = st.columns([1, 1, 3])
    b1.download_button("Download table (CSV)", data=table_csv, file_name="jlens-reading.csv",
                       mime="text/csv", on_click="ignore", icon=":material/download:")
    b2.download_button("Download figure (HTML)", data=lambda: fig.to_html(include_plotlyjs=True, full_html=True),
                       file_name="jlens-heatmap.html", mime="text/html", on_click="ignore", icon=":material/download:")


if common.context().reading_file is not None or common.context().reading_error:  # a reading file, no model
    import opened_reading

    opened_reading.render(common.context())
else:
    render(common.require_model())
