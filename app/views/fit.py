"""Fit: run ``jlens fit`` in its own process and watch the lens converge, live."""

from __future__ import annotations

import time

import streamlit as st

import common
import lens_slots
from jlens_core.corpus import BUILTIN_CORPUS
from jlens_core.figures.fitting import convergence_figure, half_agreement_figure, norm_heatmap
from jlens_core.fitting import runs
from jlens_core.fitting.diagnostics import (
    convergence_frame,
    diagnostics_frame,
    half_agreement_frame,
    norm_matrix,
    one_over_n_guide,
    read_diagnostics,
)
from jlens_core.layerspec import fit_source_layers
from jlens_core.lenses.fit_settings import FitPlan, FitSettings

REFRESH_SECONDS = 1.5
RULES = {"jacobian": "Jacobian (J lens)", "relevance": "Relevance (R-lens)"}  # `jlens fit --rules`
ss = st.session_state
ss.setdefault("fit_rules", "jacobian")
ctx = common.context()
root = common.runs_dir()

st.title("Fit a Jacobian lens")
st.caption("The fit runs as a separate `jlens fit` process: the app stays responsive, a crash of the fit cannot "
           "take the server down, and a running fit survives a browser reload and a restart of the app (Resume "
           f"continues it from its checkpoint). Runs are kept in `{root}` (`jlens app --workspace` moves them); "
           "every path typed here must lie in the workspace.")
limit = common.max_fits()
reading_only = ctx.model is None and (ctx.reading_file is not None or bool(ctx.reading_error))
if reading_only:
    st.info(common.READING_ONLY)
running = runs.active_names(root)  # fits and "Learn weights" runs
full = len(running) >= limit
if full:
    st.info(f"{len(running)} of at most {limit} fits at once are running ({', '.join(running)}): a new fit can "
            "start when one ends or is stopped (`jlens app --max-fits N` allows more).")

