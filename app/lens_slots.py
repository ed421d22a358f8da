"""The sidebar's lens slots: one picker per lens the app reads beside the logit lens.

A :class:`LensSlot` says where its kind of lens comes from (shipped with the package, made on this
server's Fit or Tune page, a typed path or ``hf://`` spec, an upload) and how a file of it loads;
:func:`draw_slot` draws one slot's picker and loads the pick. :data:`SLOTS` is the list the sidebar
draws, in order: the Jacobian lens, the R-lens (a Jacobian lens fitted with relevance rules), the J++
and R++ lenses (expert lenses, docs/method.md §9.1: a full expert lens file or its combined one-matrix
file) and the tuned lens. Another kind of lens is one more entry. Below them, :func:`draw_extras` adds
any number of lenses from files (the URL's ``extra``), each of the kind its file holds.

A slot's ``param`` names both its URL query parameter and its widgets' session keys
(``<param>_choice``, ``<param>_path``, ``<param>_upload``, and ``<param>_request``: the URL's pick,
applied once the model is loaded). Typed paths are confined to the workspace (``docs/security.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import streamlit as st

import cache
import common
from common import ENV_LENS, LoadedLens
from jlens_core.lenses.experts import is_expert_lens_file
from jlens_core.lenses.header import header_or_none
from jlens_core.lenses.kinds import (
    KINDS,
    PLAIN_RULES,
    RULES,
    capabilities,
    expert_kind,
    lens_kind,
    plain_kind,
    relevance_backward,
)
from jlens_core.lenses.shipped import KIND_NAMES, is_tuned_lens_file

SHIPPED, NONE, FILE, UPLOAD, RUN = "shipped", "none", "file", "upload", "run:"
EXTRA_PARAM = "extra"  # the URL parameter of the lenses added from files: their paths, comma-separated
EXTRAS = "extra_lenses"  # their session key: [path or hf:// spec]
# A lens's kind (jlens_core.lenses.kinds.lens_kind) in a few letters: an expert lens's name, an added lens's tag
KIND_LABELS = {k.kind: k.tag for k in KINDS}


@dataclass(frozen=True)
class Source:
    """A picker entry that names a file: the shipped lens (``shipped``) or one made here (``run:<name>``)."""

    choice: str
    label: str
    path: Path


@dataclass(frozen=True)
class LensSlot:
    """One lens picker of the sidebar: where its lenses come from, how one loads, and its words."""

    key: str  # the lens's name in Context.lenses() and in readings ("jacobian", "relevance", "tuned")
    param: str  # the URL query parameter, and the prefix of the widgets' session keys
    default: str  # what "auto" picks (SHIPPED: the shipped lens, NONE when nothing ships; or NONE), but see default_for
    sources: Callable[[Any, str], list[Source]]  # (model, model spec) -> the shipped and here-made files
    loader: Callable[[str, float, int], Any]  # (path, mtime, size) -> the lens, cached per file version
    version_file: Callable[[Path], Path]  # the file whose mtime and size version a path (raises when none)
    summary: Callable[[Any], str]  # one line about a loaded lens
    noun: str  # "lens", "tuned lens": in "Could not load the <noun>: ..."
    label: str  # the picker's label
    none_label: str
    file_label: str
    upload_label: str
    upload_box_label: str
    path_label: str
    path_what: str  # the typed path in a confinement refusal ("The <path_what> ... is outside the workspace")
    path_placeholder: str
    path_help: str | None = None
    picker_help: str | None = None
    upload_types: tuple[str, ...] = ("safetensors",)
    env: str | None = None  # the environment variable preselecting a lens when the URL names none
    empty_note: str | None = None  # said when a model is loaded and the slot holds no lens
    unshipped_label: str | None = None  # the "none" choice's label when nothing ships for the model (says so)
    kinds: tuple[str, ...] = ()  # the lens kinds (``lens_kind(lens)``) the slot takes; empty: any its loader reads
    wrong_kind: str = ""  # why a J lens or an R-lens is refused, and where it goes: "{kind}" is the file's
    named: bool = False  # the lens is named by its kind ("J++", "J-experts (uniform)"), not by the slot's key
    variant: str | None = None  # the shipped variant it holds ("relevance", "jpp", "rpp"; jlens_core VARIANTS)

    def default_for(self, model: Any) -> str:
        """What "auto" picks for ``model``: the slot's shipped lens when that is the model's default reading lens
        (``jlens_core.lenses.shipped.default_reading_lens``, docs/results.md), else :attr:`default`."""
        if self.variant is not None and model is not None:
            from jlens_core.lenses.shipped import default_reading_lens

            if default_reading_lens(str(getattr(model, "name", "") or "")) == self.variant:
                return SHIPPED
        return self.default

    def state(self, part: str) -> str:
        """The session key of one of the slot's values (``choice``, ``path``, ``upload``, ``request``)."""
        return f"{self.param}_{part}"

    def options(self, model: Any, spec: str) -> tuple[list[str], dict[str, str], dict[str, Path]]:
        """The picker's choices, their labels, and the files the shipped and here-made ones name."""
        sources = self.sources(model, spec) if model is not None else []
        options = [NONE, *(s.choice for s in sources), FILE, UPLOAD]
        none_label = self.none_label
        if self.unshipped_label and model is not None and not any(s.choice == SHIPPED for s in sources):
            none_label = self.unshipped_label
        labels = {NONE: none_label, FILE: self.file_label, UPLOAD: self.upload_label,
                  **{s.choice: s.label for s in sources}}
        return options, labels, {s.choice: s.path for s in sources}

    def resolve_request(self, request: str, options: list[str], model: Any = None) -> str:
        """The choice a requested value (the URL's, an environment's, ``auto``) stands for.

        A shipped lens, run or upload that is not there falls back to the default (:meth:`default_for` the
        model); anything else not among the options is a path, put in the slot's path box.
        """
        if request in options and request != "auto":
            return request
        if request == "auto" or request.startswith(RUN) or request in (SHIPPED, UPLOAD):
            default = self.default_for(model)
            return default if default in options else NONE
        st.session_state[self.state("path")] = request
        return FILE

    def url_value(self, model: Any = None) -> str | None:
        """The slot's value in the URL: the choice, a file's path; ``None`` (left out) when it says what ``auto`` does."""
        ss = st.session_state
        value = ss.get(self.state("choice")) or NONE
        if value == FILE:
            value = ss.get(self.state("path")) or NONE
        return None if value == NONE and self.default_for(model) == NONE else value


