"""The Inspect page's Intervene panel: steer / ablate / swap along a lens's read directions.

The edits are built from the panel's widget values (session state) *before* the heatmap is drawn,
so that "heatmap of the edited run" shows the edit just run. Every number comes from
``jlens_core.interventions``; this module only gathers settings and draws.
"""

from __future__ import annotations

from typing import Any

import streamlit as st

import cache
import common
import say_box
from jlens_core.experiments.links import HeldRef
from jlens_core.figures.interventions import comparison_figure
from jlens_core.interventions import Ablate, Steer, Swap
from jlens_core.interventions.compare import compare_runs
from jlens_core.interventions.read_directions import default_layers
from jlens_core.lenses.kinds import BASELINE, KINDS, is_trained
from jlens_core.reading.tokens import TokenDisplay, is_word_like

OPS = {"swap": "Swap A → B", "steer": "Steer toward a token", "ablate": "Ablate a token"}
POSITION_MODES = {"all": "all but the first", "from": "from the clicked one", "range": "a range"}
VOCAB_OPTIONS = 8000  # word-like tokens offered by the replacement's autocomplete (the most frequent merges)

ss = st.session_state


def init(model: Any, lens: Any) -> None:
    band = default_layers(model, lens)
    for key, value in (("iv_op", "swap"), ("iv_token", ""), ("iv_replacement", None), ("iv_strength", 1.0),
                       ("iv_alpha", 1.0), ("iv_pos_mode", "all"), ("iv_on_generated", False), ("iv_new", 20),
                       ("iv_edited_heatmap", False), ("iv_centred", False)):
        ss.setdefault(key, value)
    readable = [x for x in lens.layers if x != lens.target_layer]  # another lens may read fewer layers
    if not isinstance(ss.get("iv_layers"), (tuple, list)) or max(ss.iv_layers) >= model.n_layers - 1 \
            or min(ss.iv_layers) < readable[0] or max(ss.iv_layers) > readable[-1]:
        ss.iv_layers = (band[0], band[-1])


# lenses with read directions, in order of preference: the plain fitted kinds (J, R), then the logit lens
DIRECTION_LENSES = (*(k.kind for k in KINDS if k.fitted and not k.experts), BASELINE)


def has_directions(lens: Any) -> bool:
    """Whether an edit can use ``lens``'s read directions: a linear lens (logit, J, R, an expert lens: one matrix
    per layer); a tuned lens has none (it is affine)."""
    return not is_trained(lens) and callable(getattr(lens, "matrix", None))


def direction_choices(ctx: Any) -> list[str]:
    """The loaded lenses whose read directions an edit can use: J, R, then the expert and added lenses, then logit."""
    lenses = ctx.lenses()
    others = [name for name, lens in lenses.items() if name not in DIRECTION_LENSES and has_directions(lens)]
    return [name for name in DIRECTION_LENSES[:-1] if name in lenses] + others + [BASELINE]


def directions_lens(ctx: Any) -> tuple[str, Any]:
    """The lens whose read directions the edits use: the panel's pick (``iv_lens``), else the Jacobian lens,
    else the R-lens, else the first expert or added lens, else the logit lens."""
    lenses, choices = ctx.lenses(), direction_choices(ctx)
    name = ss.get("iv_lens") if ss.get("iv_lens") in choices else choices[0]
    return name, lenses[name]


def prefill_token(model: Any, readings: dict, layer: int, position: int) -> None:
    """The token box takes the clicked cell's top-1 (once per clicked cell)."""
    if ss.get("_iv_prefill_for") == (layer, position):
        return
    ss._iv_prefill_for = (layer, position)
    if ss.pop("_iv_keep_token", False):  # a link's edit set the token: the first cell shown does not replace it
        return
    reading = next((readings[name] for name in DIRECTION_LENSES[:-1] if readings.get(name) is not None),
                   readings[BASELINE])
    if layer in reading.layers:
        ss.iv_token = model.decode([reading.cell(layer, position)["top_ids"][0]])


def _positions(n_prompt: int) -> list[int] | None:
    mode = ss.iv_pos_mode
    if mode == "from":
        start = min(int(ss.get("cell_pos") or 1), n_prompt - 1)
        return list(range(max(0, start), n_prompt))
    if mode == "range":
        lo, hi = ss.get("iv_pos_range") or (1, n_prompt - 1)
        return list(range(int(lo), min(int(hi), n_prompt - 1) + 1))
    return None


