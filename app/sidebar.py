"""The sidebar every page shares: the model, then one picker per lens slot, then what is loaded.

:func:`sidebar` draws it and returns the :class:`common.Context` the pages read (also kept in the
session for :func:`common.context`). A model or lens that cannot load is said in the sidebar; the
app stays usable with what did load.
"""

from __future__ import annotations

from typing import Any

import streamlit as st

import opened_reading
from cache import load_model_cached
from common import DTYPES, Context, confine, confine_spec, error_text
from jlens_core.lenses.kinds import BASELINE, is_trained
from jlens_core.lenses.lens import LogitLens
from jlens_core.models.loading import DEFAULT_ALIASES, DEFAULT_MODEL
from lens_slots import SLOTS, draw_extras, draw_slot


def sidebar() -> Context:
    """Draw the sidebar (model, lenses, what is loaded) and return the loaded :class:`Context`."""
    ss = st.session_state
    ctx = Context()
    if opened_reading.opened(ctx):  # a reading file is open: shown without a model (app/opened_reading.py)
        ss._ctx = ctx
        return ctx
    _model_picker(ctx)
    sb = st.sidebar
    sb.markdown("### Lens")
    for slot in SLOTS:
        loaded = draw_slot(slot, ctx.model, ctx.model_spec)
        if loaded is not None:
            ctx.loaded[slot.key] = loaded
    for slot in SLOTS:
        if slot.key in ctx.loaded:
            sb.caption(slot.summary(ctx.loaded[slot.key].lens))
        elif ctx.model is not None and slot.empty_note:
            sb.info(slot.empty_note)
    sb.markdown("### More lenses")
    ctx.loaded.update(draw_extras(ctx.model, {"logit", *ctx.lenses()}))
    # the Jacobian-type lenses loaded (J, R, J++, R++, added): with one, Inspect starts side by side with the logit lens
    fitted_keys = "|".join(item.key for key, item in ctx.loaded.items() if not is_trained(item.lens))
    if ss.get("mode") is None:
        ss.mode = "side" if fitted_keys else BASELINE
    elif fitted_keys and ss.get("_lens_key") == "" and ss.mode == BASELINE:
        ss.mode = "side"  # a lens was just loaded: compare the two
    ss._lens_key = fitted_keys
    opened_reading.open_controls()
    ss._ctx = ctx
    return ctx


def _model_picker(ctx: Context) -> None:
    """The model box, device and dtype; loads the model into ``ctx`` (or says why it could not)."""
    ss, sb = st.session_state, st.sidebar
    sb.markdown("### Model")
    if ss.get("device") not in _device_options():
        ss.device = "auto"
    sb.text_input("Model", key="model_spec",
                  help=f"`{DEFAULT_MODEL}` (embedded, offline), a Hugging Face id, a local model folder or a .gguf file")
    c1, c2 = sb.columns(2)
    c1.selectbox("Device", _device_options(), key="device")
    c2.selectbox("Dtype", DTYPES, key="dtype")
    placement = _placement_fields()
    spec = (ss.get("model_spec") or "").strip()
    ctx.model_spec = spec
    if not spec:
        ctx.model_error = "Give a model: a name, a Hugging Face id, a folder or a .gguf file."
    else:
        key = f"{spec}|{ss.device}|{ss.dtype}" + ("|" + "|".join(placement) if any(placement) else "")
        failed = ss.setdefault("_failed_loads", {})
        if key in failed:  # not retried on every rerun (a hub look-up can be slow); Retry does
            ctx.model_error = failed[key]
        else:
            first = spec.lower() in DEFAULT_ALIASES
            note = " (the first launch converts the embedded GGUF: about a minute; later ones take seconds)" \
                if first else ""
            try:
                with sb.spinner(f"Loading {spec}{note}…"):
                    ctx.model = load_model_cached(confine_spec(spec, "model folder"), ss.device, ss.dtype,
                                                  *_checked_placement(placement, ss.device))
                ctx.model_key = key
                ctx.logit = LogitLens.for_model(ctx.model)
            except Exception as exc:  # noqa: BLE001 - a failed load is shown, the app stays usable
                ctx.model_error = failed[key] = f"Could not load the model {spec!r}: {error_text(exc)}"
    if ctx.model_error:
        sb.error(ctx.model_error)
        if ss.get("_failed_loads"):
            sb.button("Retry", key="retry_load", on_click=lambda: ss["_failed_loads"].clear())
    else:
        sb.caption(_model_summary(ctx.model))


def _placement_fields() -> tuple[str, str, str]:
    """The model's placement over devices (an expander): device map, max memory, offload folder, as typed."""
    ss = st.session_state
    typed = tuple((ss.get(k) or "").strip() for k in ("device_map", "max_memory", "offload_folder"))
    with st.sidebar.expander("Placement: larger than one device", expanded=any(typed)):
        st.text_input("Device map", key="device_map", placeholder="auto, or JSON",
                      help='`auto` (or balanced, sequential), or a JSON object of module names to devices, e.g. '
                           '`{"model.layers.0": "cuda:0", "lm_head": "disk"}`; leave the Device above at auto '
                           "(docs/models.md, sharded and offloaded models)")
        st.text_input("Max memory", key="max_memory", placeholder="0:20GiB,cpu:64GiB",
                      help="The budget per device (implies device map auto); each device given one must hold at "
                           "least one layer")
        st.text_input("Offload folder", key="offload_folder", placeholder="offload (in the workspace)",
                      help="Where weights that fit nowhere else are written (`disk`); a folder in the workspace")
    return tuple((ss.get(k) or "").strip() for k in ("device_map", "max_memory", "offload_folder"))  # type: ignore[return-value]


def _checked_placement(placement: tuple[str, str, str], device: str) -> tuple[str, str, str]:
    """The placement as :func:`load_model_cached` takes it, the offload folder confined to the workspace.

    Raises:
        PlacementError: settings that cannot work here (one sentence), before any weight is read.
    """
    from jlens_core.models.loading import placement_settings

    device_map, max_memory, offload = placement
    if not any(placement):
        return placement
    folder = str(confine(offload, "offload folder")) if offload else ""
    placement_settings(device=None if device == "auto" else device, device_map=device_map or None,
                       max_memory=max_memory or None, offload_folder=folder or None)
    return device_map, max_memory, folder


def _device_options() -> list[str]:
    import torch

    options = ["auto", "cpu"]
    if torch.cuda.is_available():
        options.append("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        options.append("mps")
    return options


def _model_summary(model: Any) -> str:
    return (f"**{model.name}** · {model.n_layers} layers · width {model.d_model} · vocab {model.vocab_size:,} · "
            f"{model.device!s} {str(model.dtype).replace('torch.', '')}")
