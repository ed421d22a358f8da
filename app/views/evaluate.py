"""Evaluate: per-layer KL and cross-entropy of the logit vs the Jacobian lens, and pass@k."""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import pandas as pd
import streamlit as st

import charts
import common
from jlens_core.corpus import BUILTIN_CORPUS, load_corpus
from jlens_core.reading.evaluation import EVAL_SETS, evaluate, load_eval_set, pass_at_k

ss = st.session_state
ctx = common.require_model()
model = ctx.model
lenses = ctx.lenses()
st.title("Evaluate the lenses")
if ctx.lens is None:
    st.info("No Jacobian lens is loaded: the curves show the logit lens alone.")


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


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
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / Path(upload.name).name
        path.write_bytes(upload.getvalue())
        return load_corpus(str(path), n=n, min_chars=int(min_chars))


if st.button("Evaluate", type="primary", icon=":material/play_arrow:", key="eval_go"):
    with common.guard("Could not evaluate"):
        texts = _texts()
        bar = st.progress(0.0, text=f"0 / {len(texts)} texts")
        frame = evaluate(model, lenses, texts, max_seq_len=int(max_seq_len),
                         progress=lambda i, n: bar.progress(i / n, text=f"{i} / {n} texts"))
        bar.empty()
        ss.eval_result = {"key": _key(ctx.model_key, ctx.lens_key), "frame": frame, "n_texts": len(texts),
                          "skip_first": frame.attrs.get("skip_first")}
result = ss.get("eval_result")
if result and result["key"] == _key(ctx.model_key, ctx.lens_key):
    frame = result["frame"]
    st.plotly_chart(charts.eval_curves_figure(frame), key="eval_curves", config={"displaylogo": False})
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
           "Paris). An intermediate passes at k when, at the prompt's last position, some layer ranks its first "
           "token in the top k.")
ss.setdefault("pak_sets", list(EVAL_SETS))
p1, p2 = st.columns([3, 1])
p1.multiselect("Evaluation sets", list(EVAL_SETS), key="pak_sets", help="\n".join(f"- {k}: {v}"
                                                                              for k, v in EVAL_SETS.items()))
ss.setdefault("pak_k", [1, 5, 10])
p2.multiselect("k", [1, 2, 3, 5, 10, 20, 50, 100], key="pak_k")
if st.button("Run pass@k", icon=":material/play_arrow:", key="pak_go"):
    with common.guard("Could not compute pass@k"):
        if not ss.pak_sets or not ss.pak_k:
            raise ValueError("Choose at least one evaluation set and one k.")
        parts, details = [], []
        bar = st.progress(0.0)
        for i, name in enumerate(ss.pak_sets):
            bar.progress(i / len(ss.pak_sets), text=f"{name}…")
            summary, detail = pass_at_k(model, lenses, load_eval_set(name), k=sorted(ss.pak_k), return_detail=True)
            parts.append(summary.assign(set=name))
            details.append(detail.assign(set=name))
        bar.empty()
        ss.pak_result = {"key": _key(ctx.model_key, ctx.lens_key), "summary": pd.concat(parts, ignore_index=True),
                         "detail": pd.concat(details, ignore_index=True)}
pak = ss.get("pak_result")
if pak and pak["key"] == _key(ctx.model_key, ctx.lens_key):
    st.plotly_chart(charts.pass_at_k_figure(pak["summary"]), key="pak_chart", config={"displaylogo": False})
    st.dataframe(pak["summary"][["set", "lens", "k", "pass_rate", "n_passed", "n_intermediates", "n_items"]],
                 hide_index=True, width="stretch",
                 column_config={"pass_rate": st.column_config.ProgressColumn("pass rate", min_value=0, max_value=1,
                                                                            format="percent")})
    with st.expander("Per item"):
        st.dataframe(pak["detail"], hide_index=True, width="stretch")
