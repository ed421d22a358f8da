"""Study: where each item's concepts enter every loaded lens's top k over an item set (docs/method.md §8.1):
the by-layer fraction per lens with its interval, the first-appearance histogram, the band, the items; an item
opens in Inspect with its concept pinned."""

from __future__ import annotations

import tempfile
from pathlib import Path
from urllib.parse import urlencode

import streamlit as st

import common
from jlens_core.evaluation.passk import EVAL_SETS
from jlens_core.evaluation.study import study, study_sets
from jlens_core.figures.study import study_figure
from jlens_core.workspace import sanitise_filename

ss = st.session_state
ctx = common.require_model()
model = ctx.model
lenses = ctx.lenses()
LENSES_KEY = tuple(ctx.lens_keys().values())  # a result holds for these lenses only
st.title("Study an item set")
st.caption("For every item, lens and concept (the item's unstated intermediate step): its rank at every layer at "
           "the readout position, read with one forward pass per item. Per lens: the share of items with the concept "
           "in the top k by layer (95 % Wilson interval), where it first enters, and the **band**: from the first "
           "layer reaching half the curve's peak to the last layer of the run that stays there (bootstrap "
           "interval over items). See docs/studies.md.")


def _uploaded_sets(upload) -> dict[str, list]:
    """An uploaded set, read from a temporary file of the same suffix and named by the upload's stem."""
    name = sanitise_filename(upload.name, "items.jsonl")
    with tempfile.TemporaryDirectory(dir=common.uploads_dir()) as tmp:
        path = Path(tmp) / name
        path.write_bytes(upload.getvalue())
        return study_sets(str(path))


ss.setdefault("st_sets", ["two_hop"])
ss.setdefault("st_k", 10)
ss.setdefault("st_n", 0)
ss.setdefault("st_filter", True)
ss.setdefault("st_path", "")
c1, c2, c3 = st.columns([3, 1, 1])
c1.multiselect("Built-in item sets", list(EVAL_SETS), key="st_sets",
               help="\n".join(f"- {k}: {v}" for k, v in EVAL_SETS.items()))
c2.number_input("k (top-k)", 1, 1000, key="st_k")
c3.number_input("Items per set (0: all)", 0, 100_000, key="st_n")
d1, d2 = st.columns([1, 1])
upload = d1.file_uploader("…or your own set (.json with items, or .jsonl)", type=["json", "jsonl"], key="st_upload")
d2.text_input("…or a set's path in the workspace", key="st_path", placeholder="my_items.jsonl (in the workspace)")
st.checkbox("Only items the model answers", key="st_filter",
            help="Keep an item when the model's greedy next token after the prompt is a first token of its answer "
                 "(the item's `answer`, else its `target`); items without one are kept.")


def _chosen_sets() -> dict[str, list]:
    sets = {name: study_sets(name)[name] for name in ss.st_sets}
    if upload is not None:
        sets.update(_uploaded_sets(upload))
    if (ss.st_path or "").strip():
        path = common.confine(ss.st_path.strip(), "item set")  # refused outside the workspace
        sets.update(study_sets(str(path)))
    if not sets:
        raise ValueError("Choose a built-in set, upload one, or give a path in the workspace.")
    n = int(ss.st_n)
    return {name: items[:n] if n else items for name, items in sets.items()}


run_col, cancel_col = st.columns([1, 5])
if run_col.button("Run study", type="primary", icon=":material/play_arrow:", key="st_go"):
    with common.guard("Could not run the study"):
        sets = _chosen_sets()
        total = sum(len(items) for items in sets.values())
        # Cancel reruns the page: Streamlit stops this run at its next call, the progress update between two items
        cancel_slot = cancel_col.empty()
        cancel_slot.button("Cancel", icon=":material/stop:", key="st_cancel")
        bar = st.progress(0.0, text=f"0 / {total} items")
        result = study(model, lenses, sets, k=int(ss.st_k), answered_only=None if ss.st_filter else False,
                       progress=lambda i, n: bar.progress(i / n, text=f"{i} / {n} items"))
        bar.empty()
        cancel_slot.empty()
        ss.st_result = {"key": common.result_key(ctx.model_key, LENSES_KEY), "study": result}
if ss.get("st_cancel"):
    st.info("The study was cancelled; press Run study to start it again.")

found = ss.get("st_result")
if found and found["key"] == common.result_key(ctx.model_key, LENSES_KEY):
    result = found["study"]
    for note in result.notes:
        st.warning(note)
    counts = "; ".join(f"{name}: {c['kept']} of {c['n_items']} items kept" + (
        f" ({c['dropped']} not answered)" if c["filter"] else " (no filter)") for name, c in result.info["sets"].items())
    st.caption(f"{counts}. {result.info['forwards']} items read in {result.info['seconds']:.1f} s, one forward each; "
               f"k = {result.k}.")
    set_name = result.sets[0]
    if len(result.sets) > 1:
        set_name = st.selectbox("Set shown", result.sets, key="st_view_set")
    st.plotly_chart(study_figure(result, set_name), key="study_fig", config={"displaylogo": False})
    summary = result.summary[result.summary["set"] == set_name]
    st.dataframe(summary.drop(columns=["set", "kind"]), hide_index=True, width="stretch", key="study_summary")
    comparisons = result.comparisons()
    if not comparisons.empty:
        st.caption("Onset against the first lens's (logit when loaded), paired over items: difference in layers with "
                   "its 95 % bootstrap interval; *earlier* / *later* when the interval excludes 0, else *tie*.")
        st.dataframe(comparisons[comparisons["set"] == set_name].drop(columns=["set"]), hide_index=True,
                     width="stretch", key="study_compare")
    unscored = result.unscored()
    unscored = unscored[unscored["set"] == set_name]
    if not unscored.empty:
        st.caption("Unscored (no single-token spelling, so left out): "
                   + ", ".join(f"{row.name}: {row.concept!r}" for row in unscored.itertuples()))
    st.subheader("Items")
    table = result.item_table(set_name).drop(columns=["set", "item"])
    picked = st.dataframe(table, hide_index=True, width="stretch", key="study_items", on_select="rerun",
                          selection_mode="single-row")
    st.download_button("Download the items (CSV)", table.to_csv(index=False), f"study-{set_name}.csv", "text/csv",
                       on_click="ignore", key="study_csv")
    rows = list(picked.selection.rows) if picked is not None and hasattr(picked, "selection") else []
    labels = [f"{row.name} · {row.concept}" for row in table.itertuples()]
    if rows and rows[0] != ss.get("_st_row"):  # a row clicked: it becomes the item to open
        ss.st_item = labels[rows[0]]
    ss._st_row = rows[0] if rows else None
    if ss.get("st_item") not in labels:
        ss.st_item = labels[0]
    o1, o2 = st.columns([3, 1])
    choice = o1.selectbox("Item (or click a row)", labels, key="st_item")
    row = table.iloc[labels.index(choice)]
    items = result.items
    spelled = items[(items["set"] == set_name) & (items["name"] == row["name"])
                    & (items["concept"] == row["concept"])]["spellings"].iloc[0]
    # Inspect opens from the URL, as a shared view does: this view's model and lenses, the item's prompt, its
    # concept pinned (its first single-token spelling)
    query = {key: st.query_params.get(key) for key in st.query_params if key not in common.STUDY_URL_KEYS}
    query.update(prompt=str(row["prompt"]), pin=(list(spelled) or [" " + str(row["concept"])])[0])
    o2.link_button("Open in Inspect", "./?" + urlencode(query), icon=":material/grid_on:")
