"""What every page of the jlens app shares: settings, paths, the loaded :class:`Context`, and :func:`guard`.

Pages stay thin: they read the :class:`Context` that :func:`sidebar.sidebar` builds (the loaded model
and lenses), call ``jlens_core`` for every number, draw with :mod:`jlens_core.figures`, and wrap what may fail in
:func:`guard`. The rest of the app's shared code has its own module: :mod:`cache` (cached loaders and
readings), :mod:`lens_slots` (the lens pickers), :mod:`sidebar`, and :mod:`url_state` (the view kept
in the URL).
"""

from __future__ import annotations

import hashlib
import json
import os
import traceback
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import streamlit as st

from jlens_core.files import assets_dir, atomic_write
from jlens_core.lenses.header import LensFileError
from jlens_core.lenses.kinds import BASELINE, BY_KIND, PLAIN, SINGLE_KINDS, TRAINED
from jlens_core.lenses.lens import JacobianLens, LogitLens
from jlens_core.models.loading import DEFAULT_MODEL
from jlens_core.reading.generation import MAX_NEW_TOKENS
from jlens_core.workspace import Workspace, sanitise_filename

ASSETS = assets_dir()  # the checkout's assets/, or the installed package data

EXAMPLES_FILE = ASSETS / "example_prompts.json"

ENV_MODEL = "JLENS_APP_MODEL"  # the model preselected when the URL names none
ENV_LENS = "JLENS_APP_LENS"  # the lens preselected when the URL names none
ENV_RUNS = "JLENS_RUNS_DIR"  # where the Fit page keeps its runs

# Inspect's lens modes: one lens, two of them (side by side, difference: the pair picked) or every loaded lens
# ("three": the name a shared URL keeps; its label counts the lenses)
# (a lens loaded by name, e.g. "J++" or an added file's lens, is a mode of its own too)
# the built-in slots' lens names in Context.lenses(), in panel order (expert and added lenses follow, by name)
LENS_KINDS = SINGLE_KINDS  # ("logit", "jacobian", "relevance", "tuned"): the kinds that are no expert lens
MODES = {kind: BY_KIND[kind].label for kind in LENS_KINDS} | {"side": "Side by side", "diff": "Difference",
                                                              "three": "All lenses"}
VOCABS = {"all": "every token", "word": "word tokens only"}  # the readout (jlens_core.reading.word_readout)
STATS = {"top1_prob": "Top-1 probability", "entropy_bits": "Entropy (bits)", "kl_bits": "KL to final (bits)",
         "ce_bits": "Cross-entropy of the next token (bits)", "next_token_rank": "Rank of the next token",
         "final_top1_rank": "Rank of the final top-1"}
MAX_GEN_TOKENS = MAX_NEW_TOKENS  # the Generate control's range
MAX_TOKENS = 1024  # Inspect truncates prompts to this many tokens
DEFAULT_WINDOW = 256  # positions Inspect shows at first for a long prompt (the last ones)
# Inspect's widgets before the user touches them (also what warm_up reads the default prompt with)
INSPECT_DEFAULTS = {"chat": False, "top_k": 10, "pinned": "", "stride": 1, "show_ws": False, "word_like": False,
                    "vocab_word": False, "gen_n": 0, "gen_temp": 0.0, "gen_seed": 0, "mc_word_like": False,
                    "cell_text": "top-1"}
DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# Widget values kept when the user moves to another page (Streamlit drops a widget's state when
# the widget is not drawn; writing it back each run keeps it).
PERSISTENT_KEYS = ("prompt", "mode", "stat", "chat", "top_k", "pinned", "stride", "show_ws", "word_like", "vocab_word",
                   "eval_source", "eval_n", "fit_run", "gen_n", "gen_temp", "gen_seed", "band",
                   "mc_word_like", "iv_op", "iv_token", "iv_replacement", "iv_strength", "iv_alpha", "iv_layers",
                   "iv_pos_mode", "iv_pos_range", "iv_on_generated", "iv_new", "iv_edited_heatmap", "iv_centred", "iv_lens",
                   "pair_a", "pair_b", "fit_rules", "st_sets", "st_k", "st_n", "st_filter", "st_path", "stability",
                   "cell_text")
