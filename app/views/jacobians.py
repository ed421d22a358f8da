"""Jacobians: norms, spectra and top singular directions of the loaded lens, and its fit diagnostics."""

from __future__ import annotations

import pandas as pd
import streamlit as st

import common
from jlens_core.figures.fitting import convergence_figure, layer_stats_figure, norm_heatmap, spectrum_figure
from jlens_core.figures.labels import LENS_NAMES
from jlens_core.fitting import diagnostics
from jlens_core.lenses import spectra
from jlens_core.lenses.kinds import KINDS, relevance_backward
from jlens_core.reading.singular_directions import top_directions

ss = st.session_state
ctx = common.require_model()
st.title("The Jacobians")
fitted = [k.kind for k in KINDS if k.fitted and not k.experts and k.kind in ctx.loaded]  # the J lens, the R-lens
if not fitted:
    st.info("No Jacobian lens is loaded (the logit lens is J = I everywhere). Pick the shipped lens or a lens "
            "file in the sidebar, or fit one on the Fit page.")
    st.stop()
if len(fitted) > 1:
    st.radio("Lens", fitted, key="jac_lens", format_func=LENS_NAMES.get, horizontal=True)
lens_name = ss.get("jac_lens") if ss.get("jac_lens") in fitted else fitted[0]
lens, lens_key = ctx.loaded[lens_name].lens, ctx.loaded[lens_name].key
st.caption(f"{LENS_NAMES[lens_name]}: {lens.describe()}. Each J_l is the average Jacobian of "
           "the target layer's residual with respect to layer l's residual (d × d)"
           + (", its backward under relevance rules (docs/method.md §9.1)." if relevance_backward(lens.rules) else "."))


@st.cache_resource(show_spinner=False, max_entries=8)
def _stats_and_spectra(_lens, lens_key: str) -> tuple[pd.DataFrame, dict]:
    """Every layer's statistics and singular values: computed once per lens file, then kept on disk by the
    library (:func:`~jlens_core.lenses.spectra.stored_stats_and_spectra`), so later visits and server starts
    read them."""
    return spectra.stored_stats_and_spectra(_lens, lens_key)


@st.cache_resource(show_spinner=False, max_entries=32)
def _directions(_model, model_key: str, _lens, lens_key: str, layer: int, n: int, k: int, ws: bool) -> pd.DataFrame:
    return top_directions(_model, _lens, layer, n_directions=n, top_k=k, show_whitespace=ws)


with st.spinner("Singular values of every layer…"):
    stats, singular_values = _stats_and_spectra(lens, lens_key)
st.subheader("Per layer")
st.plotly_chart(layer_stats_figure(stats), key="jac_stats", config={"displaylogo": False})
with st.expander("Table"):
    st.dataframe(stats, hide_index=True, width="stretch",
                 column_config={"fro_norm": st.column_config.NumberColumn("‖J‖F/√d", format="%.4f"),
                                "spectral_norm": st.column_config.NumberColumn("spectral norm", format="%.4f"),
                                "dist_identity": st.column_config.NumberColumn("‖J−I‖F/√d", format="%.4f"),
                                "effective_rank": st.column_config.NumberColumn("effective rank", format="%.1f"),
                                "stable_rank": st.column_config.NumberColumn("stable rank", format="%.2f")})

st.subheader("One layer")
layers = lens.source_layers
if ss.get("jac_layers") is None or not set(ss.jac_layers) <= set(layers):
    ss.jac_layers = [layers[0], layers[len(layers) // 2], layers[-1]] if len(layers) > 2 else list(layers)
    ss.jac_layers = sorted(set(ss.jac_layers))
st.multiselect("Layers", layers, key="jac_layers", help="spectra to overlay")
chosen = ss.jac_layers or [layers[-1]]
st.plotly_chart(spectrum_figure({layer: singular_values[layer] for layer in chosen}),
                key="jac_spectrum", config={"displaylogo": False})

d1, d2, d3 = st.columns(3)
if ss.get("jac_dir_layer") not in layers:
    ss.jac_dir_layer = chosen[0]
d1.selectbox("Directions of layer", layers, key="jac_dir_layer")
n_dirs = d2.slider("Directions", 1, 16, 5, key="jac_n")
top_k = d3.slider("Tokens per direction", 3, 20, 8, key="jac_k")
with common.guard("Could not decode the directions"):
    directions = _directions(ctx.model, ctx.model_key, lens, lens_key, int(ss.jac_dir_layer), int(n_dirs),
                             int(top_k), bool(ss.get("show_ws", False)))
    st.caption("J = U S Vᵀ. *Output* directions u_i (target-layer space) and *input* directions v_i (layer space) "
               "decoded through the unembedding; a singular vector's sign is arbitrary, so both signs are listed: "
               "the tokens that `unembed(c·x) − unembed(−c·x)` ranks highest (+) and lowest (−).")
    view = directions.assign(tokens=directions["tokens"].map(lambda ts: "  ".join(ts)))
    st.dataframe(view[["direction", "singular_value", "side", "sign", "tokens"]], hide_index=True, width="stretch",
                 column_config={"singular_value": st.column_config.NumberColumn("σ", format="%.4f"),
                                "tokens": st.column_config.TextColumn("top tokens", width="large")})

st.subheader("Fit diagnostics")
frame = diagnostics.diagnostics_frame(lens.diagnostics)
if frame.empty:
    st.caption("This lens file carries no fit diagnostics.")
else:
    conv = diagnostics.convergence_frame(frame)
    g1, g2 = st.columns(2)
    g1.plotly_chart(convergence_figure(conv, diagnostics.one_over_n_guide(conv)), key="jac_convergence",
                    config={"displaylogo": False})
    g2.plotly_chart(norm_heatmap(diagnostics.norm_matrix(frame)), key="jac_norms", config={"displaylogo": False})
