"""The app's cached loaders: models, lens files and prompt readings, kept per server process.

Models and lenses are Streamlit resources (``st.cache_resource``) keyed by what identifies them (a
model by spec, device and dtype; a lens file by path, mtime and size, so a rewritten file loads
again). Prompt readings are kept per lens in one :class:`ReadingStore`, so a rerun, another mode or
another session's view of the same prompt costs nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import streamlit as st
from streamlit.runtime.scriptrunner import get_script_run_ctx

from jlens_core.experiments.links import HeldTrials
from jlens_core.models.loading import load_model
from jlens_core.reading.readout_protocol import Readout

log = logging.getLogger(__name__)


def load_model_cached(spec: str, device: str, dtype: str, device_map: str = "", max_memory: str = "",
                      offload_folder: str = ""):
    """:func:`jlens_core.models.loading.load_model`, once per (spec, device, dtype, placement) per server.

    The placement (``device_map``: ``auto`` or JSON, ``max_memory``: ``0:20GiB,cpu:64GiB``, ``offload_folder``) is
    text, ``""`` for none (docs/models.md, sharded and offloaded models).
    """
    # Streamlit keys a cached call by the arguments as passed, defaults not filled in: every caller goes through
    # here, so the warm-up's load and the sidebar's are one cache entry (not two loads of the same model).
    return _load_model(spec, device, dtype, device_map, max_memory, offload_folder)


@st.cache_resource(show_spinner=False, max_entries=3)
def _load_model(spec: str, device: str, dtype: str, device_map: str, max_memory: str, offload_folder: str):
    return load_model(spec, device=None if device == "auto" else device, dtype=None if dtype == "auto" else dtype,
                      device_map=device_map or None, max_memory=max_memory or None,
                      offload_folder=offload_folder or None)


@st.cache_resource(show_spinner=False, max_entries=12)
def load_any_lens_cached(path: str, mtime: float, size: int):
    """:func:`jlens_core.lenses.loading.load_lens_file`: a Jacobian lens (a combined J++ / R++ file among them)
    or an expert lens, whatever the file holds, once per file version (path, mtime, size)."""
    from jlens_core.lenses.loading import load_lens_file

    return load_lens_file(path)


@st.cache_resource(show_spinner=False, max_entries=6)
def load_tuned_cached(path: str, mtime: float, size: int):
    """:meth:`TunedLens.load` (a file or a tuned-lens folder), once per version."""
    from jlens_core.lenses.tuned import TunedLens

    return TunedLens.load(path)


@st.cache_data(show_spinner="Fetching the lens from the Hub…", max_entries=16, ttl=3600)
def resolve_lens_cached(spec: str) -> str:
    """A lens spec as a local path (``hf://owner/repo[@revision]/path`` through the Hub cache), cached."""
    from jlens_core.lenses.hub import resolve_lens_path

    return str(resolve_lens_path(spec))


def load_versioned(loader: Callable[[str, float, int], Any], path: Path, probe: Path, model: Any,
                   prefix: str, check: bool = True) -> tuple[Any, str]:
    """``loader(path, mtime, size)`` (cached per version of the file ``probe``) checked against ``model``, and its key.

    The key, ``<prefix>|<path>|<mtime>|<size>``, names the lens in the reading caches: a rewritten file
    is another lens. ``check``: in a page's run, the lens check's banner when its canary disagrees
    (:func:`lens_check_soon`: an extra, computed in the background, the page polling until it is there).
    """
    stat = probe.stat()
    lens = loader(str(path), stat.st_mtime, stat.st_size)
    lens.check_model(model)
    key = f"{prefix}|{path}|{stat.st_mtime}|{stat.st_size}"
    if check and get_script_run_ctx() is not None:  # a page's run (the warm-up calls lens_check itself, later)
        done, result = lens_check_soon(key, model, lens)
        if not done:
            _await_check(key, model)
        elif result is not None and result.status == "changed":
            # a banner above the page, the lens reads this model off (docs/method.md §4.2)
            st.warning(f"Lens check failed for `{path.name}`: {result.message}", icon=":material/warning:")
    return lens, key


CHECK_POLL_SECONDS = 0.5
CHECK_WAIT_SECONDS = 60.0  # the longest a lens check waits for the first readings (then it runs regardless)
_CHECKS: set[tuple] = set()  # the lens checks waiting or running in a thread (their keys)
_CHECKS_LOCK = threading.Lock()


@st.cache_resource(show_spinner=False)
def check_store() -> ReadingStore:
    """The server's lens checks, one per lens file version and loaded model."""
    return ReadingStore(capacity=24)


def _check_job(key: str, model: Any, lens: Any) -> tuple[dict[str, tuple], Callable[[list[str]], dict[str, Any]]]:
    def compute(names: list[str]) -> dict[str, Any]:
        from jlens_core.lenses.canary import check_lens

        return {"check": check_lens(model, lens)}

    return {"check": (key, id(model))}, compute


def lens_check(key: str, model: Any, lens: Any) -> Any:
    """:func:`jlens_core.lenses.canary.check_lens` once per lens file version (``key``) and loaded model: recomputes
    the lens's forward canary (about 1 s on the default model on a CPU; nothing without a canary). Waits for it."""
    return check_store().get(*_check_job(key, model, lens))["check"]


def lens_check_soon(key: str, model: Any, lens: Any) -> tuple[bool, Any]:
    """``(True, check)`` when :func:`lens_check`'s result is there (``check`` None if it failed: the log says why),
    else ``(False, None)`` after starting it in a thread (unless one is): an extra, like the stability marks. The
    thread first waits for the warm-up's first readings and for any reading under way (:func:`_check_when_idle`)."""
    store = check_store()
    keys, compute = _check_job(key, model, lens)
    found = store.peek(keys)
    if found is not None:
        return True, found["check"]
    if store.failed.intersection(keys.values()):
        return True, None
    with _CHECKS_LOCK:
        start = keys["check"] not in _CHECKS
        _CHECKS.add(keys["check"])
    if start:
        threading.Thread(target=_check_when_idle, args=(store, keys, compute, reading_store()), name="jlens-extras",
                         daemon=True).start()
    return False, None


def _check_when_idle(store: ReadingStore, keys: dict[str, tuple], compute: Callable[[list[str]], dict[str, Any]],
                     readings: ReadingStore) -> None:
    # a lens check never delays a paint: it runs after the warm-up's first readings and between readings
    from first_paint import FIRST_READINGS

    try:
        FIRST_READINGS.wait(CHECK_WAIT_SECONDS)
        readings.wait_idle(CHECK_WAIT_SECONDS)
        _in_background(store, keys, compute)
    finally:
        with _CHECKS_LOCK:
            _CHECKS.discard(keys["check"])


def _await_check(key: str, model: Any) -> None:
    """A rerun of the page once the lens check of ``key`` is there (its banner then drawn, or none)."""
    keys = _check_job(key, model, None)[0]

    @st.fragment(run_every=CHECK_POLL_SECONDS)
    def poll() -> None:
        if ready(check_store(), keys):
            st.rerun(scope="app")

    poll()


class ReadingStore:
    """Prompt readings kept per lens (the least recently used dropped past ``capacity``).

    A page reads the lenses it draws together (:func:`jlens_core.reading.reader.read_prompts`: one
    forward pass, the shared final distribution), but keeps each lens's reading under its own key, so
    a later view of any one of them (another mode, the cell detail) finds it. A reading being
    computed in another thread (the server's warm-up, another session) is waited for, not redone.
    """

    def __init__(self, capacity: int = 48) -> None:
        self.capacity = capacity
        self._done: OrderedDict[tuple, Any] = OrderedDict()
        self._pending: dict[tuple, threading.Event] = {}
        self._lock = threading.Lock()
        self.failed: set[tuple] = set()  # keys a background reading failed on: not tried again in the background

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

    def peek(self, keys: dict[str, tuple]) -> dict[str, Any] | None:
        """``{name: reading}`` when every key is stored, else None; never waits or computes."""
        with self._lock:
            if not all(key in self._done for key in keys.values()):
                return None
            return {name: self._done[key] for name, key in keys.items()}

    def stored(self, keys: dict) -> dict:
        """``{name: value}`` of the ``keys`` stored now (any number of them); never waits or computes."""
        with self._lock:
            return {name: self._done[key] for name, key in keys.items() if key in self._done}

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no thread computes anything here (at most ``timeout`` seconds); whether it is idle now."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                pending = list(self._pending.values())
            remaining = deadline - time.monotonic()
            if not pending or remaining <= 0:
                return not pending
            pending[0].wait(remaining)

    def busy(self, keys: dict[str, tuple]) -> bool:
        """Whether some thread is computing one of ``keys`` now."""
        with self._lock:
            return any(key in self._pending for key in keys.values())


@st.cache_resource(show_spinner=False)
def reading_store() -> ReadingStore:
    """The server's one :class:`ReadingStore`."""
    return ReadingStore()


@st.cache_resource(show_spinner=False)
def held_trials() -> HeldTrials:
    """The server's one store of experiment trials that links replay (arms a URL cannot describe)."""
    return HeldTrials()


@dataclass(frozen=True)
class ReadSpec:
    """What a reading asks for besides the model, the lenses, the text and the edits: :func:`readings_cached`'s
    cache key and :func:`~jlens_core.reading.reader.read_prompts`' arguments. ``readout``: its ``k`` (tokens kept
    per cell) and ``vocab`` (``"all"``, or ``"word"``: word tokens only in top-k lists and ranks); ``stability``
    adds the stability marks of the lenses that keep halves (docs/method.md §6.2)."""

    readout: Readout = field(default_factory=Readout)
    pinned: tuple = ()
    show_ws: bool = False
    word_like: bool = False
    layers: tuple | None = None
    positions: tuple | None = None
    max_seq_len: int | None = None
    n_prompt: int | None = None
    stability: bool = False


def readings_cached(model, model_key: str, lenses: dict[str, tuple[Any, str]], text: str | tuple, spec: ReadSpec,
                    edits_key: str = "", edits=None, plain: dict[str, Any] | None = None) -> dict[str, Any]:
    """:func:`jlens_core.reading.reader.read_prompts` of ``lenses`` (``{name: (lens, lens key)}``), cached per lens.

    ``text`` is the prompt, or a tuple of token ids (a generation: the first ``spec.n_prompt`` are the prompt);
    ``edits`` are residual edits to read under (named by ``edits_key``); ``plain``: see :func:`readings_soon`.
    Returns ``{name: PromptReading}``.
    """
    return reading_store().get(*_reading_job(model, model_key, lenses, text, spec, edits_key, edits, plain))


def readings_soon(model, model_key: str, lenses: dict[str, tuple[Any, str]], text: str | tuple, spec: ReadSpec,
                  edits_key: str = "", edits=None, plain: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """:func:`readings_cached`'s readings if they are stored already, else None, after starting them in a thread
    (unless one computes them): an extra such as the stability marks never holds up the page that asks for it.
    The page draws without it and asks again (:func:`readings_ready`) until it is there. ``plain``: the same
    lenses' readings without the marks, already made (``read_prompts``' ``reuse``: only the marks are computed)."""
    return soon(reading_store(), *_reading_job(model, model_key, lenses, text, spec, edits_key, edits, plain))


def readings_stored(model_key: str, lenses: dict[str, tuple[Any, str]], text: str | tuple, spec: ReadSpec,
                    edits_key: str = "") -> dict[str, Any] | None:
    """:func:`readings_cached`'s readings if they are all stored now, else None; starts nothing."""
    return reading_store().peek(_reading_job(None, model_key, lenses, text, spec, edits_key)[0])


def readings_ready(model_key: str, lenses: dict[str, tuple[Any, str]], text: str | tuple, spec: ReadSpec,
                   edits_key: str = "") -> bool:
    """Whether :func:`readings_soon`'s readings are stored now, or failed (then the page stops waiting)."""
    return ready(reading_store(), _reading_job(None, model_key, lenses, text, spec, edits_key)[0])


def soon(store: ReadingStore, keys: dict, compute: Callable[[list], dict[Any, Any]]) -> dict[Any, Any] | None:
    """``store``'s values for ``keys`` if they are all stored, else None, after starting ``compute`` of the missing
    ones in a thread (unless one computes them, or failed on them): the mechanism of every extra the page adds
    after its first paint (the stability marks, the J-space labels)."""
    found = store.peek(keys)
    if found is None and not store.busy(keys) and not store.failed.intersection(keys.values()):
        threading.Thread(target=_in_background, args=(store, keys, compute), name="jlens-extras", daemon=True).start()
    return found


def ready(store: ReadingStore, keys: dict) -> bool:
    """Whether :func:`soon`'s values for ``keys`` are stored now, or failed (then the page stops waiting)."""
    return store.peek(keys) is not None or bool(store.failed.intersection(keys.values()))


def _in_background(store: ReadingStore, keys: dict[str, tuple], compute: Callable[[list[str]], dict[str, Any]]) -> None:
    try:
        store.get(keys, compute)
    except Exception:  # the page reads without the extra; the log keeps why
        store.failed.update(keys.values())
        log.exception("A background reading failed.")


def _reading_job(model, model_key: str, lenses: dict[str, tuple[Any, str]], text: str | tuple, spec: ReadSpec,
                 edits_key: str = "", edits=None, plain: dict[str, Any] | None = None
                 ) -> tuple[dict[str, tuple], Callable[[list[str]], dict[str, Any]]]:
    """The store keys of :func:`readings_cached`'s readings and the function that reads the missing ones
    (``plain``: readings of some of them without the marks, which the function reuses)."""
    keys = {name: (model_key, lens_key, text, spec, edits_key) for name, (_, lens_key) in lenses.items()}

    def compute(names: list[str]) -> dict[str, Any]:
        from jlens_core.reading.reader import read_prompts

        reuse = {name: plain[name] for name in names if plain and name in plain} if spec.stability else {}
        return read_prompts(model, {name: lenses[name][0] for name in names},
                            list(text) if isinstance(text, tuple) else text, spec.readout, reuse=reuse,
                            layers=None if spec.layers is None else list(spec.layers),
                            positions=None if spec.positions is None else list(spec.positions), edits=edits,
                            stability=spec.stability, pinned=spec.pinned, show_whitespace=spec.show_ws,
                            word_like=spec.word_like, max_seq_len=spec.max_seq_len, n_prompt=spec.n_prompt)

    return keys, compute


@dataclass(frozen=True)
class CellAtoms:
    """One cell's J-space decomposition as the heatmap shows it (docs/method.md §11.2): its atoms, largest first, as
    ``(token text, coefficient)``, the explained fraction of its squared norm and the random dictionary's."""

    atoms: tuple[tuple[str, float], ...]
    explained: float
    random_explained: float


@dataclass(frozen=True)
class JSpaceSpec:
    """What the J-space labels of a view ask for besides the model, the lens and the text: the dictionary's ``k``
    and ``gauge``, the positions decomposed (every shown one, in one batch per layer) and the edits read under."""

    k: int
    gauge: str
    positions: tuple[int, ...]
    edits_key: str = ""
    n_prompt: int | None = None


@st.cache_resource(show_spinner=False)
def jspace_store() -> ReadingStore:
    """The server's store of J-space labels, one entry per (model, lens, text, layer, spec): a few prompts' worth."""
    return ReadingStore(capacity=512)


_JOBS: set[tuple] = set()  # the J-space jobs running in a thread (their keys), each started once
_LATEST: dict[tuple, tuple] = {}  # (model, lens) -> the job last started for it: an older one stops after its layer
_JOBS_LOCK = threading.Lock()


def jspace_labels_soon(model, model_key: str, lens: tuple[Any, str], text: str | tuple, ids: Any, layers: list[int],
                       spec: JSpaceSpec, edits=None) -> tuple[dict[int, tuple[CellAtoms, ...]], bool]:
    """The J-space labels of ``layers`` stored so far (``{layer: one CellAtoms per position of spec.positions}``)
    and whether that is all there will be (every layer stored, or one failed); starts a thread computing the others
    unless one does: one forward pass recording the residuals of ``ids`` (``[1, seq]``, the tokens of ``text``),
    then one :func:`jlens_core.jspace.decompose` per layer with every position as a batch (its random-dictionary
    control too), each layer stored when done, so that the page can draw the labels layer by layer."""
    keys, compute = _jspace_job(model, model_key, lens, text, ids, layers, spec, edits)
    found, done = jspace_labels_stored(model_key, lens, text, layers, spec)
    job = tuple(keys.values())
    if not done:
        with _JOBS_LOCK:
            start = job not in _JOBS
            _JOBS.add(job)
            # the last prompt asked for is the one computed: a new prompt's labels never queue behind an old one's
            _LATEST[(model_key, lens[1])] = job
        if start:
            threading.Thread(target=_each_in_background, args=(jspace_store(), keys, compute, job,
                                                               (model_key, lens[1])),
                             name="jlens-extras", daemon=True).start()
    return found, done


def jspace_labels_running(model_key: str, lens: tuple[Any, str], text: str | tuple, layers: list[int],
                          spec: JSpaceSpec) -> bool:
    """Whether :func:`jspace_labels_soon`'s job for these labels is running (it stops, unfinished, when another
    prompt's labels are asked for with the same model and lens; asking again restarts it)."""
    job = tuple(_jspace_job(None, model_key, lens, text, None, layers, spec)[0].values())
    with _JOBS_LOCK:
        return job in _JOBS


def jspace_labels_stored(model_key: str, lens: tuple[Any, str], text: str | tuple, layers: list[int],
                         spec: JSpaceSpec) -> tuple[dict[int, tuple[CellAtoms, ...]], bool]:
    """:func:`jspace_labels_soon`'s labels stored now and whether they are all there will be; starts nothing."""
    keys = _jspace_job(None, model_key, lens, text, None, layers, spec)[0]
    store = jspace_store()
    found = store.stored(keys)
    return found, len(found) == len(keys) or bool(store.failed.intersection(keys.values()))


def _each_in_background(store: ReadingStore, keys: dict, compute: Callable[[list], dict], job: tuple,
                        scope: tuple) -> None:
    """``compute`` of each of ``keys`` in turn, each stored when done; the first failure ends the job, and so does a
    newer job of the same ``scope`` (model, lens)."""
    try:
        for name, key in keys.items():
            with _JOBS_LOCK:
                if _LATEST.get(scope) != job:
                    return
            try:
                store.get({name: key}, compute)
            except Exception:  # the page draws the layers done; the log keeps why
                store.failed.add(key)
                log.exception("A background J-space decomposition failed.")
                return
    finally:
        with _JOBS_LOCK:
            _JOBS.discard(job)


def _jspace_job(model, model_key: str, lens: tuple[Any, str], text: str | tuple, ids: Any, layers: list[int],
                spec: JSpaceSpec, edits=None) -> tuple[dict[int, tuple], Callable[[list[int]], dict[int, Any]]]:
    keys = {layer: (model_key, lens[1], text, int(layer), spec) for layer in layers}
    recorded: dict[int, Any] = {}  # every layer's residuals, recorded in one forward pass when first needed

    def compute(todo: list[int]) -> dict[int, tuple[CellAtoms, ...]]:
        from jlens_core.jspace.decompose import decompose
        from jlens_core.reading.inputs import record_residuals

        if not recorded:
            recorded.update(record_residuals(model, ids, layers, edits=edits, n_prompt=spec.n_prompt))
        out = {}
        for layer in todo:  # docs/method.md §11.2: every position of the layer in one call
            dec = decompose(model, lens[0], recorded[layer][list(spec.positions)].float(), layer, k=spec.k,
                            gauge=spec.gauge, controls="random")  # the hover shows J beside random only
            out[layer] = tuple(CellAtoms(tuple((t, float(c)) for t, _, c in dec.atoms(i)), float(dec.explained[i]),
                                         float(dec.random_explained[i])) for i in range(dec.n))
        return out

    return keys, compute