# (the lens slots' path boxes are kept too: url_state adds them, one per slot)
# A rerun dims the last run's elements with a 1 s opacity fade (from 0.5 s in), and expanders fade their
# borders: Chromium without a GPU repaints the page every frame of it, on the cores the run's matrix
# products need (a new prompt's redraw took 0.3-0.5 s longer). The same dimming, in one step at 1 s.
STALE_CSS = """<style>
.stElementContainer[data-stale="true"] { transition: opacity 0s linear 1s !important; }
[data-testid="stExpander"] details, [data-testid="stExpander"] summary { transition-duration: 0s !important; }
</style>"""
STUDY_URL_KEYS = ("sets", "set_path", "k", "n", "filter")  # the Study page's part of the URL (url_state)
READING_ONLY = "Opened from a reading file: load the model to read new prompts."  # what is disabled, and why
EXPECTED_ERRORS = (ValueError, FileNotFoundError, LensFileError, KeyError, OSError)
ENV_MAX_FITS = "JLENS_APP_MAX_FITS"  # fits running at once, at most (`jlens app --max-fits`)


# -- examples ----------------------------------------------------------------------------------
@st.cache_data(show_spinner=False)
def example_prompts() -> list[dict]:
    """``[{"label", "prompt", "chat"}]`` from ``assets/example_prompts.json`` (empty if missing)."""
    try:
        items = json.loads(EXAMPLES_FILE.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [{"label": str(i["label"]), "prompt": str(i["prompt"]), "chat": bool(i.get("chat", False))}
            for i in items if isinstance(i, dict) and i.get("prompt")]


def default_prompt() -> str:
    examples = example_prompts()
    return examples[0]["prompt"] if examples else "The capital of France is Paris. The capital of Italy is"


# -- paths -------------------------------------------------------------------------------------
def workspace() -> Workspace:
    """Where every path a visitor types must resolve (``docs/security.md``).

    The workspace of ``jlens app`` (``$JLENS_APP_WORKSPACE``, default ``./runs``), the runs folder
    the operator set (``$JLENS_RUNS_DIR``) and the package's shipped assets (lenses, eval sets).
    """
    extra = [ASSETS]
    if os.environ.get(ENV_RUNS):
        extra.append(Path(os.environ[ENV_RUNS]).expanduser())
    return Workspace.from_env(extra_roots=extra)


def confine(path: str, what: str, base: Path | None = None) -> Path:
    """A typed path, resolved and checked against :func:`workspace` (raises :class:`OutsideWorkspaceError`)."""
    return workspace().confine(path, what, base=base)


def confine_spec(spec: str, what: str) -> str:
    """A model or corpus spec: a path is confined and made absolute; an id or ``hf://`` spec passes as it is."""
    return workspace().confine_spec(spec, what)


def runs_dir() -> Path:
    """The Fit page's runs: ``$JLENS_RUNS_DIR``, else the workspace (``./runs``)."""
    env = os.environ.get(ENV_RUNS)
    path = Path(env).expanduser() if env else workspace().root
    path.mkdir(parents=True, exist_ok=True)
    return path


def uploads_dir() -> Path:
    """Where uploaded files are kept: ``<runs>/uploads``."""
    path = runs_dir() / "uploads"
    path.mkdir(parents=True, exist_ok=True)
    return path


def max_fits() -> int:
    """How many fits may run at once (``$JLENS_APP_MAX_FITS``, default 1)."""
    try:
        return max(1, int(os.environ.get(ENV_MAX_FITS) or 1))
    except ValueError:
        return 1


def tuned_runs_dir() -> Path:
    """Where the Tune page writes its tuned lenses (``<runs>/tuned``)."""
    path = runs_dir() / "tuned"
    path.mkdir(parents=True, exist_ok=True)
    return path


def tuned_run_name(model: Any) -> str:
    """A file-name stem for the model: a local folder's name, or a Hub id with ``/`` as ``--``."""
    name = str(getattr(model, "name", "model"))
    if Path(name).exists():
        name = Path(name).resolve().name
    return name.replace("/", "--").replace(" ", "_")


def result_key(*parts: Any) -> str:
    """A short stable key of what a stored result was computed from (model, lenses, items, settings): a page
    shows its stored result only while the key still matches."""
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def save_upload(upload, suffix: str | None = None) -> Path:
    """An uploaded file kept under ``<runs>/uploads`` as ``<sha256 prefix>-<sanitised name>``.

    The name is the content's digest and the upload's own name made safe (:func:`sanitise_filename`), so
    no name a browser sends can leave the folder; ``suffix`` replaces the name's suffix when given.
    """
    data = upload.getvalue()
    digest = hashlib.sha256(data).hexdigest()[:16]
    name = sanitise_filename(upload.name, "upload")
    if suffix is not None:
        name = f"{Path(name).stem}{suffix}"
    path = uploads_dir() / f"{digest}-{name}"
    if not path.is_file():
        atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))
    return path


