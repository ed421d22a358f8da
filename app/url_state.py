"""The view kept in the URL: query parameters seed a session and are written back after every run.

What a user sets up (``model``, ``lens``, ``rlens``, ``jpp``, ``rpp``, ``tuned``, ``extra``, ``prompt``, ``mode``,
``stat``, ``pair``, ``vocab``, ``centred``, ``iv_lens``, ``gen``, ``temp``, ``seed``, ``band``, ``pin``, ``stability``, ``cells``; the Study page's
``sets``, ``set_path``, ``k``, ``n``, ``filter``) is in the page's URL, so a
view can be shared and reloaded. Each lens slot (:data:`lens_slots.SLOTS`) has its own parameter, named by the slot;
``extra`` lists the lenses added from files (comma-separated paths or ``hf://`` specs). ``pair``, ``mode`` and
``iv_lens`` name lenses by their names (``jacobian``, ``J++``, ``my-lens (R)``): a name not loaded gives way.
An experiment's trial opens Inspect with its swap applied through the ``edit*`` keys (read once, then dropped).
"""

from __future__ import annotations

import logging
import os

import streamlit as st

import common
from jlens_core.models.loading import DEFAULT_MODEL
from lens_slots import EXTRA_PARAM, EXTRAS, SLOTS

log = logging.getLogger("jlens.app")
# Widget values kept across pages: the shared ones, and each lens slot's path box.
KEPT_KEYS = common.PERSISTENT_KEYS + tuple(slot.state("path") for slot in SLOTS)


def _query_value(name: str) -> str | None:
    value = st.query_params.get(name)
    return value if value else None


def init_state() -> None:
    """Seed the session from the URL (first run only) and keep page widgets' values across pages."""
    ss = st.session_state
    if not ss.get("_initialised"):
        ss.model_spec = _query_value("model") or os.environ.get(common.ENV_MODEL) or DEFAULT_MODEL
        ss.device = "auto"
        ss.dtype = "auto"
        for slot in SLOTS:  # applied by the slot's picker once the model is loaded
            ss[slot.state("request")] = _query_value(slot.param) or (os.environ.get(slot.env) if slot.env else None) \
                or "auto"
        ss[EXTRAS] = [x.strip() for x in (_query_value(EXTRA_PARAM) or "").split(",") if x.strip()]
        pair = (_query_value("pair") or "").split(",")
        if len(pair) == 2 and all(pair) and pair[0] != pair[1]:  # lens names: Inspect checks they are loaded
            ss.pair_a, ss.pair_b = pair
        ss.prompt = _query_value("prompt") or common.default_prompt()
        mode = _query_value("mode")
        ss.mode = mode if mode in common.MODES else None  # decided once the lens is known
        if mode and mode not in common.MODES:
            ss.mode_request = mode  # a lens's name (J++, an added lens): Inspect takes it once that lens is loaded
        if _query_value("iv_lens"):
            ss.iv_lens = _query_value("iv_lens")
        stat = _query_value("stat")
        ss.stat = stat if stat in common.STATS else "top1_prob"
        if _query_value("vocab") in common.VOCABS:
            ss.vocab_word = _query_value("vocab") == "word"
        if _query_value("centred") in ("0", "1"):
            ss.iv_centred = _query_value("centred") == "1"
        if _query_value("pin"):
            ss.pinned = _query_value("pin")
        if _query_value("stability") in ("0", "1"):  # else Inspect's default: on when a lens keeps halves
            ss.stability = _query_value("stability") == "1"
        if _query_value("cells") in ("top-1", "jspace"):  # what the heatmap's cells show
            ss.cell_text = _query_value("cells")
        _seed_generation_state(ss)
        _seed_study_state(ss)
        _seed_edit_link(ss)
        ss._initialised = True
    for key in KEPT_KEYS:
        if key in ss:
            ss[key] = ss[key]


def _seed_edit_link(ss) -> None:
    """An edit opened from a link (an experiment's trial: the keys of
    :data:`~jlens_core.experiments.links.EDIT_KEYS`): Inspect applies it once (``intervene.apply_link``); the keys
    leave the URL, which from then on describes the panel."""
    from jlens_core.experiments.links import EDIT_KEYS, edit_request

    if not _query_value("edit"):
        return
    try:
        ss.edit_request = edit_request({key: _query_value(key) for key in EDIT_KEYS})
    except ValueError as exc:
        ss.edit_request = str(exc)
    for key in EDIT_KEYS:
        if key in st.query_params:
            del st.query_params[key]


def _int_or(value: str | None, default: int | None) -> int | None:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