def build_edits(model: Any, lens: Any, n_prompt: int) -> list:
    """The edit the panel describes (raises ``ValueError`` with one sentence on bad input)."""
    lo, hi = (int(x) for x in ss.iv_layers)
    layers = list(range(lo, hi + 1))
    common_kw = {"layers": layers, "positions": _positions(n_prompt), "on_generated": bool(ss.iv_on_generated),
                 "centred": bool(ss.iv_centred)}
    trial = ss.get("iv_trial")
    if trial:  # a trial opened from the Experiments page: its own edits, as it ran them
        return list(trial["edits"])
    token = ss.iv_token or ""
    if not token.strip():
        raise ValueError("The token is empty: click a cell (its top-1 is filled in) or type one.")
    if ss.iv_op == "swap":
        replacement = ss.get("iv_replacement") or ""
        if not replacement.strip():
            raise ValueError("The replacement is empty: type the token to swap in.")
        return [Swap(model, lens, token, replacement, float(ss.iv_alpha), **common_kw)]
    if ss.iv_op == "steer":
        return [Steer(model, lens, token, float(ss.iv_strength), **common_kw)]
    return [Ablate(model, lens, token, **common_kw)]


def apply_link(ctx: Any) -> None:
    """An edit opened from a link (an experiment's trial; ``url_state`` parsed its keys): checked against the
    loaded model and lens, then set into the panel and run once, the heatmap reading the edited run. A bad value
    leaves the panel and the heatmap clean, with one sentence (:func:`link_notice`)."""
    request = ss.pop("edit_request", None)
    if request is None:
        return
    if isinstance(request, str):
        ss.edit_link = {"error": request}
        return
    if isinstance(request, HeldRef):
        try:
            held = cache.held_trials().get(request, ctx.model_key)
        except ValueError as exc:
            ss.edit_link = {"error": f"The link's edit cannot be applied: {exc}"}
            return
        ss.update(iv_trial={"token": held.token, "edits": held.edits, "label": held.label},
                  iv_edited_heatmap=True, iv_on_generated=False)
        request_run()
        ss.edit_link = {"edit": held.label}
        return
    ss.iv_trial = None
    choices = direction_choices(ctx)
    if request.lens not in choices:
        ss.edit_link = {"error": f"The link's lens {request.lens!r} is not loaded here (loaded: "
                                 f"{', '.join(choices)}): load it, then open the link again."}
        return
    try:
        request.build(ctx.model, ctx.lenses()[request.lens])  # checks the tokens and the band before any change
    except common.EXPECTED_ERRORS as exc:
        ss.edit_link = {"error": f"The link's edit cannot be applied: {exc}"}
        return
    ss.update(iv_lens=request.lens, iv_op="swap", iv_token=request.source, iv_replacement=request.replacement,
              iv_alpha=float(request.alpha), iv_layers=tuple(request.layers), iv_pos_mode="all",
              iv_on_generated=False, iv_centred=False, iv_edited_heatmap=True, _iv_keep_token=True)
    request_run()
    ss.edit_link = {"edit": str(request)}


def link_notice(ctx: Any, chat_text: str) -> None:
    """Which edit a link applied (while the heatmap still reads it), or why it was not applied."""
    link = ss.get("edit_link")
    if not link:
        return
    if "error" in link:
        st.error(link["error"])
        ss.edit_link = None
    elif heatmap_edits(ctx, chat_text) is not None:
        st.info(f"Opened with an edit applied: {link['edit']}. The heatmap reads the edited run; switch off "
                "'Heatmap of the edited run' in the Intervene panel below for the clean reading (the panel also "
                "compares the clean and the edited continuations).", icon=":material/science:")
    else:
        ss.edit_link = None


def settings_key(model_key: str, lens_key: str, text: str) -> tuple:
    return (model_key, lens_key, text, ss.iv_op, ss.iv_token, ss.get("iv_replacement"), float(ss.iv_strength),
            float(ss.iv_alpha), tuple(ss.iv_layers), ss.iv_pos_mode, tuple(ss.get("iv_pos_range") or ()),
            int(ss.get("cell_pos") or 0) if ss.iv_pos_mode == "from" else None, bool(ss.iv_on_generated),
            int(ss.iv_new), bool(ss.iv_centred), (ss.get("iv_trial") or {}).get("token"))


def request_run() -> None:
    ss._iv_requested = True