# -- a new fit -----------------------------------------------------------------------------------------
with st.expander("New fit", expanded=not runs.list_runs(root)):
    spec = ctx.model_spec
    if ctx.model is None:
        st.warning("Load a model in the sidebar first: the fit uses the sidebar's model.")
    else:
        st.markdown(f"Model: **{spec}** ({ctx.model.n_layers} layers, width {ctx.model.d_model}; "
                    f"{ctx.model.d_model} backward passes per prompt)")
    ss.setdefault("fit_name", runs.new_name(spec or "model"))
    st.text_input("Run name", key="fit_name")
    source = st.radio("Corpus", ["built-in", "upload", "path"], horizontal=True, key="fit_source",
                      format_func={"built-in": f"Built-in ({BUILTIN_CORPUS}: Python docstrings)",
                                   "upload": "Upload (.txt / .jsonl)", "path": "Path or dataset"}.get)
    corpus_path = None
    if source == "upload":
        upload = st.file_uploader("Corpus file", type=["txt", "jsonl"], key="fit_upload",
                                  help=".txt: one text per paragraph (blank lines between); .jsonl: a 'text' field")
        if upload is not None:
            corpus_path = common.save_upload(upload)
    elif source == "path":
        corpus_path = st.text_input("Corpus path or Hugging Face dataset", key="fit_corpus_path").strip() or None
    c1, c2, c3, c4 = st.columns(4)
    n_prompts = c1.number_input("Prompts", 1, 100_000, 20, key="fit_n", help="first N texts of the corpus")
    max_seq_len = c2.number_input("max_seq_len", 8, 4096, 128, key="fit_len")
    dim_batch = c3.number_input("dim_batch", 1, 4096, 8, key="fit_dim_batch",
                                help="output dimensions per backward pass: memory, not result")
    min_chars = c4.number_input("min chars per text", 0, 100_000, 400, key="fit_min_chars")
    c5, c6, c7, c8 = st.columns(4)
    layers = c5.text_input("Source layers", "all", key="fit_layers", help="'all', '0,4,8', '0:12', '0:12:2'")
    target = c6.number_input("Target layer", -1000, 1000, -1, key="fit_target", help="negative counts from the end")
    stop_delta = c7.number_input("Stop at delta (0 = off)", 0.0, 1.0, 0.0, format="%.4f", key="fit_stop",
                                 help="stop once the max relative change stays below this for 5 prompts")
    checkpoint = c8.text_input("Checkpoint", "", key="fit_ckpt", placeholder="(in the run folder)")
    st.radio("Rules", list(RULES), key="fit_rules", format_func=RULES.get, horizontal=True,
             help="Jacobian: ordinary gradients (the J lens). Relevance: the same average Jacobian with LRP-style "
                  "backward rules (norm denominators held constant, identity rule for activations, half rule for "
                  "gated products; docs/method.md §9.1): the R-lens, which loads into the sidebar's R-lens slot.")
    e1, e2, _ = st.columns([1, 1, 2])
    n_experts = e1.number_input("Experts", 0, 256, 0, key="fit_experts",
                                help="0: none. E (e.g. 8): also fit E expert Jacobians per layer in the same backward "
                                     "passes, one per cluster of the source residuals (`--experts E`; the J++ / R++ "
                                     "lens, docs/fitting.md). Learn their weights below once the fit is done.")
    cluster_prompts = e2.number_input("Cluster prompts", 1, 100_000, 64, key="fit_cluster_prompts",
                                      disabled=not n_experts,
                                      help="With experts: cluster the kept positions of the first N prompts "
                                           "(`--cluster-prompts N`)")
    split = "fit" if source == "built-in" else "all"
    if st.button("Start fit", type="primary", icon=":material/play_arrow:", disabled=ctx.model is None or full):
        corpus = BUILTIN_CORPUS if source == "built-in" else (str(corpus_path) if corpus_path else None)
        if corpus is None:
            st.error("Choose a corpus file or path first.")
        else:
            with common.guard("Could not start the fit"):
                # Every path is checked before anything is created: a refused one leaves no folder or file.
                corpus = common.confine_spec(corpus, "corpus path")
                name = runs.clean_name(ss.fit_name)
                ckpt = common.confine(checkpoint.strip(), "checkpoint", base=root / name) \
                    if checkpoint.strip() else None
                # what shapes the lens, and how the fit runs: the same types `jlens fit` builds from its flags
                sources = None if layers.strip() in ("", "all") else \
                    fit_source_layers(layers, ctx.model.n_layers, int(target))
                settings = FitSettings(source_layers=sources, target_layer=int(target), max_seq_len=int(max_seq_len),
                                       rules=ss.fit_rules, experts=int(n_experts),
                                       cluster_prompts=int(cluster_prompts))
                plan = FitPlan(dim_batch=int(dim_batch))
                run = runs.start(root, name, model=common.confine_spec(spec, "model folder"), corpus=corpus,
                                 settings=settings, plan=plan, n_prompts=int(n_prompts), min_chars=int(min_chars),
                                 split=split, checkpoint=str(ckpt) if ckpt else None,
                                 stop_at_delta=float(stop_delta) or None, device=ss.get("device"),
                                 dtype=ss.get("dtype"), max_active=limit)
                ss.fit_run = run.name
                del ss["fit_name"]
                st.rerun()

# -- runs ------------------------------------------------------------------------------------------------
all_runs = runs.list_runs(root)
st.subheader("Runs")
followed_path = st.text_input("Follow a fit started elsewhere (its --out lens path)", key="fit_follow",
                              placeholder="/path/to/lens.safetensors")
run = None
if followed_path.strip():
    try:
        run = runs.follow(common.confine(followed_path.strip(), "followed lens path"))
    except (FileNotFoundError, ValueError) as exc:
        st.error(str(exc))
if run is None:
    if not all_runs:
        st.info("No fits yet: start one above.")
        st.stop()
    names = [r.name for r in all_runs]
    if ss.get("fit_run") not in names:
        active = [r.name for r in all_runs if r.state in runs.ACTIVE]
        ss.fit_run = active[0] if active else names[0]
    states = {r.name: r.state for r in all_runs}
    st.selectbox("Run", names, key="fit_run", format_func=lambda n: f"{n} · {states[n]}")
    run = runs.load_run(root / ss.fit_run)

b1, b2, b3, b4, _ = st.columns([1, 1, 1, 1.4, 2])
state = run.state
if full and len(runs.active_names(root)) < limit:
    st.rerun()  # a fit ended while this page was drawn: draw it again, its Start button enabled
