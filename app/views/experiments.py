"""Experiments: the paper's workspace experiments on the loaded model (docs/experiments.md): pick one, a built-in
set, an uploaded file or a workspace path in its format, and the band; run with progress and cancel; the figure
with its intervals, the summary, the gate and the per-trial table; a trial opens in Inspect."""

from __future__ import annotations

import json
from urllib.parse import urlencode

import streamlit as st

import cache
import common
from jlens_core.experiments.formats import built_in_sets, load_experiment_items, reference_size_sets
from jlens_core.experiments.links import EDIT_KEYS, held_label, trial_edit
from jlens_core.experiments.run import available_experiments, run_experiment

ss = st.session_state
ctx = common.require_model()
model = ctx.model
lenses = ctx.lenses()
st.title("Workspace experiments")
st.caption("The Jacobian-lens paper's tests of the J-space, each one run: a capability gate first (items the model "
           "cannot do are listed, not scored), the swap arms and their controls (the logit lens's directions, random "
           "directions, a null swap, the answer-swap ceiling; the J / non-J split where the J-space is built), "
           "Wilson 95 % intervals and a bootstrap clustered by category. See docs/experiments.md.")


names = available_experiments()
ss.setdefault("ex_name", names[0])
c1, c2 = st.columns([2, 2])
c1.selectbox("Experiment", names, key="ex_name")
lens_name = c2.selectbox("Lens", list(lenses), key="ex_lens",
                         help="The lens whose read coordinates the swaps move (a J lens for the paper's claims).")
d1, d2 = st.columns([1, 1])
upload = d1.file_uploader("Your own set (.json in the experiment's format; default: the built-in set)", type=["json"],
                          key="ex_upload")
path_text = d2.text_input("…or a set's path in the workspace", key="ex_path", placeholder="probe-swap.json")
if ss.ex_name in reference_size_sets():
    d1.radio("Built-in set", ["example", "reference size"], key="ex_builtin", horizontal=True,
             help="The small example set, or the one at the reference's size (docs/experiments.md).")
top = max(x for x in lenses[lens_name].layers if x != lenses[lens_name].target_layer)
derive = st.checkbox("Derive the band (the study's band rule)", value=True, key="ex_derive",
                     help="From the first layer where the experiment's concept reaches half its peak share of the "
                          "lens's top 5 at the last position, to the last layer of that run.")
band = None
if not derive:
    lo, hi = st.slider("Band (layers)", 0, top, (max(0, 2 * top // 3), top), key="ex_band")
    band = f"{lo}-{hi}"


def _data() -> dict:
    name = ss.ex_name
    if upload is not None:
        try:
            parsed = json.loads(upload.getvalue().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{upload.name} is not JSON ({exc}).") from None
        return load_experiment_items(parsed, name)[1]
    if (path_text or "").strip():
        return load_experiment_items(common.confine(path_text.strip(), "experiment set"), name)[1]
    if name in reference_size_sets() and ss.get("ex_builtin") == "reference size":
        return load_experiment_items(reference_size_sets()[name], name)[1]
    if name not in built_in_sets():
        raise ValueError(f"No built-in set for {name}: upload one.")
    return load_experiment_items(built_in_sets()[name], name)[1]


run_col, cancel_col = st.columns([1, 5])
if run_col.button("Run experiment", type="primary", icon=":material/play_arrow:", key="ex_go"):
    with common.guard("Could not run the experiment"):
        data = _data()
        # Cancel reruns the page: Streamlit stops this run at its next call, the progress update between two steps
        cancel_col.button("Cancel", icon=":material/stop:", key="ex_cancel")
        bar = st.progress(0.0, text="starting")
        result = run_experiment(model, lenses[lens_name], ss.ex_name, data, band=band,
                                progress=lambda i, n: bar.progress(i / n, text=f"{i} / {n} steps"))
        bar.empty()
        ss.ex_result = {"key": common.result_key(ctx.model_key, lens_name), "result": result}
if ss.get("ex_cancel"):
    st.info("The experiment was cancelled; press Run experiment to start it again.")

found = ss.get("ex_result")
if found and found["key"] == common.result_key(ctx.model_key, lens_name):
    result = found["result"]
    for note in result.notes:
        st.warning(note)
    st.caption(f"{result.name}: {result.n_gated} of {len(result.gate)} items passed the gate; band "
               f"{result.band.label} ({result.band.rule}); {result.seconds:.1f} s.")
    st.plotly_chart(result.figure(), key="ex_fig", config={"displaylogo": False})
    st.dataframe(result.summary, hide_index=True, width="stretch", key="ex_summary")
    for name, value in result.extras.items():
        if hasattr(value, "to_csv"):
            with st.expander(name.replace("_", " ")):
                st.dataframe(value, hide_index=True, width="stretch")
        elif isinstance(value, dict) and value and not all(hasattr(v, "to_csv") for v in value.values()):
            st.caption(f"{name.replace('_', ' ')}: " + ", ".join(f"{k} {v}" for k, v in value.items()))
    with st.expander("Gate"):
        st.dataframe(result.gate, hide_index=True, width="stretch", key="ex_gate")
    st.subheader("Trials")
    picked = st.dataframe(result.trials, hide_index=True, width="stretch", key="ex_trials", on_select="rerun",
                          selection_mode="single-row")
    st.download_button("Download the trials (CSV)", result.trials.to_csv(index=False), f"{result.name}-trials.csv",
                       "text/csv", on_click="ignore", key="ex_csv")
    st.download_button("Download the page (HTML)", result.to_html(), f"{result.name}.html", "text/html",
                       on_click="ignore", key="ex_html")
    rows = list(picked.selection.rows) if picked is not None and hasattr(picked, "selection") else []
    if rows:
        trial = result.trials.iloc[rows[0]]
        item = result.gate[result.gate["item"] == trial["item"]]
        own = trial.get("prompt") if "prompt" in trial.index else None  # a trial on a prompt of its own
        if (len(item) and "prompt" in item) or isinstance(own, str):
            prompt = own if isinstance(own, str) else str(item["prompt"].iloc[0])
            # Inspect opens from the URL, as Study's items do: the trial's prompt, its target pinned, the band, and
            # the trial's swap (the edit* keys), which Inspect applies and names
            query = {key: st.query_params.get(key) for key in st.query_params if key not in EDIT_KEYS}
            query.update(prompt=prompt, pin=" " + str(trial["target"]).strip(),
                         band=f"{result.band.layers[0]}-{result.band.layers[-1]}")
            # a coordinate swap travels in the URL (it survives a restart); any other arm's edits (vectors, clamps,
            # injections, ablations) stay on this server, and the link names them by a random token
            edit = trial_edit(model, result, trial.to_dict())
            edits = result.edits_of(rows[0])
            label = held_label(result, trial.to_dict())
            held = None if edit is not None or not edits else cache.held_trials().hold(ctx.model_key, edits, label)
            if edit is not None:
                query.update(edit.query())
            elif held is not None:
                query.update(held.query())
            st.link_button("Open the trial in Inspect" + (" with its edit" if edit or held else ""),
                           "./?" + urlencode(query), icon=":material/grid_on:", key="ex_open")
            st.caption(f"The link applies the trial's edit: {edit}." if edit else
                       f"The link applies the trial's own edits ({label}), which this "
                       "server holds while it runs." if held else
                       f"The {trial['arm']} arm runs no edit: the link opens the trial's prompt.")