def run_if_requested(ctx: Any, text: str, chat_text: str) -> None:
    """Run the clean and edited continuations when *Run* was clicked; keep the result in the session."""
    if not ss.pop("_iv_requested", False):
        return
    model = ctx.model
    name, lens = directions_lens(ctx)
    key = settings_key(ctx.model_key, ctx.lens_keys()[name], chat_text)
    try:
        n_prompt = int(model.encode(chat_text).shape[1])
        edits = build_edits(model, lens, n_prompt)
        with st.spinner("Running the clean and the edited model…"):
            result = compare_runs(model, chat_text, edits, max_new_tokens=int(ss.iv_new), top_k=10)
    except common.EXPECTED_ERRORS as exc:
        ss.iv_result = {"key": key, "error": str(exc)}
        return
    ss.iv_result = {"key": key, "edits": edits, "result": result, "lens": name}


def current(ctx: Any, chat_text: str) -> dict | None:
    """The stored result when it matches the panel's settings (else ``None``: settings changed)."""
    result = ss.get("iv_result")
    if not result:
        return None
    name, _ = directions_lens(ctx)
    return result if result["key"] == settings_key(ctx.model_key, ctx.lens_keys()[name], chat_text) else None


@st.cache_data(show_spinner=False, max_entries=4)
def vocabulary_words(_model: Any, model_key: str) -> list[str]:
    """Word-like tokens with a leading space (the first ``VOCAB_OPTIONS`` by id), for the autocomplete."""
    display = TokenDisplay.for_model(_model)
    words = [t for t in display.texts if t.startswith(" ") and is_word_like(t)]
    return words[:VOCAB_OPTIONS]


def _escape_md(text: str) -> str:
    special = "\\`*_{}[]()#+-.!|~<>$:"
    return "".join("\\" + ch if ch in special else ch for ch in text)


def marked_continuation(model: Any, ids, first_difference: int | None) -> str:
    """Markdown of a continuation with the first differing token highlighted."""
    parts = []
    for i, tid in enumerate(ids):
        piece = model.decode([int(tid)]).replace("\n", "↵")
        if i == first_difference:  # Markdown bold needs the spaces outside the markers
            core = piece.strip() or "·"
            lead = piece[: len(piece) - len(piece.lstrip())]
            parts.append(f"{lead}:orange-background[**{_escape_md(core)}**]")
        else:
            parts.append(_escape_md(piece))
    return "".join(parts) or "∅"


def _lower(label: str) -> str:
    """``"Jacobian lens"`` -> ``"jacobian lens"``; a name with capitals inside (``"J++"``, ``"R-lens"``) stays."""
    return label[0].lower() + label[1:] if label[1:2].islower() else label


def panel(ctx: Any, readings: dict, chat_text: str, n_prompt: int) -> None:
    """The Intervene panel: settings, Run, and the clean-vs-edited comparison."""
    model = ctx.model
    name, lens = directions_lens(ctx)
    st.subheader("Intervene")
    st.caption(f"Edit the residual stream along the directions the {_lower(common.lens_label(name))} reads as "
               "tokens, and see whether the model follows. Swap exchanges the read coordinates of A and B "
               "(targets from the clean run); steer adds s·‖h‖ along a token's direction; ablate removes it.")
    if ss.get("iv_trial"):
        trial_panel(ctx, chat_text)
        return
    c1, c2, c3 = st.columns([2, 2, 2])
    choices = direction_choices(ctx)
    if len(choices) > 2:  # a Jacobian lens and an R-lens: which one's directions
        ss.iv_lens = name
        c1.selectbox("Directions of", choices, key="iv_lens", format_func=common.lens_label,
                     help="The lens whose read directions the edit uses.")
    c1.radio("Operation", list(OPS), key="iv_op", format_func=OPS.get, horizontal=False)
    c2.text_input("Token" if ss.iv_op != "swap" else "A (the concept to replace)", key="iv_token",
                  help="One vocabulary token: filled in from the clicked cell's top-1; a bare word means its "
                       "leading-space form (' France').")
    if ss.iv_op == "swap":
        c3.selectbox("B (the replacement)", vocabulary_words(model, ctx.model_key), key="iv_replacement",
                     index=None, accept_new_options=True, placeholder="Type a word…",
                     help="Pick or type one vocabulary token.")
        c3.number_input("α (1 exchanges the coordinates)", min_value=0.0, max_value=16.0, step=0.5, key="iv_alpha")
    elif ss.iv_op == "steer":
        c3.slider("Strength s", -4.0, 4.0, step=0.25, key="iv_strength", help="h ← h + s‖h‖ v̂")
    d1, d2, d3 = st.columns([3, 2, 2])
    readable = [x for x in lens.layers if x != lens.target_layer]
    d1.slider("Layers", readable[0], readable[-1], key="iv_layers",
              help="Decoder layers whose output is edited (default: n_layers // 3 to the lens's last source layer).")
    d2.radio("Positions", list(POSITION_MODES), key="iv_pos_mode", format_func=POSITION_MODES.get)
    if ss.iv_pos_mode == "range" and n_prompt > 2:
        if not isinstance(ss.get("iv_pos_range"), (tuple, list)) or max(ss.iv_pos_range) > n_prompt - 1:
            ss.iv_pos_range = (1, n_prompt - 1)
        d2.slider("Prompt positions", 0, n_prompt - 1, key="iv_pos_range")
    d3.number_input("New tokens", min_value=1, max_value=common.MAX_GEN_TOKENS, step=1, key="iv_new")
    d3.toggle("Also on generated tokens", key="iv_on_generated")
    st.checkbox("Centred directions (minus the vocabulary mean; readings unchanged, edits differ)", key="iv_centred",
                help="Each read direction minus the mean read direction over the vocabulary at that layer: every "
                     "logit shifts by the same amount, so readings do not change, but the vector an edit adds or "
                     "exchanges does (docs/interventions.md).")
    st.button("Run", key="iv_run", on_click=request_run, type="primary", icon=":material/science:")
    _show_run(ctx, chat_text)
    start = min(max(1, int(ss.get("cell_pos") or 1)), max(0, n_prompt - 1))  # "from the clicked one"
    say_box.box(ctx, name, lens, chat_text, tuple(ss.iv_layers), start)