if b1.button("Stop", disabled=state not in runs.ACTIVE or run.followed, icon=":material/stop:"):
    runs.stop(run)
    time.sleep(0.3)
    st.rerun()
if b2.button("Force stop", disabled=state not in runs.ACTIVE or run.followed, icon=":material/cancel:",
             help="SIGKILL: the process ends at once; Resume continues from the last checkpoint"):
    runs.stop(run, force=True)
    time.sleep(0.3)
    st.rerun()
if b3.button("Resume", disabled=state not in ("stopped", "failed", "lost") or run.followed,
             icon=":material/play_arrow:"):
    with common.guard("Could not resume"):
        runs.resume(run, max_active=limit)
        st.rerun()
# the slot the finished lens loads into: the R-lens slot for a fit with relevance rules, the J++ / R++ slot for
# an expert fit (its lens file's header says)
done_file = state == "done" and run.lens_path.is_file()
if run.followed:  # a fit started elsewhere: its lens file, by path (its header names its rules)
    slot = lens_slots.slot_for_file(run.lens_path) if done_file else lens_slots.JACOBIAN
    choice = {slot.state("choice"): "file", slot.state("path"): str(run.lens_path)}
else:
    slot = lens_slots.slot_for_file(run.lens_path, run.rules) if done_file else lens_slots.slot_for_rules(run.rules)
    choice = {slot.state("choice"): f"run:{run.name}"}
b4.button("Use this lens", disabled=state != "done" or ctx.model is None or not run.lens_path.is_file(),
          icon=":material/check:", help="select it in the sidebar", on_click=lambda: ss.update(choice))


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    seconds = int(seconds)
    return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m {seconds % 60:02d}s"


def show_run(folder_or_run, shown_state: str) -> None:
    """Progress, ETA and the live charts of one run (``shown_state``: its state when the page was drawn)."""
    current = runs.load_run(folder_or_run) if not isinstance(folder_or_run, runs.Run) else \
        runs.follow(folder_or_run.lens_path) if folder_or_run.followed else runs.load_run(folder_or_run.folder)
    status, now_state = current.status, current.state
    n_total = int(status.get("n_total") or current.info.get("settings", {}).get("n_prompts") or 0)
    next_idx = int(status.get("next_idx") or 0) if now_state != "done" else n_total
    label = {"starting": "starting (loading the model and corpus)…", "running": "running", "done": "done",
             "stopped": "stopped", "failed": "failed", "lost": "the fit process is gone"}.get(now_state, now_state)
    st.markdown(f"**{current.name}** · {label} · model `{current.model_spec}` · corpus `{status.get('corpus', '?')}`")
    fraction = min(1.0, next_idx / n_total) if n_total else 0.0
    st.progress(fraction, text=f"{next_idx} / {n_total or '?'} prompts · {status.get('n_done') or 0} averaged")
    m1, m2, m3, m4 = st.columns(4)
    m1.metric("Prompts averaged", status.get("n_done") or 0)
    spp = status.get("seconds_per_prompt")
    m2.metric("Seconds / prompt", f"{spp:.2f}" if spp else "–")
    m3.metric("ETA", _eta(status.get("eta_seconds")) if now_state in runs.ACTIVE else "–")
    delta = status.get("max_rel_change")
    m4.metric("Max relative change", f"{delta:.2e}" if delta else "–")
    if now_state == "done":
        reason = status.get("stop_reason")
        st.success(f"Finished: {status.get('n_done')} prompts → `{current.lens_path}`"
                   + (f" (stopped early: {reason})" if reason else "")
                   + (f". Select it in the sidebar ({lens_slots.slot_for_file(current.lens_path, current.rules).label} → Fitted "
                      "here) or press *Use this lens*." if not current.followed else "."))
    elif now_state == "failed":
        st.error(f"The fit failed: {current.error_sentence() or 'see the log below'}")
    elif now_state == "stopped":
        st.warning(f"Stopped after {status.get('n_done') or 0} prompts; Resume continues from the checkpoint.")
    elif now_state == "lost":
        st.warning("The fit process is no longer running (killed, or the machine restarted); Resume continues "
                   "from the last checkpoint.")
    records = read_diagnostics(current.diagnostics_path)
    frame = diagnostics_frame(records)
    if frame.empty:
        st.caption("The charts appear after the first prompt (a prompt takes d_model backward passes).")
    else:
        conv = convergence_frame(frame)
        g1, g2 = st.columns(2)
        g1.plotly_chart(convergence_figure(conv, one_over_n_guide(conv)), key="fit_convergence",
                        config={"displaylogo": False})
        g2.plotly_chart(norm_heatmap(norm_matrix(frame)), key="fit_norms", config={"displaylogo": False})
        halves = half_agreement_frame(records)
        if not halves.empty:  # the split halves (docs/method.md §3.3): which layers read alike from either half
            st.plotly_chart(half_agreement_figure(halves), key="fit_halves", config={"displaylogo": False})
            st.caption("Each layer's lens fitted on the even and on the odd prompts apart: the bar is how far they "
                       "differ, the mark the standard error that predicts for the whole lens (half the bar for "
                       "equal halves). Layers with large bars are provisional: fit more prompts.")
    if not current.followed:
        with st.expander("Log"):
            st.code(current.log_tail(40) or "(empty)", language="text")
    if now_state != shown_state:
        st.rerun()  # the whole page: buttons, the run list and the sidebar's lenses follow; the refresh stops at the end


