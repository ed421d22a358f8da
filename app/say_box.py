"""The Intervene panel's "Make it say…" box: search the edit that makes the model say a word
(``jlens_core.interventions.say``), list the verified recipes, and apply the one picked.

The search runs when *Search* is clicked, with a progress bar; clicking *Stop* ends the run and keeps what was
found so far (Streamlit ends a script run when a widget is used; the progress callback keeps the partial result
in the session first). Picking a row of the recipe table applies it: the clean and the edited heatmaps of the
directions lens side by side, their difference, and the continuations with and without the edit.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

import cache
import common
from jlens_core.figures.heatmaps import heatmap_figure
from jlens_core.interventions.compare import compare_runs
from jlens_core.interventions.say import OPS, SayResult, make_it_say
from jlens_core.reading.readout_protocol import Readout

OP_LABELS = {"steer": "steer toward X", "swap": "swap the top lens token for X", "ablate": "ablate competitors"}
WHERE = {"readout": "the last position", "from": "every position from the clicked one"}
DEFAULT_REPLAYS = 12
COLUMNS = ["arm", "op", "layers", "positions", "strength", "next_token", "target_prob", "readout_kl_bits",
           "downstream_kl_bits", "downstream_kl_max_bits", "prompt_kl_bits", "minimal"]
KL_COLUMNS = {"readout_kl_bits": ("readout KL (bits)", ("At the readout, over the tokens other than the target's "
                                  "(both renormalised without them).")),
              "downstream_kl_bits": ("downstream KL (bits)", ("The clean continuation teacher-forced with the edit: "
                                     "KL per token, the mean.")),
              "downstream_kl_max_bits": ("downstream max (bits)", "The largest KL over the clean continuation."),
              "prompt_kl_bits": ("prompt KL (bits)", ("An edit from a position: KL at the prompt positions it touches "
                                 "before the readout (empty for a readout edit, which touches none)."))}

ss = st.session_state


def _init() -> None:
    for key, value in (("say_target", ""), ("say_ops", list(OPS)), ("say_where", ["readout", "from"]),
                       ("say_replays", DEFAULT_REPLAYS), ("say_view", "side")):
        ss.setdefault(key, value)


def _request_search() -> None:
    ss._say_requested = True
    ss.pop("say_table", None)  # a new result: no row picked yet


def _request_stop() -> None:
    ss._say_stop = True


def settings_key(model_key: str, lens_key: str, text: str, layers: tuple, from_position: int) -> tuple:
    """What a stored result was searched with: a change of any asks for a new search."""
    return (model_key, lens_key, text, ss.say_target, tuple(ss.say_ops), tuple(ss.say_where), int(ss.say_replays),
            tuple(layers), int(from_position))


def _search(model: Any, lens: Any, text: str, layers: list[int], from_position: int, key: tuple) -> None:
    """Run the search with a progress bar; keep the result (or the partial one when stopped) in the session."""
    bar = st.progress(0.0, text="Searching…")
    stop = st.empty()
    stop.button("Stop", key="say_stop", on_click=_request_stop, icon=":material/stop:",
                help="End the search and keep the recipes found so far.")

    def progress(p) -> None:
        ss._say_partial = (key, p.result)
        bar.progress(min(1.0, p.done / max(1, p.total)), text=f"{p.arm}: {p.message}")

    try:
        result = make_it_say(model, lens, text, ss.say_target, layers=layers, ops=ss.say_ops, positions=ss.say_where,
                             from_position=from_position, max_replays=int(ss.say_replays),
                             continuation_tokens=0, progress=progress)  # the box writes its own (_apply)
    except common.EXPECTED_ERRORS as exc:
        ss.say_result = {"key": key, "error": str(exc)}
    else:
        ss.say_result = {"key": key, "result": result}
    finally:
        bar.empty()
        stop.empty()


def _stored(key: tuple) -> dict | None:
    """The result for these settings: a finished search, or the partial one a Stop left (marked stopped)."""
    if ss.pop("_say_stop", False):
        partial = ss.pop("_say_partial", None)
        if partial is not None and partial[0] == key and partial[1] is not None:
            partial[1].stopped = True
            ss.say_result = {"key": key, "result": partial[1]}
    stored = ss.get("say_result")
    return stored if stored and stored["key"] == key else None


def recipe_table(result: SayResult) -> tuple[pd.DataFrame, list]:
    """The verified recipes of every arm (the lens first, then the controls) and the recipe objects, row by row."""
    recipes = [(arm, r) for arm in result.arms.values() for r in arm.recipes]
    rows = []
    for arm, recipe in recipes:
        row = recipe.row()
        rows.append({**{k: row[k] for k in COLUMNS if k in row}, "minimal": recipe is arm.minimal,
                     "describe": recipe.describe(result.target_text)})
    return pd.DataFrame(rows, columns=COLUMNS + ["describe"]), [r for _, r in recipes]


def minimal_lines(result: SayResult) -> list[str]:
    """Each arm's minimal recipe under its own name (the same rule as the CLI and the JSON: docs/interventions.md)."""
    lines = []
    for name, arm in result.arms.items():
        found = (f"{arm.minimal.describe(result.target_text)}; {arm.minimal.side_effects()}" if arm.minimal
                 else "none found")
        lines.append(f"**{name}** ({arm.directions}): {found}")
    return lines