def draw_slot(slot: LensSlot, model: Any, spec: str) -> LoadedLens | None:
    """Draw ``slot``'s picker in the sidebar (disabled without a model) and return the lens it loads.

    A lens that cannot load (a missing or foreign file, one fitted for another model, a path outside
    the workspace) is said in the sidebar, and ``None`` returned: the app stays usable.
    """
    ss, sb = st.session_state, st.sidebar
    options, labels, paths = slot.options(model, spec)
    request, choice = slot.state("request"), slot.state("choice")
    if request in ss and model is not None:  # the URL's pick, once the model is there
        ss[choice] = slot.resolve_request(ss.pop(request), options, model)
    if ss.get(choice) not in options:
        ss[choice] = slot.resolve_request("auto", options, model)
    sb.selectbox(slot.label, options, key=choice, format_func=lambda o: labels.get(o, o), disabled=model is None,
                 help=slot.picker_help)
    if model is None:
        return None
    picked = ss[choice]
    try:
        if picked in paths:
            return load_slot_file(slot, paths[picked], labels[picked], model)
        if picked == FILE:
            sb.text_input(slot.path_label, key=slot.state("path"), placeholder=slot.path_placeholder,
                          help=slot.path_help)
            text = (ss.get(slot.state("path")) or "").strip()
            return load_slot_file(slot, typed_path(text, slot.path_what), Path(text).name, model) if text else None
        if picked == UPLOAD:
            upload = sb.file_uploader(slot.upload_box_label, type=list(slot.upload_types), key=slot.state("upload"))
            if upload is not None:
                return load_slot_file(slot, common.save_upload(upload, ".safetensors"), upload.name, model)
    except Exception as exc:  # noqa: BLE001 - a failed load is shown, the app stays usable
        sb.error(f"Could not load the {slot.noun}: {common.error_text(exc)}")
    return None


