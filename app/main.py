"""The jlens app: ``streamlit run app/main.py`` (or ``jlens app``).

A multipage Streamlit app over ``jlens_core``: the sidebar (model, lens) is drawn here for every
page; the pages in ``app/views/`` read what it loaded from :func:`common.context`
(:mod:`sidebar`); :mod:`url_state` keeps the view in the URL.
"""

from __future__ import annotations

import sys
from pathlib import Path

_APP_DIR = str(Path(__file__).resolve().parent)
if _APP_DIR not in sys.path:  # `streamlit run` adds it; AppTest and other runners may not
    sys.path.insert(0, _APP_DIR)
_REPO_DIR = str(Path(__file__).resolve().parent.parent)
if _REPO_DIR not in sys.path and Path(_REPO_DIR, "jlens_core").is_dir():  # a source checkout not installed
    sys.path.append(_REPO_DIR)

import streamlit as st

import common
import launch_snapshot
import sidebar
import url_state

st.set_page_config(page_title="jlens", page_icon=":material/troubleshoot:", layout="wide")
st.html(common.STALE_CSS)  # style only: no element on the page, so later elements keep their places

PAGES = [
    st.Page("views/inspect.py", title="Inspect", icon=":material/grid_on:", url_path="inspect", default=True),
    st.Page("views/fit.py", title="Fit", icon=":material/model_training:", url_path="fit"),
    st.Page("views/tune.py", title="Tune", icon=":material/tune:", url_path="tune"),
    st.Page("views/jacobians.py", title="Jacobians", icon=":material/functions:", url_path="jacobians"),
    st.Page("views/evaluate.py", title="Evaluate", icon=":material/monitoring:", url_path="evaluate"),
    st.Page("views/study.py", title="Study", icon=":material/stacked_line_chart:", url_path="study"),
    st.Page("views/experiments.py", title="Experiments", icon=":material/science:", url_path="experiments"),
    st.Page("views/compare.py", title="Compare runs", icon=":material/difference:", url_path="compare"),
]

if "token" in st.query_params:  # the access token (app/access.py) never stays in a URL a visitor shares
    del st.query_params["token"]
url_state.init_state()
page = st.navigation(PAGES)
if launch_snapshot.draw_while_loading(page):  # the last launch's first heatmap, drawn while the model loads
    st.rerun()
# A browser fetches and compiles the chart and table components (Plotly's is 4.7 MB of JavaScript)
# the first time a page shows one: seconds on a small machine. A session's first run shows a blank
# chart and table while the sidebar loads the model, so that happens during the load, not after it.
# The slot is made on every run, so that the page's elements keep their places (Streamlit matches
# elements across runs by position: a slot on the first run only would rebuild the page on the second).
preload = st.empty()
if common.first_run_of_session():
    with preload.container(height=1, border=False):
        common.preload_components()
try:
    sidebar.sidebar()
finally:  # also when the sidebar raises or stops the run
    preload.empty()
try:
    page.run()
except Exception as exc:  # noqa: BLE001 - a bug in a page shows as a message; the app stays usable
    common.show_unexpected("This page failed", exc)
finally:
    url_state.sync_query_params()