def _picked(recipes: list) -> Any:
    selection = (ss.get("say_table") or {}).get("selection") or {}
    rows = list(selection.get("rows") or [])
    return recipes[rows[0]] if rows and rows[0] < len(recipes) else None


def _apply(ctx: Any, name: str, lens: Any, text: str, recipe: Any, target: str) -> None:
    """The picked recipe applied: clean and edited heatmaps (or their difference), and both continuations."""
    model = ctx.model
    lens_key = ctx.lens_keys()[name]
    edits_key = "say:" + repr(recipe.edits)
    settings = (text, cache.ReadSpec(Readout(k=int(ss.get("top_k") or 10)), max_seq_len=common.MAX_TOKENS))
    with st.spinner("Reading the clean and the edited run…"):
        clean = cache.readings_cached(model, ctx.model_key, {name: (lens, lens_key)}, *settings)[name]
        edited = cache.readings_cached(model, ctx.model_key, {name: (lens, lens_key)}, *settings,
                                       edits_key=edits_key, edits=recipe.edits)[name]
        store = ss.setdefault("_say_runs", {})
        run_key = (ctx.model_key, text, edits_key)
        if run_key not in store:
            store.clear()  # one comparison kept
            store[run_key] = compare_runs(model, text, recipe.edits, max_new_tokens=int(ss.get("iv_new") or 20))
        compared = store[run_key]
    st.radio("Show", ["side", "diff"], key="say_view", horizontal=True,
             format_func={"side": "clean above, edited below", "diff": "difference (edited − clean)"}.get)
    stat = ss.get("stat") if isinstance(ss.get("stat"), str) and not str(ss.get("stat")).startswith("rank_") \
        else "top1_prob"
    fig = heatmap_figure({"clean": clean, "edited": edited}, ss.say_view, stat, pair=("clean", "edited"))
    fig.update_layout(title=f"{recipe.describe(target)} · " + fig.layout.title.text)
    st.plotly_chart(fig, key="say_heatmap", config={"displaylogo": False})
    left, right = st.columns(2)
    left.markdown("**Clean continuation**")
    left.code(compared.clean.continuation or "∅", language=None)
    right.markdown("**Edited continuation**")
    right.code(compared.edited.continuation or "∅", language=None)


def box(ctx: Any, name: str, lens: Any, text: str, layers: tuple[int, int], from_position: int) -> None:
    """The box: target and settings, Search, the recipes and the applied one."""
    _init()
    model = ctx.model
    band = list(range(int(layers[0]), int(layers[1]) + 1))
    key = settings_key(ctx.model_key, ctx.lens_keys()[name], text, tuple(band), from_position)
    with st.expander("Make it say…", expanded=bool(ss.get("say_result"))):
        st.caption(f"Search the edit along the {common.lens_label(name)}'s read directions that makes the model say a "
                   "word next: candidates ranked by their first-order effect, the best replayed with the real forward "
                   "pass, the smallest band and strength bisected; the same search with random directions and the "
                   "logit lens's as controls (docs/interventions.md). It searches the Layers above.")
        c1, c2, c3 = st.columns([2, 3, 2])
        c1.text_input("Target word", key="say_target", placeholder="e.g. Berlin")
        c2.multiselect("Edits", list(OPS), key="say_ops", format_func=OP_LABELS.get)
        c2.multiselect("At", list(WHERE), key="say_where", format_func=WHERE.get)
        c3.number_input("Replays per arm", min_value=1, max_value=64, step=1, key="say_replays",
                        help="Candidates replayed with the real forward pass, per arm (the bisection adds a few).")
        c3.button("Search", key="say_run", on_click=_request_search, type="primary", icon=":material/search:")
        if ss.pop("_say_requested", False):
            if not ss.say_target.strip():
                ss.say_result = {"key": key, "error": "The target is empty: type the word the model should say."}
            else:
                _search(model, lens, text, band, from_position, key)
        stored = common.shown_run(_stored(key), "say_result", "Settings changed: Search again.", "Cannot search")
        if stored is None:
            return
        result: SayResult = stored["result"]
        if result.stopped and not result.message:  # stopped mid-search: the library had not summed up yet
            st.warning(f"Stopped after {result.n_replayed} replays: {len(result.recipes)} verified recipe"
                       f"{'s' if len(result.recipes) != 1 else ''} of the lens so far.")
        else:
            (st.success if result.search.found else st.info)(result.message)
        timing = ", ".join(f"{k} {v:.1f} s" for k, v in result.timings.items())
        st.caption(f"{result.n_ranked} candidates ranked, {result.n_replayed} replayed; {timing}.")
        table, recipes = recipe_table(result)
        if not recipes:
            return
        st.markdown("Minimal recipe per arm (the smallest band, then readout before from, then the smallest "
                    "relative strength):\n\n" + "\n".join(f"- {line}" for line in minimal_lines(result)))
        kl_config = {k: st.column_config.NumberColumn(label, format="%.3f", help=why)
                     for k, (label, why) in KL_COLUMNS.items()}
        st.dataframe(table.drop(columns=["describe"]), key="say_table", on_select="rerun",
                     selection_mode="single-row", hide_index=True,
                     column_config={"target_prob": st.column_config.NumberColumn("P(target)", format="%.3f"),
                                    **kl_config})
        recipe = _picked(recipes)
        if recipe is None:
            st.caption("Pick a row to apply its recipe: the edited heatmap beside the clean one, and the continuation.")
            return
        _apply(ctx, name, lens, text, recipe, result.target_text)