def typed_path(text: str, what: str) -> Path:
    """A typed lens path: ``hf://`` through the Hub cache, anything else confined to the workspace."""
    return Path(cache.resolve_lens_cached(text)) if text.startswith("hf://") else common.confine(text, what)


def load_slot_file(slot: LensSlot, path: Path, label: str, model: Any, check: bool = True) -> LoadedLens:
    """The lens at ``path`` through ``slot``'s cached loader, checked against ``model`` (``check``: its canary too,
    in the background: :func:`cache.load_versioned`)."""
    lens, key = cache.load_versioned(slot.loader, path, slot.version_file(path), model, slot.key, check)
    kind = lens_kind(lens)
    if slot.kinds and kind not in slot.kinds:
        raise ValueError(refusal(slot, kind))
    return LoadedLens(lens=lens, key=key, label=label, name=KIND_LABELS.get(kind, kind) if slot.named else "")


def refusal(slot: LensSlot, kind: str) -> str:
    """Why ``slot`` refuses a lens of ``kind``, and the slot that takes it."""
    row = capabilities(kind)
    if slot.wrong_kind and row is not None and row.fitted and not row.experts:  # the other plain fitted slot's
        return slot.wrong_kind.format(kind=kind)
    home = next((other for other in SLOTS if kind in other.kinds), None)
    where = f": pick it in the {home.label} slot" if home is not None else ""
    return f"this file holds a {KIND_NAMES.get(kind, kind)} (kind {kind!r}), which the {slot.label} slot does not take{where}."


# -- the Jacobian lens -----------------------------------------------------------------------------------
def shipped_lens_path(model: Any) -> Path | None:
    """The lens shipped in ``assets/lenses/`` for ``model`` (by its name), or ``None``
    (:func:`jlens_core.lenses.shipped.shipped_lens_path`)."""
    return shipped_variant_path(model, None)


def finished_runs(model: Any, spec: str, rules: str = "jacobian", experts: bool = False) -> list[dict]:
    """Lenses fitted by the Fit page (in the runs folder) for this model with ``rules``: ``[{"name", "path", "n"}]``;
    ``experts``: the expert lenses (``jlens fit --experts``) among them, else the plain ones."""
    from jlens_core.fitting import runs

    out = []
    names = (spec, getattr(model, "name", None))
    for run in runs.list_runs(common.runs_dir()):
        if run.state != "done" or not run.lens_path.is_file() or run.rules != rules:
            continue
        if is_expert_lens_file(run.lens_path) != experts:
            continue
        if run.model_spec not in names and run.status.get("model") not in names:
            continue
        out.append({"name": run.name, "path": run.lens_path, "n": run.status.get("n_done")})
    return out


def _fitted_here(model: Any, spec: str, rules: str, experts: bool = False) -> list[Source]:
    return [Source(f"{RUN}{run['name']}", f"Fitted here: {run['name']}" + (f" ({run['n']} prompts)" if run["n"] else ""),
                   run["path"]) for run in finished_runs(model, spec, rules, experts)]


def _jacobian_sources(model: Any, spec: str) -> list[Source]:
    shipped = shipped_lens_path(model)
    found = [Source(SHIPPED, f"Shipped lens ({shipped.name})", shipped)] if shipped is not None else []
    return found + _fitted_here(model, spec, "jacobian")


def slot_for_rules(rules: str | None, experts: bool = False) -> LensSlot:
    """The slot a Jacobian lens fitted with ``rules`` loads into (the R-lens slot for ``"relevance"``); with
    ``experts``, the slot of an expert lens fitted so (J++ or R++)."""
    slots = (JPP, RPP) if experts else (JACOBIAN, RELEVANCE)
    if rules not in RULES:
        return slots[0]
    kind = expert_kind(rules, weighted=True) if experts else plain_kind(rules)
    return next((slot for slot in slots if kind in slot.kinds), slots[0])


