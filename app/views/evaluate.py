"""Evaluate: per-layer KL and cross-entropy of every loaded lens (logit, J, R, J++, R++, tuned, and every lens
added from a file), and pass@k: one curve and one table row per lens, by its name."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pandas as pd
import streamlit as st

import common
import lens_slots
from jlens_core.corpus import BUILTIN_CORPUS, load_corpus
from jlens_core.evaluation.by_layer import evaluate
from jlens_core.evaluation.passk import EVAL_SETS, load_eval_set, pass_at_k_sets
from jlens_core.figures.evaluation import eval_curves_figure, pass_at_k_figure
from jlens_core.lenses.kinds import BASELINE, PLAIN
from jlens_core.workspace import sanitise_filename

ss = st.session_state
ctx = common.require_model()
model = ctx.model
lenses = ctx.lenses()
st.title("Evaluate the lenses")
if len(lenses) == 1:
    st.info("No Jacobian lens is loaded: the curves show the logit lens alone.")
LENSES_KEY = tuple(ctx.lens_keys().values())  # a result holds for these lenses only


READOUTS = {"set": "the set's own", "last": "last token", "last_newline": "last newline"}


def _uploaded_items(upload) -> list[dict]:
    """An uploaded set, read by :func:`load_eval_set` from a temporary file of the same suffix."""
    suffix = Path(sanitise_filename(upload.name)).suffix.lower()
    with tempfile.NamedTemporaryFile("wb", suffix=suffix, delete=False, dir=common.uploads_dir()) as f:
        f.write(upload.getvalue())
    try:
        return load_eval_set(f.name)
    finally:
        Path(f.name).unlink(missing_ok=True)


# -- per-layer KL and CE ----------------------------------------------------------------------------
st.subheader("Per-layer KL and cross-entropy")
st.caption("Means over every position past `skip_first` (the lens's fit setting, else 16): KL(model's final "
           "distribution ‖ lens) and the cross-entropy of the actual next token, in bits. The last layer is the "
           "model itself. The built-in texts come from the corpus's held-out *eval* split (never fitted on).")
sources = {"built-in": f"Built-in corpus ({BUILTIN_CORPUS}, eval split)", "paste": "Paste texts",
           "upload": "Upload (.txt / .jsonl)"}
ss.setdefault("eval_source", "built-in")
ss.setdefault("eval_n", 8)
source = st.radio("Texts", list(sources), key="eval_source", format_func=sources.get, horizontal=True)
c1, c2, c3 = st.columns(3)
c1.number_input("Texts (at most)", 1, 2000, key="eval_n")
max_seq_len = c2.number_input("max_seq_len", 18, 4096, 128, key="eval_len")
min_chars = c3.number_input("min chars per text", 0, 100_000, 400, key="eval_min_chars")
pasted, upload = "", None
if source == "paste":
    pasted = st.text_area("Texts, separated by blank lines", key="eval_paste", height=140)
elif source == "upload":
    upload = st.file_uploader("Text file", type=["txt", "jsonl"], key="eval_upload")


def _texts() -> list[str]:
    n = int(ss.eval_n)
    if source == "built-in":
        return load_corpus(BUILTIN_CORPUS, n=n, split="eval", min_chars=int(min_chars))
    if source == "paste":
        texts = [t.strip() for t in pasted.split("\n\n") if t.strip()]
        if not texts:
            raise ValueError("Paste at least one text (texts are separated by blank lines).")
        return texts[:n]
    if upload is None:
        raise ValueError("Upload a .txt or .jsonl file first.")
    with tempfile.TemporaryDirectory(dir=common.uploads_dir()) as tmp:
        path = Path(tmp) / sanitise_filename(upload.name, "texts.txt")
        path.write_bytes(upload.getvalue())
        return load_corpus(str(path), n=n, min_chars=int(min_chars))


if st.button("Evaluate", type="primary", icon=":material/play_arrow:", key="eval_go"):
    with common.guard("Could not evaluate"):
        texts = _texts()
        bar = st.progress(0.0, text=f"0 / {len(texts)} texts")
        frame = evaluate(model, lenses, texts, max_seq_len=int(max_seq_len),
                         progress=lambda i, n: bar.progress(i / n, text=f"{i} / {n} texts"))
        bar.empty()
        ss.eval_result = {"key": common.result_key(ctx.model_key, LENSES_KEY), "frame": frame, "n_texts": len(texts),
                          "skip_first": frame.attrs.get("skip_first")}
result = ss.get("eval_result")


def _stored_evaluation() -> dict | None:
    """The shipped lenses' stored evaluation (``assets/lenses/<model>.eval/``), for the lenses loaded now."""
    shipped = lens_slots.shipped_lens_path(model)
    if shipped is None or ss.get("lens_choice") != "shipped":
        return None
    folder = shipped.with_suffix(".eval")
    try:
        frame = pd.read_csv(folder / "eval.csv")
        info = json.loads((folder / "eval.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    keep = {BASELINE, PLAIN} | {slot_key for slot_key, param in (("relevance", "rlens"), ("tuned", "tuned"))
                                     if ss.get(f"{param}_choice") == "shipped"}
    frame = frame[frame["lens"].isin(keep)].reset_index(drop=True)
    passes = None
    try:
        passes = pd.read_csv(folder / "pass_at_k.csv")
        passes = passes[passes["lens"].isin(keep)].reset_index(drop=True)
    except (OSError, ValueError):
        pass
    return {"frame": frame, "n_texts": info.get("n_texts"), "skip_first": 16, "stored": True, "passes": passes}


if not (result and result["key"] == common.result_key(ctx.model_key, LENSES_KEY)):
    stored = _stored_evaluation()
    if stored is not None:
        result = {**stored, "key": common.result_key(ctx.model_key, LENSES_KEY)}
        absent = [common.lens_label(name) for name in lenses if name not in set(stored["frame"]["lens"])]
        st.info(f"The stored evaluation of the shipped lenses ({result['n_texts']} held-out texts, made by "
                "`scripts/evaluate_shipped.sh`); press Evaluate to compute it on texts of your choice"
                + (f" and with {', '.join(absent)}, which it does not hold." if absent else "."))
if result and result["key"] == common.result_key(ctx.model_key, LENSES_KEY):
    frame = result["frame"]
    st.plotly_chart(eval_curves_figure(frame), key="eval_curves", config={"displaylogo": False})
    st.caption(f"{result['n_texts']} texts, {int(frame['n_tokens'].iloc[0]):,} tokens per layer, "
               f"skip_first {result['skip_first']}; bars are ±1 standard error (tokens taken as independent).")
    wide = frame.pivot_table(index="layer", columns="lens", values=["kl_bits", "ce_bits"])
    wide.columns = [f"{stat} · {lens}" for stat, lens in wide.columns]
    with st.expander("Table"):
        st.dataframe(wide.reset_index(), hide_index=True, width="stretch")
        st.download_button("Download (CSV)", frame.to_csv(index=False), "jlens-eval.csv", "text/csv",
                           on_click="ignore", key="eval_csv")

# -- pass@k --------------------------------------------------------------------------------------------
st.subheader("pass@k on latent steps")
st.caption("Prompts whose answer needs an intermediate step (e.g. *the country of the Eiffel Tower* → France → "
           "Paris). An intermediate passes at k when, at the set's readout position, some layer ranks one of its "
           "complete single-token spellings in the top k; a word with no such spelling is unscored (coverage "
           "columns). An item's score is the share of its scored intermediates found; a set's is the mean over "
           "scored items, with a bootstrap 95 % interval.")
ss.setdefault("pak_sets", list(EVAL_SETS))
p1, p2, p3, p4 = st.columns([3, 1, 1, 1])
p1.multiselect("Evaluation sets", list(EVAL_SETS), key="pak_sets", help="\n".join(f"- {k}: {v}"
                                                                              for k, v in EVAL_SETS.items()))
ss.setdefault("pak_k", [1, 5, 10])
p2.multiselect("k", [1, 2, 3, 5, 10, 20, 50, 100], key="pak_k")
p3.selectbox("Readout", READOUTS, key="pak_readout", format_func=READOUTS.get,
             help="Where each prompt is read: the set's own rule, or one for every item.")
ss.setdefault("pak_vocab", "word" if ss.get("vocab_word") else "all")
p4.selectbox("Ranks over", list(common.VOCABS), key="pak_vocab", format_func=common.VOCABS.get,
             help="The readout: every token, or word tokens only (vocab='word': tokens whose text has no letter "
                  "or digit cannot rank; an intermediate's own spellings are never left out).")
st.checkbox("Leave out copied intermediates", key="pak_exclude_copied",
            help="An intermediate that appears in the prompt text can rank high by input copying, not as a latent "
                 "step: leave it out of the score and the coverage (the copied column counts them either way).")
uploaded_set = st.file_uploader("…or your own set (.json with items, or .jsonl)", type=["json", "jsonl"],
                                key="pak_upload")
if st.button("Run pass@k", icon=":material/play_arrow:", key="pak_go"):
    with common.guard("Could not compute pass@k"):
        chosen = [(name, load_eval_set(name)) for name in ss.pak_sets]
        if uploaded_set is not None:
            chosen.append((Path(uploaded_set.name).stem, _uploaded_items(uploaded_set)))
        if not chosen or not ss.pak_k:
            raise ValueError("Choose at least one evaluation set and one k.")
        bar = st.progress(0.0)
        names = [name for name, _ in chosen]

        def set_progress(name: str, done: int, total: int) -> None:
            if done == 0:
                bar.progress(names.index(name) / len(chosen), text=f"{name}…")

        summary, detail = pass_at_k_sets(model, lenses, chosen, progress=set_progress, k=sorted(ss.pak_k),
                                         readout=None if ss.pak_readout == "set" else ss.pak_readout,
                                         vocab=ss.pak_vocab, exclude_copied=bool(ss.pak_exclude_copied))
        bar.empty()
        ss.pak_result = {"key": common.result_key(ctx.model_key, LENSES_KEY), "summary": summary, "detail": detail}
pak = ss.get("pak_result")
if not (pak and pak["key"] == common.result_key(ctx.model_key, LENSES_KEY)) and result and result.get("stored") \
        and result.get("passes") is not None:
    pak = {"key": common.result_key(ctx.model_key, LENSES_KEY), "summary": result["passes"], "detail": pd.DataFrame()}
    st.caption("The stored pass@k of the shipped lenses on the shipped sets; Run pass@k recomputes it.")
if pak and pak["key"] == common.result_key(ctx.model_key, LENSES_KEY):
    st.plotly_chart(pass_at_k_figure(pak["summary"]), key="pak_chart", config={"displaylogo": False})
    st.dataframe(pak["summary"].reindex(columns=["set", "lens", "vocab", "k", "pass_rate", "ci_low", "ci_high",
                                                 "items_scored", "n_items", "words_scored", "n_words", "copied",
                                                 "copied_excluded"]),
                 hide_index=True, width="stretch",
                 column_config={"pass_rate": st.column_config.ProgressColumn("pass@k", min_value=0, max_value=1,
                                                                            format="percent"),
                                "ci_low": st.column_config.NumberColumn("95 % low", format="%.2f"),
                                "ci_high": st.column_config.NumberColumn("95 % high", format="%.2f"),
                                "items_scored": "items scored", "n_items": "items", "words_scored": "words scored",
                                "n_words": "words", "vocab": st.column_config.TextColumn("ranks over", help=(
                                    "all: every token; word: word tokens only (vocab='word')")),
                                "copied": st.column_config.NumberColumn("copied", help=(
                                    "scored intermediates that appear in the prompt text")),
                                "copied_excluded": st.column_config.CheckboxColumn("copied left out")})
    with st.expander("Per item"):
        st.dataframe(pak["detail"], hide_index=True, width="stretch")