# -- errors ------------------------------------------------------------------------------------
def error_text(exc: BaseException) -> str:
    """An expected error's own sentence; anything else with its type (for a bug report)."""
    return str(exc) if isinstance(exc, EXPECTED_ERRORS) else f"{type(exc).__name__}: {exc}"


# -- the loaded state ---------------------------------------------------------------------------
@dataclass
class LoadedLens:
    """A lens a sidebar slot loaded (:mod:`lens_slots`)."""

    lens: Any
    key: str  # names this version of the lens in the reading caches (a rewritten file is another lens)
    label: str  # what the picker showed
    name: str = ""  # the lens's name in Context.lenses(), readings and figures (unique); "" = its slot's key


@dataclass
class Context:
    """What the sidebar loaded, for the pages."""

    model: Any = None
    model_spec: str = ""
    model_key: str = ""
    model_error: str | None = None
    logit: LogitLens | None = None
    # by slot key ("jacobian", "relevance", "jpp", "rpp", "tuned"; "extra<i>" for a lens added from a file), in
    # the sidebar's order
    loaded: dict[str, LoadedLens] = field(default_factory=dict)
    reading_file: Any = None  # a ReadingFile opened instead of a model (app/opened_reading.py)
    reading_error: str | None = None  # why the reading file asked for could not be opened

    @property
    def lens(self) -> JacobianLens | None:
        """The Jacobian lens, when one is loaded."""
        return self._lens(PLAIN)

    @property
    def lens_key(self) -> str:
        return self.loaded[PLAIN].key if PLAIN in self.loaded else ""

    @property
    def relevance(self) -> JacobianLens | None:
        """The R-lens (a Jacobian lens fitted with relevance rules), when one is loaded."""
        return self._lens("relevance")

    @property
    def tuned(self) -> Any:
        """The tuned lens, when one is loaded."""
        return self._lens(TRAINED)

    @property
    def tuned_key(self) -> str:
        return self.loaded[TRAINED].key if TRAINED in self.loaded else ""

    def _lens(self, key: str) -> Any:
        return self.loaded[key].lens if key in self.loaded else None

    def lenses(self) -> dict[str, Any]:
        """``{"logit": ..., "jacobian": ..., "relevance": ..., "J++": ..., "tuned": ..., "<extra>": ...}``: the logit
        lens and every lens loaded, by name (a slot's key, or the name of an expert lens or an added one)."""
        return {BASELINE: self.logit, **{item.name or key: item.lens for key, item in self.loaded.items()}}

    def lens_keys(self) -> dict[str, str]:
        """The cache key of every lens in :meth:`lenses`."""
        return {BASELINE: BASELINE, **{item.name or key: item.key for key, item in self.loaded.items()}}


def stability_default(lenses: Iterable[Any]) -> bool:
    """Whether Inspect's Stability toggle starts on: when some of ``lenses`` keeps split halves (docs/method.md
    §6.2). One rule for Inspect, the URL and the warm-up (whose cached readings must be Inspect's)."""
    from jlens_core.reading.stability import lens_halves

    return any(lens_halves(lens) is not None for lens in lenses)


def lens_label(name: str) -> str:
    """A lens's name as pages and figures show it: ``"Jacobian lens"`` for ``"jacobian"``; an expert or added
    lens's name is its label (``"J++"``, ``"my-lens (R)"``)."""
    from jlens_core.figures.labels import LENS_NAMES

    return LENS_NAMES.get(name, name)


