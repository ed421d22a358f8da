"""Compare runs: where do the hidden states of two runs of a model part ways? (``jlens dump`` / ``jlens diff``)"""

from __future__ import annotations

import hashlib
import json

import streamlit as st

import cache
import common
from jlens_core.debugging.diff import diff_dumps, divergence_curve
from jlens_core.debugging.dump import dump_hidden_states, load_dump
from jlens_core.figures.debugging import divergence_figure

ss = st.session_state
ctx = common.context()
st.title("Compare runs")
st.caption("Two runs of a model (fp32 vs bf16, CPU vs GPU, a GGUF-dequantized model vs its original weights, two "
           "library versions): every layer's hidden states are dumped in full and compared, tensor by tensor, "
           "to find the first layer where they differ beyond tolerance. B is the reference.")

how = st.radio("Dumps", ["make", "load"], horizontal=True, key="cmp_how",
               format_func={"make": "Make two dumps here", "load": "Load two dump folders"}.get)
c1, c2 = st.columns(2)
if how == "load":
    path_a = c1.text_input("Dump A", key="cmp_a", placeholder="folder written by `jlens dump`")
    path_b = c2.text_input("Dump B (reference)", key="cmp_b")
else:
    ss.setdefault("cmp_model_a", ctx.model_spec or "")
    ss.setdefault("cmp_model_b", ctx.model_spec or "")
    c1.text_input("Model A", key="cmp_model_a")
    c1.selectbox("Dtype A", ["bfloat16", "float32", "float16", "float64"], key="cmp_dtype_a")
    c2.text_input("Model B (reference)", key="cmp_model_b")
    c2.selectbox("Dtype B", ["float32", "float64", "bfloat16", "float16"], key="cmp_dtype_b")
    ss.setdefault("cmp_prompt", "The capital of France is Paris. The capital of Italy is")
    st.text_input("Prompt", key="cmp_prompt")
    ss.setdefault("cmp_ops", ["residual"])
    st.multiselect("Ops", ["residual", "attn", "mlp"], key="cmp_ops",
                   help="attention / MLP outputs where the model layout names them")
t1, t2, _ = st.columns([1, 1, 2])
atol = t1.number_input("atol", 0.0, 1e6, 1e-4, format="%.2e", key="cmp_atol")
rtol = t2.number_input("rtol", 0.0, 1e6, 1e-3, format="%.2e", key="cmp_rtol")


def _make_dump(spec: str, dtype: str, prompt: str, ops: list[str]) -> str:
    digest = hashlib.sha256(json.dumps([spec, dtype, prompt, sorted(ops), ss.get("device")]).encode()).hexdigest()
    folder = common.runs_dir() / "dumps" / digest[:16]
    if not (folder / "manifest.jsonl").is_file():
        model = cache.load_model_cached(common.confine_spec(spec, "model folder"), ss.get("device") or "auto", dtype)
        dump_hidden_states(model, prompt, folder, ops=ops, extra_settings={"model_spec": spec}, overwrite=True)
    return str(folder)


if st.button("Compare", type="primary", icon=":material/compare_arrows:", key="cmp_go"):
    with common.guard("Could not compare"):
        if how == "load":
            if not path_a.strip() or not path_b.strip():
                raise ValueError("Give both dump folders.")
            a, b = (str(common.confine(p.strip(), "dump folder")) for p in (path_a, path_b))
        else:
            if not ss.cmp_prompt.strip():
                raise ValueError("The prompt is empty.")
            if not ss.cmp_model_a.strip() or not ss.cmp_model_b.strip():
                raise ValueError("Give both models.")
            with st.spinner("Dumping run A…"):
                a = _make_dump(ss.cmp_model_a.strip(), ss.cmp_dtype_a, ss.cmp_prompt, ss.cmp_ops or ["residual"])
            with st.spinner("Dumping run B…"):
                b = _make_dump(ss.cmp_model_b.strip(), ss.cmp_dtype_b, ss.cmp_prompt, ss.cmp_ops or ["residual"])
        ss.cmp_result = diff_dumps(load_dump(a), load_dump(b), atol=float(atol), rtol=float(rtol))

diff = ss.get("cmp_result")
if diff is not None:
    div = diff.first_divergence
    if div is None:
        st.success(f"Match: all {len(diff.table)} tensors within atol {diff.atol:g} / rtol {diff.rtol:g} "
                   f"({diff.n_tokens} tokens).")
    else:
        st.warning(div.describe())
    for key, (va, vb) in diff.settings.items():
        st.caption(f"{key}: A = `{va}`, B = `{vb}`")
    ops = sorted(dict.fromkeys(diff.table["op"]), key=lambda o: (o != "residual", o))  # residual first
    op = st.selectbox("Op", ops, key="cmp_op") if len(ops) > 1 else ops[0]
    curve = divergence_curve(diff, op)
    first = div.layer if div is not None and div.op == op else None
    st.plotly_chart(divergence_figure(curve, op=op, atol=diff.atol, first_layer=first), key="cmp_chart",
                    config={"displaylogo": False})
    st.dataframe(diff.table, hide_index=True, width="stretch")
