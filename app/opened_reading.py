"""A reading file opened in the app (``jlens inspect --save``, ``reading.save``, ``save_readings``): no model loaded.

The sidebar opens one by upload, by a path in the workspace, or from the URL's ``?reading=<path>``
(:func:`opened`, :func:`open_controls`); while one is open no model is loaded, Inspect draws the file's
readings with the same figures as a live reading (:func:`render`: the heatmap and the cell detail,
the model's and the lenses' identities in a header line), and every control that needs the model is
disabled with :data:`common.READING_ONLY`. Closing it loads the sidebar's model again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st

import common
from jlens_core.figures.heatmaps import cell_from_point, heatmap_figure
from jlens_core.figures.labels import row_labels
from jlens_core.figures.ranks import pinned_ranks_figure
from jlens_core.figures.tokens import topk_bars

PARAM = "reading"  # the URL's parameter: the file's path


@st.cache_resource(show_spinner=False, max_entries=4)
def load_cached(path: str, mtime: float, size: int) -> Any:
    """:func:`jlens_core.load_readings`, once per file version (path, mtime, size)."""
    from jlens_core.reading.reading_file import load_readings

    return load_readings(path)


def _uploaded() -> None:
    upload = st.session_state.get("reading_upload")
    if upload is not None:
        st.session_state.reading_path = str(common.save_upload(upload))


def _open_typed() -> None:
    st.session_state.reading_path = (st.session_state.get("reading_path_box") or "").strip()


def _close() -> None:
    st.session_state.reading_path = ""


def opened(ctx: common.Context) -> bool:
    """When a reading file is asked for (the URL's ``reading``, an upload, a typed path): open it into ``ctx``
    (``ctx.reading_file``, or ``ctx.reading_error``: its sentence), say so in the sidebar and return True."""
    ss = st.session_state
    if "reading_path" not in ss:  # the session's first run: from the URL
        ss.reading_path = st.query_params.get(PARAM) or ""
    text = (ss.get("reading_path") or "").strip()
    if not text:
        if PARAM in st.query_params:
            del st.query_params[PARAM]
        return False
    if st.query_params.get(PARAM) != text:
        st.query_params[PARAM] = text
    sb = st.sidebar
    sb.markdown("### Reading file")
    try:
        path = common.confine(text, "reading file")
        stat = path.stat() if path.is_file() else None
        ctx.reading_file = load_cached(str(path), stat.st_mtime, stat.st_size) if stat else load_cached(str(path), 0, 0)
    except (ValueError, OSError) as exc:  # ReadingFileError, OutsideWorkspaceError (ValueErrors), a missing file
        ctx.reading_error = f"Could not open the reading file: {exc}"
        sb.error(ctx.reading_error)
    else:
        sb.caption(f"**{Path(text).name}**: " + identity_line(ctx.reading_file))
    sb.info(common.READING_ONLY)
    sb.button("Close it and load the model", key="reading_close", on_click=_close, icon=":material/close:")
    return True


def open_controls() -> None:
    """The sidebar's "Open a reading file" (upload, or a path in the workspace)."""
    with st.sidebar.expander("Open a reading file (no model needed)"):
        st.file_uploader("Reading file (.jlens.json)", type=["json"], key="reading_upload", on_change=_uploaded)
        st.text_input("or its path", key="reading_path_box", placeholder="reading.jlens.json (in the workspace)")
        st.button("Open", key="reading_open", on_click=_open_typed)


def identity_line(rf: Any) -> str:
    """The model's and each lens's identity, as the file records them, on one line."""
    model = rf.model or {}
    fingerprint = model.get("fingerprint")
    parts = [f"model **{model.get('name', '?')}**" + (f" (`{str(fingerprint)[:12]}`)" if fingerprint else "")
             + (f", {model['n_layers']} layers" if model.get("n_layers") else "")]
    for name, lens in rf.lenses.items():
        origin = lens.get("origin")
        parts.append(f"{common.lens_label(name)}: {lens.get('kind', '?')}" + (f" from `{origin}`" if origin else ""))
    return " · ".join(parts)


def render(ctx: common.Context) -> None:
    """Inspect for an opened reading file: header, the model's controls disabled, the heatmap and the cell detail."""
    ss = st.session_state
    st.title("Inspect a reading file")
    rf = ctx.reading_file
    if rf is None:
        st.error(ctx.reading_error or "No reading file is open.")
        st.info(common.READING_ONLY)
        return
    readings = rf.readings
    names = list(readings)
    base = readings.get("logit") or readings[names[0]]
    st.markdown(f"From `{Path(str(rf.path or '')).name}` (format {rf.version}, jlens {rf.jlens_version}): "
                + identity_line(rf))
    st.info(common.READING_ONLY)
    left, right = st.columns([4, 1])
    left.text_area("Prompt", value=base.text, height=110, disabled=True, key="reading_prompt")
    right.number_input("New tokens", 0, common.MAX_GEN_TOKENS, 0, disabled=True, key="reading_gen",
                       help=common.READING_ONLY)
    right.text_input("Pin tokens", ", ".join(base.pinned), disabled=True, key="reading_pins",
                     help=common.READING_ONLY)
    if rf.generation is not None:
        st.markdown(f"**Continuation** ({rf.generation.n_generated} tokens): "
                    f"`{rf.generation.continuation.strip() or '∅'}`")
    modes = names + (["side", "diff"] if len(names) >= 2 else []) + (["three"] if len(names) >= 3 else [])
    if ss.get("mode") not in modes:
        ss.mode = "side" if len(names) >= 2 else names[0]
    stats = list(common.STATS) + [f"rank_{p}" for p in base.pinned]
    if ss.get("stat") not in stats:
        ss.stat = "top1_prob"
    c1, c2 = st.columns([3, 2])
    c1.radio("Lens", modes, key="mode", horizontal=True, format_func=lambda m: common.MODES.get(m, m))
    c2.selectbox("Colour by", stats, key="stat", format_func=lambda s: common.STATS.get(s) or f"Rank of pinned {s[5:]!r}")
    for key, default in (("pair_a", names[0]), ("pair_b", names[min(1, len(names) - 1)])):
        if ss.get(key) not in names:
            ss[key] = default
    if ss.mode in ("side", "diff") and len(names) > 2:
        q1, q2, _ = st.columns([1, 1, 3])
        q1.selectbox("Lens A", names, key="pair_a", format_func=common.lens_label)
        q2.selectbox("Lens B", names, key="pair_b", format_func=common.lens_label)
    pair = (ss.pair_a, ss.pair_b)
    layers, positions = list(base.layers), [int(p) for p in base.positions]
    _select_cell(layers, positions)
    fig = heatmap_figure(readings, ss.mode, ss.stat, layers=layers, pair=pair,
                         selected=(int(ss.cell_layer), int(ss.cell_pos)),
                         stability=True)  # the marks a file carries are drawn (docs/method.md §6.2)
    st.plotly_chart(fig, key="heatmap", on_select="rerun", selection_mode="points", config={"displaylogo": False})
    _cell_detail(readings, base, layers, positions)
    st.button("Intervene", disabled=True, help=common.READING_ONLY, key="reading_intervene")


def _select_cell(layers: list[int], positions: list[int]) -> None:
    ss = st.session_state
    points = list(((ss.get("heatmap") or {}).get("selection") or {}).get("points") or [])
    if points:
        signature = json.dumps({k: points[0].get(k) for k in ("x", "y", "curve_number")}, default=str)
        if signature != ss.get("_last_point"):
            ss._last_point = signature
            cell = cell_from_point(points[0], layers)
            if cell is not None and cell[1] in positions:
                ss.cell_layer, ss.cell_pos = cell
    if ss.get("cell_layer") not in layers:
        ss.cell_layer = layers[-1]
    if ss.get("cell_pos") not in positions:
        ss.cell_pos = positions[-1]


def _cell_detail(readings: dict, base: Any, layers: list[int], positions: list[int]) -> None:
    """The selected cell through every reading of the file: top-k bars, statistics, pinned ranks."""
    ss = st.session_state
    st.subheader("Cell detail")
    labels = dict(zip(layers, row_labels(layers, base.output_layer)))
    p1, p2, p3 = st.columns([1, 2, 3])
    p1.selectbox("Layer", layers, key="cell_layer", format_func=labels.get)
    p2.selectbox("Position", positions, key="cell_pos", format_func=lambda p: f"{p}: {base.tokens[positions.index(p)]}")
    layer, position = int(ss.cell_layer), int(ss.cell_pos)
    cells = {name: r.cell(layer, position) for name, r in readings.items() if layer in r.layers}
    first = next(iter(cells.values()))
    p3.markdown(f"Token **`{first['token']}`** at position {position}"
                + (f", next token **`{first['next_token']}`**" if first.get("next_token") else ""))
    st.plotly_chart(topk_bars(cells, k=int(base.top_k)), key="cell_bars", config={"displaylogo": False})
    rows = [{"lens": common.lens_label(name), "top-1": c["top_tokens"][0], "p(top-1)": c["top_probs"][0],
             "entropy (bits)": c["entropy_bits"], "KL to final (bits)": c["kl_bits"],
             "next-token CE (bits)": c["ce_bits"], "next-token rank": c["next_token_rank"],
             "final top-1 rank": c["final_top1_rank"], **{f"rank {k[5:]!r}": v for k, v in c.items()
                                                           if k.startswith("rank_")}}
            for name, c in cells.items()]
    st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
    pinned_fig = pinned_ranks_figure(readings, position)
    if pinned_fig is not None:
        st.plotly_chart(pinned_fig, key="pinned_ranks", config={"displaylogo": False})