def slot_for_file(path: str | Path, rules: str | None = None) -> LensSlot:
    """The slot the lens file at ``path`` loads into: by the rules its header records (else ``rules``), and
    whether it holds experts (a full expert lens file, or a combined one-matrix file). The header is read once
    per file version (:func:`jlens_core.lenses.header.read_header`); a file it cannot read goes by ``rules``."""
    header = header_or_none(path)
    if header is None:  # not a readable jlens lens: the slot's own load says why, if picked
        return slot_for_rules(rules)
    return slot_for_rules(header.rules or rules, experts=header.is_expert or bool(header.settings.get("expert_kind")))


# -- the R-lens ------------------------------------------------------------------------------------------
def shipped_variant_path(model: Any, variant: str | None) -> Path | None:
    """A lens shipped for ``model`` beside its J lens: ``assets/lenses/<model>.<variant>.safetensors`` (``variant``:
    ``relevance``, ``jpp`` or ``rpp``, :data:`jlens_core.lenses.shipped.VARIANTS`; None: the J lens)."""
    from jlens_core.lenses.shipped import shipped_lens_path as core_shipped

    return core_shipped(str(getattr(model, "name", "") or ""), variant)


def shipped_relevance_path(model: Any) -> Path | None:
    """The R-lens shipped for ``model``: ``assets/lenses/<model>.relevance.safetensors``, next to its J lens."""
    return shipped_variant_path(model, "relevance")


def _relevance_sources(model: Any, spec: str) -> list[Source]:
    shipped = shipped_relevance_path(model)
    found = [Source(SHIPPED, f"Shipped R-lens ({shipped.name})", shipped)] if shipped is not None else []
    return found + _fitted_here(model, spec, "relevance")


def _lens_file(path: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"No lens file at {str(path)!r}.")
    return path


def _expert_sources(rules: str, variant: str, what: str) -> Callable[[Any, str], list[Source]]:
    def sources(model: Any, spec: str) -> list[Source]:
        shipped = shipped_variant_path(model, variant)
        found = [Source(SHIPPED, f"Shipped {what} ({shipped.name})", shipped)] if shipped is not None else []
        return found + _fitted_here(model, spec, rules, experts=True)
    return sources


# -- the tuned lens --------------------------------------------------------------------------------------
def _tuned_sources(model: Any, spec: str) -> list[Source]:
    from jlens_core.lenses.shipped import shipped_tuned_lens_path

    shipped = shipped_tuned_lens_path(getattr(model, "name", ""))
    found = [Source(SHIPPED, f"Shipped tuned lens ({shipped.name})", shipped)] if shipped is not None else []
    for path in sorted(common.tuned_runs_dir().glob(f"{common.tuned_run_name(model)}*.safetensors")):
        found.append(Source(f"{RUN}{path.stem}", f"Trained here: {path.stem}", path))
    return found


def _tuned_file(path: Path) -> Path:
    probe = path / "params.pt" if path.is_dir() else path  # a folder in tuned-lens's format
    if not probe.exists():
        from jlens_core.lenses.tuned import TunedLens

        TunedLens.load(path)  # raises the sentence that says what is missing
    return probe


def _lens_file_slot(noun: str, article: str = "a", **fields: Any) -> LensSlot:
    """A slot of lens files (a J lens, an R-lens, an expert lens: :func:`cache.load_any_lens_cached` reads them),
    its file words made from ``noun``: "<Noun> file (path)…", "Upload <article> <noun> file…"."""
    title = noun[:1].upper() + noun[1:]
    return LensSlot(loader=cache.load_any_lens_cached, version_file=_lens_file, noun=noun,
                    file_label=f"{title} file (path)…", upload_label=f"Upload {article} {noun} file…",
                    upload_box_label=f"{title} file", path_label=f"{title} file", path_what=f"{noun} file", **fields)


