"""What every page of the jlens app shares: cached loaders, the sidebar, and the URL state.

Pages stay thin: they read the :class:`Context` that :func:`sidebar` builds (the loaded model and
lens), call ``jlens_core`` for every number, and draw with :mod:`charts`. Models, lenses and
prompt readings are cached as resources (``st.cache_resource``; readings per lens in one
:class:`ReadingStore`), so a rerun costs nothing.

URL query parameters hold what a user sets up (``model``, ``lens``, ``prompt``, ``mode``,
``stat``): they seed the session on first load and are written back after every run, so a view
can be shared and reloaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import streamlit as st

from jlens_core.files import assets_dir, atomic_write
from jlens_core.lenses.lens import JacobianLens, LensFileError, LogitLens
from jlens_core.models.loading import DEFAULT_ALIASES, DEFAULT_MODEL, load_model
from jlens_core.reading.generation import MAX_NEW_TOKENS
from jlens_core.workspace import Workspace, sanitise_filename

log = logging.getLogger("jlens.app")

APP_DIR = Path(__file__).resolve().parent
ASSETS = assets_dir()  # the checkout's assets/, or the installed package data
LENS_DIR = ASSETS / "lenses"
EXAMPLES_FILE = ASSETS / "example_prompts.json"

ENV_MODEL = "JLENS_APP_MODEL"  # the model preselected when the URL names none
ENV_LENS = "JLENS_APP_LENS"  # the lens preselected when the URL names none
ENV_RUNS = "JLENS_RUNS_DIR"  # where the Fit page keeps its runs

MODES = {"logit": "Logit lens", "jacobian": "Jacobian lens", "tuned": "Tuned lens", "side": "Side by side",
         "diff": "Difference", "three": "All three"}
LENS_KINDS = ("logit", "jacobian", "tuned")
STATS = {"top1_prob": "Top-1 probability", "entropy_bits": "Entropy (bits)", "kl_bits": "KL to final (bits)",
         "ce_bits": "Cross-entropy of the next token (bits)", "next_token_rank": "Rank of the next token",
         "final_top1_rank": "Rank of the final top-1"}
MAX_GEN_TOKENS = MAX_NEW_TOKENS  # the Generate control's range
MAX_TOKENS = 1024  # Inspect truncates prompts to this many tokens
DEFAULT_WINDOW = 256  # positions Inspect shows at first for a long prompt (the last ones)
# Inspect's widgets before the user touches them (also what warm_up reads the default prompt with)
INSPECT_DEFAULTS = {"chat": False, "top_k": 10, "pinned": "", "stride": 1, "show_ws": False, "word_like": False,
                    "gen_n": 0, "gen_temp": 0.0, "gen_seed": 0, "mc_word_like": False}
DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# Widget values kept when the user moves to another page (Streamlit drops a widget's state when
# the widget is not drawn; writing it back each run keeps it).
PERSISTENT_KEYS = ("prompt", "mode", "stat", "chat", "top_k", "pinned", "stride", "show_ws", "word_like",
                   "lens_path", "eval_source", "eval_n", "fit_run", "gen_n", "gen_temp", "gen_seed", "band",
                   "mc_word_like", "iv_op", "iv_token", "iv_replacement", "iv_strength", "iv_alpha", "iv_layers",
                   "iv_pos_mode", "iv_pos_range", "iv_on_generated", "iv_new", "iv_edited_heatmap", "pair_a", "pair_b",
                   "tuned_path")
# A rerun dims the last run's elements with a 1 s opacity fade (from 0.5 s in), and expanders fade their
# borders: Chromium without a GPU repaints the page every frame of it, on the cores the run's matrix
# products need (a new prompt's redraw took 0.3-0.5 s longer). The same dimming, in one step at 1 s.
STALE_CSS = """<style>
.stElementContainer[data-stale="true"] { transition: opacity 0s linear 1s !important; }
[data-testid="stExpander"] details, [data-testid="stExpander"] summary { transition-duration: 0s !important; }
</style>"""
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


def shipped_lens_path(model: Any) -> Path | None:
    """The lens shipped in ``assets/lenses/`` for ``model`` (by its name), or ``None``.

    Asks :func:`jlens_core.lenses.shipped.shipped_lens_path` (the default model's lens), then looks for
    ``assets/lenses/<model name>.safetensors``.
    """
    name = str(getattr(model, "name", "") or "")
    try:
        from jlens_core.lenses.shipped import shipped_lens_path as core_shipped

        found = core_shipped(name)
        if found is not None:
            return Path(found)
    except ImportError:  # an older jlens_core
        pass
    for candidate in dict.fromkeys([name, Path(name).name, name.replace("/", "--")]):
        if candidate:
            path = LENS_DIR / f"{candidate}.safetensors"
            if path.is_file():
                return path
    return None


# -- cached resources ---------------------------------------------------------------------------
@st.cache_resource(show_spinner=False, max_entries=3)
def load_model_cached(spec: str, device: str, dtype: str):
    """:func:`jlens_core.models.loading.load_model`, once per (spec, device, dtype) per server."""
    return load_model(spec, device=None if device == "auto" else device, dtype=None if dtype == "auto" else dtype)


@st.cache_resource(show_spinner=False, max_entries=12)
def load_lens_cached(path: str, mtime: float, size: int) -> JacobianLens:
    """:meth:`JacobianLens.load`, once per file version (path, mtime, size)."""
    return JacobianLens.load(path)


@st.cache_data(show_spinner="Fetching the lens from the Hub…", max_entries=16, ttl=3600)
def resolve_lens_cached(spec: str) -> str:
    """A lens spec as a local path (``hf://owner/repo[@revision]/path`` through the Hub cache), cached."""
    from jlens_core.lenses.hub import resolve_lens_path

    return str(resolve_lens_path(spec))


def _resolve_path_text(text: str, what: str) -> Path:
    """A typed lens path: ``hf://`` through the Hub cache, anything else confined to the workspace."""
    return Path(resolve_lens_cached(text)) if text.startswith("hf://") else confine(text, what)


@st.cache_resource(show_spinner=False, max_entries=6)
def load_tuned_cached(path: str, mtime: float, size: int):
    """:meth:`TunedLens.load` (a file or a tuned-lens folder), once per version."""
    from jlens_core.lenses.tuned import TunedLens

    return TunedLens.load(path)


class ReadingStore:
    """Prompt readings kept per lens (the least recently used dropped past ``capacity``).

    A page reads the lenses it draws together (:func:`jlens_core.reading.readings.read_prompts`: one
    forward pass, the shared final distribution), but keeps each lens's reading under its own key, so
    a later view of any one of them (another mode, the cell detail) finds it. A reading being
    computed in another thread (the server's warm-up, another session) is waited for, not redone.
    """

    def __init__(self, capacity: int = 48) -> None:
        self.capacity = capacity
        self._done: OrderedDict[tuple, Any] = OrderedDict()
        self._pending: dict[tuple, threading.Event] = {}
        self._lock = threading.Lock()

    def get(self, keys: dict[str, tuple], compute: Callable[[list[str]], dict[str, Any]]) -> dict[str, Any]:
        """``{name: reading}`` for ``keys`` (``{name: cache key}``); ``compute(names)`` reads the missing ones.

        An exception from ``compute`` propagates, and nothing is stored for its names.
        """
        while True:
            with self._lock:
                found = {}
                for name, key in keys.items():
                    if key in self._done:
                        self._done.move_to_end(key)
                        found[name] = self._done[key]
                waits = [self._pending[key] for name, key in keys.items() if name not in found and key in self._pending]
                if not waits:
                    missing = [name for name in keys if name not in found]
                    for name in missing:
                        self._pending[keys[name]] = threading.Event()
                    break
            for event in waits:  # another thread reads these; what it stored is found on the next pass
                event.wait()
        if missing:
            computed: dict[str, Any] = {}
            try:
                computed = compute(missing)
            finally:
                with self._lock:
                    for name in missing:
                        if name in computed:
                            self._done[keys[name]] = computed[name]
                        self._pending.pop(keys[name]).set()
                    while len(self._done) > self.capacity:
                        self._done.popitem(last=False)
            found.update(computed)
        return {name: found[name] for name in keys}


@st.cache_resource(show_spinner=False)
def reading_store() -> ReadingStore:
    """The server's one :class:`ReadingStore`."""
    return ReadingStore()


def readings_cached(model, model_key: str, lenses: dict[str, tuple[Any, str]], text: str | tuple, top_k: int,
                    pinned: tuple, show_ws: bool, word_like: bool, layers: tuple | None, positions: tuple | None,
                    max_seq_len: int, n_prompt: int | None = None, edits_key: str = "", edits=None) -> dict[str, Any]:
    """:func:`jlens_core.reading.readings.read_prompts` of ``lenses`` (``{name: (lens, lens key)}``), cached per lens.

    ``text`` is the prompt, or a tuple of token ids (a generation: the first ``n_prompt`` are the prompt);
    ``edits`` are residual edits to read under (named by ``edits_key``). Returns ``{name: PromptReading}``.
    """
    from jlens_core.reading.readings import read_prompts

    settings = (text, top_k, pinned, show_ws, word_like, layers, positions, max_seq_len, n_prompt, edits_key)
    keys = {name: (model_key, lens_key, *settings) for name, (_, lens_key) in lenses.items()}

    def compute(names: list[str]) -> dict[str, Any]:
        return read_prompts(model, {name: lenses[name][0] for name in names},
                            list(text) if isinstance(text, tuple) else text, top_k=top_k, pinned=pinned,
                            show_whitespace=show_ws, word_like=word_like, layers=None if layers is None else list(layers),
                            positions=None if positions is None else list(positions), max_seq_len=max_seq_len,
                            n_prompt=n_prompt, edits=edits)

    return reading_store().get(keys, compute)


def view_layers(n_layers: int, band: tuple[int, int], stride: int) -> list[int]:
    """The heatmap's rows: every ``stride``-th layer of ``band``, and always the output layer."""
    lo, hi = (int(x) for x in band)
    return sorted(set(range(lo, hi + 1, int(stride))) | {n_layers - 1})


def default_positions(n_tokens: int) -> tuple[int, ...]:
    """The positions Inspect shows at first: all, or the last ``DEFAULT_WINDOW`` of a long prompt."""
    return tuple(range(max(0, n_tokens - DEFAULT_WINDOW), n_tokens))


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


def warm_up(spec: str | None = None) -> list[str]:
    """Fill the resource caches a first visit reads, before any browser connects.

    Run by ``app/serve.py`` in a thread of the server process: the model (``JLENS_APP_MODEL`` or
    the default, device and dtype "auto"), its shipped Jacobian lens, and the readings of the
    default prompt with Inspect's default settings (:data:`INSPECT_DEFAULTS`), under the same cache
    keys the pages use, so the first heatmap is drawn from the cache. A URL naming another model,
    lens or prompt simply computes its own. Returns what it loaded, for the log.
    """
    spec = spec or os.environ.get(ENV_MODEL) or DEFAULT_MODEL
    model = load_model_cached(confine_spec(spec, "model folder"), "auto", "auto")
    done = [f"model {spec}"]
    lenses = {"logit": (LogitLens.for_model(model), "logit")}
    lens_request = os.environ.get(ENV_LENS) or "auto"
    if lens_request in ("auto", "shipped"):
        lens_path = shipped_lens_path(model)
    elif lens_request in ("none", "file", "upload") or lens_request.startswith(("run:", "hf://")):
        lens_path = None  # nothing to warm, or a fetch better left to the page (it shows its progress)
    else:
        lens_path = confine(lens_request, "lens file")
    if lens_path is not None and lens_path.is_file():
        lens, lens_key = _load_versioned(load_lens_cached, lens_path, lens_path, model)
        lenses["jacobian"] = (lens, lens_key)
        done.append(f"lens {lens_path.name}")
    text = default_prompt()
    n_tokens = min(int(model.encode(text).shape[1]), MAX_TOKENS)
    layers = tuple(view_layers(model.n_layers, (0, model.n_layers - 1), INSPECT_DEFAULTS["stride"]))
    readings_cached(model, f"{spec}|auto|auto", lenses, text, INSPECT_DEFAULTS["top_k"], (),
                    INSPECT_DEFAULTS["show_ws"], INSPECT_DEFAULTS["word_like"], layers,
                    default_positions(n_tokens), MAX_TOKENS, None, "", None)
    done.append(f"{' and '.join(lenses)} readings of the default prompt")
    return done


# -- the loaded state ---------------------------------------------------------------------------
@dataclass
class Context:
    """What the sidebar loaded, for the pages."""

    model: Any = None
    model_spec: str = ""
    model_key: str = ""
    model_error: str | None = None
    lens: JacobianLens | None = None
    lens_key: str = ""
    lens_label: str = "none"
    lens_error: str | None = None
    logit: LogitLens | None = None
    tuned: Any = None
    tuned_key: str = ""
    tuned_label: str = "none"
    tuned_error: str | None = None

    @property
    def has_lens(self) -> bool:
        return self.lens is not None

    def lenses(self) -> dict[str, Any]:
        """``{"logit": ..., "jacobian": ..., "tuned": ...}`` (the Jacobian and tuned lenses when loaded)."""
        out: dict[str, Any] = {"logit": self.logit}
        if self.lens is not None:
            out["jacobian"] = self.lens
        if self.tuned is not None:
            out["tuned"] = self.tuned
        return out

    def lens_keys(self) -> dict[str, str]:
        return {"logit": "logit", "jacobian": self.lens_key, "tuned": self.tuned_key}


def context() -> Context:
    """The :class:`Context` of this run (built by :func:`sidebar`)."""
    return st.session_state.get("_ctx") or Context()


def require_model() -> Context:
    """The context, or a notice and ``st.stop()`` when no model is loaded."""
    ctx = context()
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


# -- session & URL state -----------------------------------------------------------------------
def _query_value(name: str) -> str | None:
    value = st.query_params.get(name)
    return value if value else None


def init_state() -> None:
    """Seed the session from the URL (first run only) and keep page widgets' values across pages."""
    ss = st.session_state
    if not ss.get("_initialised"):
        ss.model_spec = _query_value("model") or os.environ.get(ENV_MODEL) or DEFAULT_MODEL
        ss.device = "auto"
        ss.dtype = "auto"
        ss.lens_request = _query_value("lens") or os.environ.get(ENV_LENS) or "auto"
        ss.tuned_request = _query_value("tuned") or "auto"
        pair = (_query_value("pair") or "").split(",")
        if len(pair) == 2 and all(x in LENS_KINDS for x in pair) and pair[0] != pair[1]:
            ss.pair_a, ss.pair_b = pair
        ss.prompt = _query_value("prompt") or default_prompt()
        mode = _query_value("mode")
        ss.mode = mode if mode in MODES else None  # decided once the lens is known
        stat = _query_value("stat")
        ss.stat = stat if stat in STATS else "top1_prob"
        _seed_generation_state(ss)
        ss._initialised = True
    for key in PERSISTENT_KEYS:
        if key in ss:
            ss[key] = ss[key]


def _int_or(value: str | None, default: int | None) -> int | None:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


def _seed_generation_state(ss) -> None:
    """``gen`` (new tokens), ``temp``, ``seed`` and ``band`` (``lo-hi``) from the URL, when given."""
    gen = _int_or(_query_value("gen"), None)
    if gen is not None:
        ss.gen_n = max(0, min(gen, MAX_GEN_TOKENS))
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


def generation_query() -> dict[str, str | None]:
    """The generation and band part of the URL (``None``: leave the key out)."""
    ss = st.session_state
    n = int(ss.get("gen_n") or 0)
    band = ss.get("band")
    return {"gen": str(n) if n else None,
            "temp": f"{float(ss.get('gen_temp') or 0):g}" if n and ss.get("gen_temp") else None,
            "seed": str(int(ss.get("gen_seed") or 0)) if n and ss.get("gen_temp") else None,
            "band": f"{int(band[0])}-{int(band[1])}" if band and ss.get("band_is_custom") else None}


def sync_query_params() -> None:
    """Write the shareable state back into the URL."""
    ss = st.session_state
    ctx = context()
    lens_value = ss.get("lens_choice") or "none"
    if lens_value == "file":
        lens_value = ss.get("lens_path") or "none"
    wanted = {"model": ctx.model_spec or ss.get("model_spec") or DEFAULT_MODEL, "lens": lens_value,
              "prompt": ss.get("prompt") or "", "mode": ss.get("mode") or "logit", "stat": ss.get("stat") or "top1_prob"}
    wanted.update(generation_query())
    tuned_value = ss.get("tuned_choice") or "none"
    if tuned_value == "file":
        tuned_value = ss.get("tuned_path") or "none"
    wanted["tuned"] = tuned_value if tuned_value != "none" else None
    pair = (ss.get("pair_a"), ss.get("pair_b"))
    wanted["pair"] = ",".join(pair) if ss.get("mode") in ("side", "diff") and pair != ("logit", "jacobian") \
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


# -- the sidebar ----------------------------------------------------------------------------------
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


def lens_summary(lens: JacobianLens) -> str:
    """One line about a fitted lens: prompts, layers, target and the settings that shape it."""
    s = lens.settings
    layers = lens.source_layers
    span = f"{layers[0]}..{layers[-1]}" if len(layers) > 1 else str(layers[0])
    parts = [f"{lens.n_prompts} prompts", f"layers {span} → {lens.target_layer}"]
    for key in ("max_seq_len", "skip_first", "corpus"):
        if s.get(key) is not None:
            parts.append(f"{key} {s[key]}")
    if lens.shrinkage:
        parts.append(f"shrinkage {lens.shrinkage:g}")
    if lens.stop_reason:
        parts.append("stopped early")
    return " · ".join(parts)


def finished_runs(model: Any, spec: str) -> list[dict]:
    """Lenses fitted by the Fit page (in :func:`runs_dir`) for this model: ``[{"name", "path", "n"}]``."""
    import runs

    out = []
    for run in runs.list_runs(runs_dir()):
        if run.state != "done" or not run.lens_path.is_file():
            continue
        if run.model_spec not in (spec, getattr(model, "name", None)) and \
                run.status.get("model") not in (spec, getattr(model, "name", None)):
            continue
        out.append({"name": run.name, "path": run.lens_path, "n": run.status.get("n_done")})
    return out


def _lens_options(model: Any, spec: str) -> tuple[list[str], dict[str, str], dict[str, Path]]:
    options, labels, paths = ["none"], {"none": "None: logit lens only"}, {}
    shipped = shipped_lens_path(model) if model is not None else None
    if shipped is not None:
        options.append("shipped")
        labels["shipped"] = f"Shipped lens ({shipped.name})"
        paths["shipped"] = shipped
    if model is not None:
        for run in finished_runs(model, spec):
            key = f"run:{run['name']}"
            options.append(key)
            labels[key] = f"Fitted here: {run['name']}" + (f" ({run['n']} prompts)" if run["n"] else "")
            paths[key] = run["path"]
    options += ["file", "upload"]
    labels["file"] = "Lens file (path)…"
    labels["upload"] = "Upload a lens file…"
    return options, labels, paths


def _resolve_lens_request(request: str, options: list[str]) -> str:
    ss = st.session_state
    if request == "auto":
        return "shipped" if "shipped" in options else "none"
    if request in options:
        return request
    if request.startswith("run:") or request in ("shipped", "upload"):
        return "shipped" if "shipped" in options else "none"
    ss.lens_path = request
    return "file"


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


def _save_upload(upload) -> Path:
    return save_upload(upload, ".safetensors")


def _error_text(exc: BaseException) -> str:
    """An expected error's own sentence; anything else with its type (for a bug report)."""
    return str(exc) if isinstance(exc, EXPECTED_ERRORS) else f"{type(exc).__name__}: {exc}"


def _load_versioned(loader, path: Path, probe: Path, model: Any) -> tuple[Any, str]:
    """``loader(path, mtime, size)`` (cached per file version) checked against ``model``, and its key."""
    stat = probe.stat()
    lens = loader(str(path), stat.st_mtime, stat.st_size)
    lens.check_model(model)
    return lens, f"{path}|{stat.st_mtime}|{stat.st_size}"


def _load_lens_file(ctx: Context, path: Path, label: str) -> None:
    try:
        if not path.is_file():
            raise FileNotFoundError(f"No lens file at {str(path)!r}.")
        ctx.lens, ctx.lens_key = _load_versioned(load_lens_cached, path, path, ctx.model)
    except Exception as exc:  # noqa: BLE001 - a failed load is shown, the app stays usable
        ctx.lens_error = _error_text(exc)
        return
    ctx.lens_label = label


def sidebar() -> Context:
    """Draw the sidebar (model, lens, what is loaded) and return the loaded :class:`Context`."""
    ss = st.session_state
    ctx = Context()
    sb = st.sidebar
    sb.markdown("### Model")
    if ss.get("device") not in _device_options():
        ss.device = "auto"
    sb.text_input("Model", key="model_spec",
                  help=f"`{DEFAULT_MODEL}` (embedded, offline), a Hugging Face id, a local model folder or a .gguf file")
    c1, c2 = sb.columns(2)
    c1.selectbox("Device", _device_options(), key="device")
    c2.selectbox("Dtype", DTYPES, key="dtype")
    spec = (ss.get("model_spec") or "").strip()
    ctx.model_spec = spec
    if not spec:
        ctx.model_error = "Give a model: a name, a Hugging Face id, a folder or a .gguf file."
    else:
        key = f"{spec}|{ss.device}|{ss.dtype}"
        failed = ss.setdefault("_failed_loads", {})
        if key in failed:  # not retried on every rerun (a hub look-up can be slow); Retry does
            ctx.model_error = failed[key]
        else:
            first = spec.lower() in DEFAULT_ALIASES
            note = " (the first launch converts the embedded GGUF: about a minute; later ones take seconds)" \
                if first else ""
            try:
                with sb.spinner(f"Loading {spec}{note}…"):
                    ctx.model = load_model_cached(confine_spec(spec, "model folder"), ss.device, ss.dtype)
                ctx.model_key = key
                ctx.logit = LogitLens.for_model(ctx.model)
            except Exception as exc:  # noqa: BLE001 - a failed load is shown, the app stays usable
                ctx.model_error = failed[key] = f"Could not load the model {spec!r}: {_error_text(exc)}"
    if ctx.model_error:
        sb.error(ctx.model_error)
        if ss.get("_failed_loads"):
            sb.button("Retry", key="retry_load", on_click=lambda: ss["_failed_loads"].clear())
    else:
        sb.caption(_model_summary(ctx.model))

    sb.markdown("### Lens")
    options, labels, paths = _lens_options(ctx.model, spec)
    if "lens_request" in ss and ctx.model is not None:  # the URL's lens, once the model is there
        ss.lens_choice = _resolve_lens_request(ss.pop("lens_request"), options)
    if ss.get("lens_choice") not in options:
        ss.lens_choice = _resolve_lens_request("auto", options)
    sb.selectbox("Lens", options, key="lens_choice", format_func=lambda o: labels.get(o, o),
                 disabled=ctx.model is None)
    choice = ss.lens_choice
    if ctx.model is not None:
        if choice in paths:
            _load_lens_file(ctx, paths[choice], labels[choice])
        elif choice == "file":
            sb.text_input("Lens file", key="lens_path", placeholder="/path/to/lens.safetensors or hf://owner/repo/lens.pt",
                          help="A lens file (jlens or the reference's .pt), or hf://owner/repo[@revision]/path on the "
                               "Hugging Face Hub (its cache; HF_HUB_OFFLINE honoured).")
            path_text = (ss.get("lens_path") or "").strip()
            if path_text:
                try:
                    _load_lens_file(ctx, _resolve_path_text(path_text, "lens file"), Path(path_text).name)
                except EXPECTED_ERRORS as exc:
                    ctx.lens_error = str(exc)
        elif choice == "upload":
            upload = sb.file_uploader("Lens file", type=["safetensors", "pt"], key="lens_upload")
            if upload is not None:
                _load_lens_file(ctx, _save_upload(upload), upload.name)
    if ctx.lens_error:
        sb.error(f"Could not load the lens: {ctx.lens_error}")
    _tuned_picker(ctx, sb)
    if ctx.lens is not None:
        sb.caption(f"**Jacobian lens** · {lens_summary(ctx.lens)}")
    elif ctx.model is not None:
        sb.info("No Jacobian lens loaded: the logit lens only. Fit one on the Fit page or load a lens file.")
    if ctx.tuned is not None:
        sb.caption(f"**Tuned lens** · {tuned_summary(ctx.tuned)}")
    if ctx.tuned_error:
        sb.error(f"Could not load the tuned lens: {ctx.tuned_error}")
    if ss.get("mode") is None:
        ss.mode = "side" if ctx.lens is not None else "logit"
    elif ctx.lens is not None and ss.get("_lens_key") == "" and ss.mode == "logit":
        ss.mode = "side"  # a lens was just loaded: compare the two
    ss._lens_key = ctx.lens_key
    ss._ctx = ctx
    return ctx


def tuned_summary(lens: Any) -> str:
    """One line about a tuned lens: layers, training, held-out KL."""
    layers = lens.source_layers
    parts = [f"layers {layers[0]}..{layers[-1]} → {lens.target_layer}" if layers else "no layers"]
    s = lens.settings
    if s.get("source") == "tuned-lens":
        parts.append("tuned-lens format")
    if s.get("steps"):
        parts.append(f"{s['steps']} steps × {s.get('tokens_per_step', '?')} tokens")
    kl = (lens.metrics or {}).get("heldout_kl_bits")
    if kl:
        parts.append(f"held-out KL {sum(kl.values()) / len(kl):.2f} bits")
    return " · ".join(parts)


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


def _tuned_options(model: Any) -> tuple[list[str], dict[str, str], dict[str, Path]]:
    from jlens_core.lenses.shipped import shipped_tuned_lens_path

    options, labels, paths = ["none"], {"none": "None"}, {}
    shipped = shipped_tuned_lens_path(getattr(model, "name", "")) if model is not None else None
    if shipped is not None:
        options.append("shipped")
        labels["shipped"] = f"Shipped tuned lens ({shipped.name})"
        paths["shipped"] = shipped
    if model is not None:
        for path in sorted(tuned_runs_dir().glob(f"{tuned_run_name(model)}*.safetensors")):
            key = f"run:{path.stem}"
            options.append(key)
            labels[key] = f"Trained here: {path.stem}"
            paths[key] = path
    options += ["file", "upload"]
    labels["file"] = "Tuned lens file or folder (path)…"
    labels["upload"] = "Upload a tuned lens file…"
    return options, labels, paths


def _load_tuned_file(ctx: Context, path: Path, label: str) -> None:
    try:
        probe = path / "params.pt" if path.is_dir() else path
        if not probe.exists():
            from jlens_core.lenses.tuned import TunedLens

            TunedLens.load(path)  # raises the sentence that says what is missing
        ctx.tuned, key = _load_versioned(load_tuned_cached, path, probe, ctx.model)
    except Exception as exc:  # noqa: BLE001 - a failed load is shown, the app stays usable
        ctx.tuned_error = _error_text(exc)
        return
    ctx.tuned_label, ctx.tuned_key = label, f"tuned|{key}"


def _tuned_picker(ctx: Context, sb) -> None:
    ss = st.session_state
    if ctx.model is None:
        return
    options, labels, paths = _tuned_options(ctx.model)
    if "tuned_request" in ss:
        request = ss.pop("tuned_request")
        if request == "auto" or request.startswith("run:") and request not in options:
            request = "none"
        if request not in options:
            ss.tuned_path, request = request, "file"
        ss.tuned_choice = request
    if ss.get("tuned_choice") not in options:
        ss.tuned_choice = "none"
    sb.selectbox("Tuned lens", options, key="tuned_choice", format_func=lambda o: labels.get(o, o),
                 help="A third lens to compare: affine translators trained on the model's own output (Tune page), "
                      "a jlens tuned-lens file, or a folder in tuned-lens's format (config.json + params.pt).")
    choice = ss.tuned_choice
    if choice in paths:
        _load_tuned_file(ctx, paths[choice], labels[choice])
    elif choice == "file":
        sb.text_input("Tuned lens path", key="tuned_path", placeholder="/path/to/tuned.safetensors or folder")
        text = (ss.get("tuned_path") or "").strip()
        if text:
            try:
                _load_tuned_file(ctx, _resolve_path_text(text, "tuned lens path"), Path(text).name)
            except EXPECTED_ERRORS as exc:
                ctx.tuned_error = str(exc)
    elif choice == "upload":
        upload = sb.file_uploader("Tuned lens file", type=["safetensors"], key="tuned_upload")
        if upload is not None:
            _load_tuned_file(ctx, _save_upload(upload), upload.name)


def token_strings(model: Any, ids: list[int], show_whitespace: bool = False) -> list[str]:
    """Display strings of token ids (``jlens_core.reading.tokens``), e.g. for the prompt's own tokens."""
    from jlens_core.reading.tokens import TokenDisplay, display_ids

    return display_ids(TokenDisplay.for_model(model), ids, show_whitespace=show_whitespace)