def trial_panel(ctx: Any, chat_text: str) -> None:
    """The panel while it replays a trial opened from the Experiments page: the trial's own edits (vectors,
    clamps, injections the panel's controls cannot describe), Run, and the comparison."""
    trial = ss.iv_trial
    st.info(f"The edit is the experiment trial's own: {trial['label']}.", icon=":material/science:")
    c1, c2, _ = st.columns([2, 2, 2])
    c1.number_input("New tokens", min_value=1, max_value=common.MAX_GEN_TOKENS, step=1, key="iv_new")
    c2.button("Run", key="iv_run", on_click=request_run, type="primary", icon=":material/science:")
    c2.button("Edit with the panel instead", key="iv_trial_clear", icon=":material/tune:",
              on_click=lambda: ss.update(iv_trial=None, iv_edited_heatmap=False),
              help="Leave the trial's edit and use the swap / steer / ablate controls.")
    _show_run(ctx, chat_text)


def _show_run(ctx: Any, chat_text: str) -> None:
    """The last Run's clean-vs-edited comparison (or why there is none)."""
    model = ctx.model
    stored = common.shown_run(current(ctx, chat_text), "iv_result", "Settings changed: Run again to see their effect.",
                              "Cannot run this edit")
    if stored is None:
        return
    result = stored["result"]
    for edit in stored["edits"]:
        skipped = getattr(edit, "skipped_layers", [])
        st.caption(f"Edit: `{edit!r}`" + (f"; layers {skipped} skipped (|cos(v_A, v_B)| > 0.999)" if skipped else ""))
    st.plotly_chart(comparison_figure(result, k=10), key="iv_bars", config={"displaylogo": False})
    left, right = st.columns(2)
    first = result.first_difference
    left.markdown("**Clean continuation**")
    left.markdown(marked_continuation(model, result.clean.generated_ids, first))
    right.markdown("**Edited continuation**")
    right.markdown(marked_continuation(model, result.edited.generated_ids, first))
    st.caption("The same continuation." if first is None else
               f"They part at generated token {first} (highlighted).")
    st.caption(f"What else moved: {result.side_effects()} (KL(edited ‖ clean); docs/interventions.md).",
               help="Readout: the next-token distribution after the prompt, without the token the edit aims at "
                    "(both renormalised). Downstream: the clean continuation teacher-forced with the edit, KL per "
                    "token, mean and largest.")
    st.toggle("Heatmap of the edited run", key="iv_edited_heatmap",
              help="Draw the heatmap above from the edited forward pass over the same tokens.")
    if ss.iv_edited_heatmap:
        st.caption("The heatmap above reads the edited run.")


def heatmap_edits(ctx: Any, chat_text: str) -> tuple[list, str] | None:
    """``(edits, key)`` for the heatmap when "heatmap of the edited run" is on and a result matches."""
    stored = current(ctx, chat_text)
    if not ss.get("iv_edited_heatmap") or not stored or "edits" not in stored:
        return None
    return stored["edits"], repr(stored["edits"])