JACOBIAN = _lens_file_slot(
    "lens", key="jacobian", param="lens", default=SHIPPED, sources=_jacobian_sources,
    summary=lambda lens: f"**Jacobian lens** · {lens.describe()}", label="Lens", none_label="None: logit lens only",
    path_placeholder="/path/to/lens.safetensors or hf://owner/repo/lens.pt",
    path_help="A lens file (jlens or the reference's .pt), or hf://owner/repo[@revision]/path on the "
              "Hugging Face Hub (its cache; HF_HUB_OFFLINE honoured).",
    upload_types=("safetensors", "pt"), env=ENV_LENS,
    empty_note="No Jacobian lens loaded: the logit lens only. Fit one on the Fit page or load a lens file.",
    kinds=(plain_kind(PLAIN_RULES),), wrong_kind="this file is an R-lens (fitted with rules={kind!r}): pick it in the R-lens "
                                    "slot below.")
RELEVANCE = _lens_file_slot(
    "R-lens", "an", key="relevance", param="rlens", default=NONE, variant="relevance", sources=_relevance_sources,
    summary=lambda lens: f"**R-lens** · {lens.describe()}", label="R-lens", none_label="None",
    unshipped_label="None (no shipped R-lens for this model)", path_placeholder="/path/to/lens.safetensors or hf://owner/repo/lens",
    path_help="A lens file fitted with relevance rules (`jlens fit --rules relevance`), or "
              "hf://owner/repo[@revision]/path on the Hugging Face Hub.",
    picker_help="The relevance lens: the same average Jacobian, fitted with LRP-style backward rules "
                "(docs/method.md §9.1). Fit one on the Fit page (rules: Relevance).",
    kinds=tuple(plain_kind(rules) for rules in RULES if relevance_backward(rules)), wrong_kind="this file is a lens fitted with rules={kind!r}, not an R-lens: pick it in the "
                                     "Lens slot above.")
TUNED = LensSlot(
    key="tuned", param="tuned", default=NONE, sources=_tuned_sources, loader=cache.load_tuned_cached,
    version_file=_tuned_file, summary=lambda lens: f"**Tuned lens** · {lens.describe()}", noun="tuned lens",
    label="Tuned lens", none_label="None", file_label="Tuned lens file or folder (path)…",
    upload_label="Upload a tuned lens file…", upload_box_label="Tuned lens file", path_label="Tuned lens path", path_what="tuned lens path",
    path_placeholder="/path/to/tuned.safetensors or folder",
    picker_help="A third lens to compare: affine translators trained on the model's own output (Tune page), "
                "a jlens tuned-lens file, or a folder in tuned-lens's format (config.json + params.pt).")



def _expert_slot(key: str, rules: str, short: str) -> LensSlot:
    """The J++ or R++ slot: an expert lens fitted with ``rules`` (learned weights, or uniform), in full or combined."""
    what = f"{short} lens"
    return _lens_file_slot(
        what, key=key, param=key, default=NONE, variant=key, sources=_expert_sources(rules, key, what),
        summary=lambda lens: f"**{KIND_LABELS[lens_kind(lens)]}** · {lens.describe()}", label=what,
        none_label="None", unshipped_label=f"None (no shipped {what} for this model)",
        path_placeholder="/path/to/experts.safetensors or hf://owner/repo/lens",
        path_help=f"An expert lens fitted with {rules} rules (`jlens fit --experts E"
                  + ("" if rules == PLAIN_RULES else f" --rules {rules}") + "`, weights from `jlens weigh`), or its "
                  "combined one-matrix file, or hf://owner/repo[@revision]/path on the Hugging Face Hub.",
        picker_help=f"The {short} lens: one Jacobian per cluster of residuals, combined with learned weights "
                    f"(docs/method.md §9.1, experts); without learned weights it shows as "
                    f"{KIND_LABELS[rules + '-experts']}. Fit one on the Fit page (experts). The default model's "
                    "ships in a clone's assets/lenses/, not in the wheel (docs/results.md).",
        kinds=tuple(k.kind for k in KINDS if k.experts and k.rules == rules), named=True)


JPP = _expert_slot("jpp", "jacobian", "J++")
RPP = _expert_slot("rpp", "relevance", "R++")
SLOTS: tuple[LensSlot, ...] = (JACOBIAN, RELEVANCE, JPP, RPP, TUNED)



# -- lenses added from files -----------------------------------------------------------------------------
def extra_specs() -> list[str]:
    """The lenses added from files (paths in the workspace, ``hf://`` specs), in the order added."""
    return [str(x) for x in st.session_state.get(EXTRAS) or []]