def _seed_generation_state(ss) -> None:
    """``gen`` (new tokens), ``temp``, ``seed`` and ``band`` (``lo-hi``) from the URL, when given."""
    gen = _int_or(_query_value("gen"), None)
    if gen is not None:
        ss.gen_n = max(0, min(gen, common.MAX_GEN_TOKENS))
    try:
        temp = float(_query_value("temp") or "nan")
        if temp >= 0:
            ss.gen_temp = min(temp, 2.0)
    except ValueError:
        pass
    seed = _int_or(_query_value("seed"), None)
    if seed is not None and seed >= 0:
        ss.gen_seed = seed
    band = (_query_value("band") or "").split("-")
    if len(band) == 2 and all(part.isdigit() for part in band):
        ss.band_request = (int(band[0]), int(band[1]))  # clamped to the model's layers by the page


def _seed_study_state(ss) -> None:
    """The Study page's ``sets`` (comma-separated shipped names), ``set_path``, ``k``, ``n`` and ``filter`` (0/1)."""
    from jlens_core.evaluation.passk import EVAL_SETS

    sets = [s for s in (_query_value("sets") or "").split(",") if s in EVAL_SETS]
    if sets or _query_value("sets") == "none":
        ss.st_sets = sets
    if _query_value("set_path"):
        ss.st_path = _query_value("set_path")
    k = _int_or(_query_value("k"), None)
    if k is not None and k >= 1:
        ss.st_k = min(k, 1000)
    n = _int_or(_query_value("n"), None)
    if n is not None and n >= 0:
        ss.st_n = n
    if _query_value("filter") in ("0", "1"):
        ss.st_filter = _query_value("filter") == "1"


def study_query() -> dict[str, str | None]:
    """The Study page's part of the URL, once the page has set it up (``None``: leave the key out)."""
    ss = st.session_state
    if "st_sets" not in ss:
        return {"sets": None, "set_path": None, "k": None, "n": None, "filter": None}
    return {"sets": ",".join(ss.st_sets) or "none", "set_path": (ss.get("st_path") or "").strip() or None,
            "k": str(int(ss.st_k)) if int(ss.get("st_k") or 10) != 10 else None,
            "n": str(int(ss.st_n)) if int(ss.get("st_n") or 0) else None,
            "filter": None if ss.get("st_filter", True) else "0"}


def generation_query() -> dict[str, str | None]:
    """The generation and band part of the URL (``None``: leave the key out)."""
    ss = st.session_state
    n = int(ss.get("gen_n") or 0)
    band = ss.get("band")
    return {"gen": str(n) if n else None,
            "temp": f"{float(ss.get('gen_temp') or 0):g}" if n and ss.get("gen_temp") else None,
            "seed": str(int(ss.get("gen_seed") or 0)) if n and ss.get("gen_temp") else None,
            "band": f"{int(band[0])}-{int(band[1])}" if band and ss.get("band_is_custom") else None}


def _stability_query(ctx) -> str | None:
    """``stability=1`` / ``0`` when the toggle differs from its default (on when a loaded lens keeps halves)."""
    value = st.session_state.get("stability")
    if value is None or ctx.model is None:
        return None
    default = common.stability_default(ctx.lenses().values())
    return None if bool(value) == default else ("1" if value else "0")


def sync_query_params() -> None:
    """Write the shareable state back into the URL."""
    ss = st.session_state
    ctx = common.context()
    wanted = {"model": ctx.model_spec or ss.get("model_spec") or DEFAULT_MODEL,
              **{slot.param: slot.url_value(ctx.model) for slot in SLOTS},
              EXTRA_PARAM: ",".join(ss.get(EXTRAS) or []) or None,
              "prompt": ss.get("prompt") or "", "mode": ss.get("mode") or "logit", "stat": ss.get("stat") or "top1_prob"}
    wanted.update(generation_query())
    wanted.update(study_query())
    wanted["pin"] = (ss.get("pinned") or "") or None
    wanted["vocab"] = "word" if ss.get("vocab_word") else None  # "all", the default, left out
    wanted["centred"] = "1" if ss.get("iv_centred") else None
    wanted["stability"] = _stability_query(ctx)
    wanted["cells"] = "jspace" if ss.get("cell_text") == "jspace" else None  # "top-1", the default, left out
    wanted["iv_lens"] = ss.get("iv_lens") if ss.get("iv_lens") not in (None, "jacobian") else None
    pair = (ss.get("pair_a"), ss.get("pair_b"))
    wanted["pair"] = ",".join(pair) if ss.get("mode") in ("side", "diff") and pair != common.default_pair(ctx) \
        and all(pair) else None
    try:
        for key, value in wanted.items():
            if value is None:
                if key in st.query_params:
                    del st.query_params[key]
            elif st.query_params.get(key) != value:
                st.query_params[key] = value
    except Exception as exc:  # noqa: BLE001 - the URL is a convenience; never fail a page on it
        log.debug("could not write query params: %s", exc)