def default_pair(ctx: Context) -> tuple[str, str]:
    """Inspect's default comparison: the logit lens and the model's default reading lens
    (``jlens_core.lenses.shipped.default_reading_lens``: the J lens, or the shipped variant that beat it) under
    the name the loaded lens goes by (an expert lens by its kind, "J++")."""
    from jlens_core.lenses.shipped import default_reading_lens

    name = getattr(ctx.model, "name", None) or DEFAULT_MODEL
    key = default_reading_lens(name)
    item = ctx.loaded.get(key)
    return "logit", (item.name or key) if item is not None else key


def context() -> Context:
    """The :class:`Context` of this run (built by :func:`sidebar.sidebar`)."""
    return st.session_state.get("_ctx") or Context()


def require_model() -> Context:
    """The context, or a notice and ``st.stop()`` when no model is loaded."""
    ctx = context()
    if ctx.model is None and (ctx.reading_file is not None or ctx.reading_error):
        st.info(READING_ONLY + " (Close the reading file in the sidebar.)")
        st.stop()
    if ctx.model is None:
        st.info("No model is loaded. Pick one in the sidebar: the embedded default "
                f"`{DEFAULT_MODEL}`, a Hugging Face id, a local folder or a `.gguf` file.")
        st.stop()
    return ctx


@contextmanager
def guard(what: str) -> Iterator[None]:
    """Show an error raised inside the block as a message (never a traceback) and go on.

    Expected errors (bad input: ``ValueError``, missing files, lens mismatches) show their
    sentence; anything else also shows its details in a collapsed box, for bug reports.
    """
    try:
        yield
    except EXPECTED_ERRORS as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        st.error(f"{what}: {message}")
    except Exception as exc:  # noqa: BLE001 - a bug shows as a message, the app stays usable
        show_unexpected(what, exc)


def show_unexpected(what: str, exc: BaseException) -> None:
    """An unexpected error: its sentence, and the details folded away (for a bug report)."""
    st.error(f"{what}: {type(exc).__name__}: {exc}")
    with st.expander("Details (for a bug report)"):
        st.code("".join(traceback.format_exception(exc)), language="text")


# -- shared by Inspect and the warm-up ---------------------------------------------------------
def shown_run(stored: dict | None, session_key: str, again: str, failed: str) -> dict | None:
    """The stored run of a Run-style button (``{"key", "result"}`` or ``{"key", "error"}``) for the current settings,
    or ``None`` after saying why there is none: nothing when ``st.session_state[session_key]`` holds no run yet,
    the caption ``again`` when it holds one for other settings, ``"{failed}: {error}"`` when the run failed."""
    if stored is None:
        if st.session_state.get(session_key):
            st.caption(again)
        return None
    if "error" in stored:
        st.error(f"{failed}: {stored['error']}")
        return None
    return stored


def view_layers(n_layers: int, band: tuple[int, int], stride: int) -> list[int]:
    """The heatmap's rows: every ``stride``-th layer of ``band``, and always the output layer."""
    lo, hi = (int(x) for x in band)
    return sorted(set(range(lo, hi + 1, int(stride))) | {n_layers - 1})


def default_positions(n_tokens: int) -> tuple[int, ...]:
    """The positions Inspect shows at first: all, or the last ``DEFAULT_WINDOW`` of a long prompt."""
    return tuple(range(max(0, n_tokens - DEFAULT_WINDOW), n_tokens))


# -- the page shell (main.py) ------------------------------------------------------------------
def first_run_of_session() -> bool:
    """True once per browser session: on its first script run."""
    if st.session_state.get("_components_preloaded"):
        return False
    st.session_state._components_preloaded = True
    return True


def preload_components() -> None:
    """A blank chart and table (the browser loads their components' code on first sight of one)."""
    import pandas as pd
    import plotly.graph_objects as go

    st.plotly_chart(go.Figure(layout={"height": 10, "margin": {"l": 0, "r": 0, "t": 0, "b": 0}}),
                    config={"staticPlot": True, "displayModeBar": False}, key="_preload_chart")
    st.dataframe(pd.DataFrame({"": []}), height=1)


# -- tokens ------------------------------------------------------------------------------------
def token_strings(model: Any, ids: list[int], show_whitespace: bool = False) -> list[str]:
    """Display strings of token ids (``jlens_core.reading.tokens``), e.g. for the prompt's own tokens."""
    from jlens_core.reading.tokens import TokenDisplay, display_ids

    return display_ids(TokenDisplay.for_model(model), ids, show_whitespace=show_whitespace)