def _set_extras(specs: list[str]) -> None:
    st.session_state[EXTRAS] = list(dict.fromkeys(x for x in specs if x))


def _add_typed() -> None:
    ss = st.session_state
    text = (ss.get("extra_path") or "").strip()
    if text:
        _set_extras([*extra_specs(), text])
    ss.extra_path = ""


def _remove(spec: str) -> None:
    _set_extras([x for x in extra_specs() if x != spec])


def _extra_name(spec: str, kind: str) -> str:
    """``"<file stem> (<kind>)"``: ``"my-lens (J++)"``; an upload's name without its digest prefix."""
    import re

    stem = Path(spec.rstrip("/")).name
    for suffix in (".safetensors", ".pt"):
        stem = stem.removesuffix(suffix)
    stem = re.sub(r"^[0-9a-f]{16}-", "", stem) if Path(spec).parent == common.uploads_dir() else stem
    return f"{stem} ({KIND_LABELS.get(kind, kind)})"


def load_extra(spec: str, model: Any) -> LoadedLens:
    """The lens a file added from the sidebar holds (a J lens, an R-lens, an expert lens, a combined J++ / R++
    file or a tuned lens: the file says which), checked against ``model``."""
    path = typed_path(spec, "lens file")
    if path.is_dir() or is_tuned_lens_file(path):
        lens, key = cache.load_versioned(cache.load_tuned_cached, path, _tuned_file(path), model, "extra")
    else:
        lens, key = cache.load_versioned(cache.load_any_lens_cached, path, _lens_file(path), model, "extra")
    return LoadedLens(lens=lens, key=key, label=spec, name=_extra_name(spec, lens_kind(lens)))


def draw_extras(model: Any, taken: set[str]) -> dict[str, LoadedLens]:
    """The sidebar's added lenses (each with a Remove button) and the "Add a lens from a file" controls.

    Returns ``{"extra<i>": LoadedLens}`` for those that loaded, named apart from ``taken`` (the names in use).
    A lens that cannot load is said, with its Remove button; the others load.
    """
    ss, sb = st.session_state, st.sidebar
    loaded: dict[str, LoadedLens] = {}
    disabled = model is None
    for i, spec in enumerate(extra_specs()):
        row, remove = sb.columns([5, 1], vertical_alignment="center")
        remove.button("✕", key=f"extra_remove_{i}", on_click=_remove, args=(spec,), help=f"Remove {spec}")
        if model is None:
            row.caption(f"`{spec}`")
            continue
        try:
            item = load_extra(spec, model)
        except Exception as exc:  # noqa: BLE001 - a failed load is shown, the app stays usable
            row.error(f"Could not load the lens {spec!r}: {common.error_text(exc)}")
            continue
        name, n = item.name, 2
        while name in taken:
            name, n = f"{item.name} #{n}", n + 1
        item.name = name
        taken.add(name)
        loaded[f"extra{i}"] = item
        summary = item.lens.describe()
        row.caption(f"**{name}** · {summary}")
    sb.text_input("Add a lens from a file", key="extra_path", disabled=disabled,
                  placeholder="/path/to/lens.safetensors or hf://owner/repo/lens",
                  help="Any lens file: a J lens, an R-lens, an expert lens (J++, R++, uniform experts), a combined "
                       "J++ / R++ file or a tuned lens (file or folder); its kind is read from the file. Or "
                       "hf://owner/repo[@revision]/path on the Hugging Face Hub. Add as many as you like.")
    sb.button("Add the lens", key="extra_add", on_click=_add_typed, disabled=disabled, icon=":material/add:")
    upload = sb.file_uploader("…or upload one", type=["safetensors", "pt"], key="extra_upload", disabled=disabled)
    if upload is not None and not disabled:
        done = ss.setdefault("_extra_uploads", set())
        if upload.file_id not in done:  # the uploader keeps its file across reruns: add it once
            done.add(upload.file_id)
            try:
                _set_extras([*extra_specs(), str(common.save_upload(upload))])
            except OSError as exc:
                sb.error(f"Could not keep the upload: {exc}")
            else:
                st.rerun()
    return loaded