def weights_section(run: runs.Run) -> None:
    """"Learn weights" for a finished expert fit: ``jlens weigh`` as its own process, followed until it is done."""
    from jlens_core.evaluation.passk import shipped_sets
    from jlens_core.lenses.experts import is_expert_lens_file

    if run.followed or run.state != "done" or not run.lens_path.is_file() or not is_expert_lens_file(run.lens_path):
        return
    weigh = runs.load_weigh(run)
    active = weigh is not None and weigh.state in runs.ACTIVE
    st.subheader("Learn weights")
    st.caption("Signed per-layer weights of the experts, learned on a seeded split of labelled pass@k sets and "
               "scored on the held-out items (`jlens weigh`, its own process; docs/fitting.md, expert weights). "
               f"The weighted lens is written to `{run.folder / runs.WEIGHED_FILE}`.")
    sets = st.multiselect("Labelled sets", sorted(shipped_sets()), key="fit_weigh_sets",
                          placeholder="every shipped set")
    if st.button("Learn weights", icon=":material/balance:", disabled=active or full or reading_only,
                 key="fit_weigh"):
        with common.guard("Could not learn the weights"):
            runs.start_weigh(run, sets=list(sets) or None, max_active=limit)
            st.rerun()
    if weigh is not None:
        st.fragment(run_every=REFRESH_SECONDS if active else None)(show_weigh)(run, weigh.state)


def show_weigh(run: runs.Run, shown_state: str) -> None:
    """A weight run's state, progress and, once done, its scores and the weighted lens for the J++ / R++ slot."""
    weigh = runs.load_weigh(run)
    if weigh is None:
        return
    state_now = weigh.state
    if state_now == "running":
        stage, fraction = weigh.progress() or ("loading the model", 0.0)
        st.progress(fraction, text=f"Learning weights: {stage} {fraction:.0%}")
    elif state_now == "failed":
        st.error(f"Learning the weights failed: {weigh.error_sentence() or 'see the log below'}")
    else:
        macro = weigh.record().get("macro", {})
        rows = [{"weights": key.split("/")[0], "split": key.split("/")[1],
                 **{f"pass@{k}": v for k, v in ks.items()}} for key, ks in macro.items()]
        st.success(f"Weights learned → `{weigh.out}`.")
        if rows:
            st.dataframe(rows, hide_index=True)
        slot = lens_slots.slot_for_file(weigh.out, run.rules)
        choice = {slot.state("choice"): lens_slots.FILE, slot.state("path"): str(weigh.out)}
        st.button(f"Use the weighted lens ({slot.label})", key="fit_weigh_use", icon=":material/check:",
                  disabled=ctx.model is None, on_click=lambda: ss.update(choice), help="select it in the sidebar")
    with st.expander("Weights log"):
        st.code(weigh.log_text().replace("\r", "\n")[-4000:] or "(empty)", language="text")
    if state_now != shown_state:
        st.rerun()


live = st.fragment(run_every=REFRESH_SECONDS if state in runs.ACTIVE else None)(show_run)
live(run, state)
weights_section(run)
