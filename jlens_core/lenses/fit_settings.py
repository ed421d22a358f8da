"""Fit settings as types (docs/method.md §3): what shapes a lens, how its fit runs, and what the fit recorded.

* :class:`FitSettings` shapes the result: two fits that differ in any of its fields give different lenses, so a
  checkpoint refuses to resume under other values and lenses of other values do not merge.
* :class:`FitPlan` says how the fit runs (rows per backward pass, method, memory budget, checkpoint cadence):
  the same lens whatever its values.
* :class:`FitRecord` is what a fit recorded (model, prompts counted and skipped, diagnostics, why it stopped,
  and, where they exist, its halves and its canary).

Each is a frozen dataclass with its checks in ``__post_init__`` (one sentence per bad value), ``to_dict`` /
``from_dict`` (JSON-ready; an unknown key is refused naming the known ones) and ``replace``. The fields of
:class:`FitSettings` and :class:`FitPlan` carry their ``jlens fit`` flag in their metadata: :func:`add_fit_arguments`
makes the flags from them, ``from_args`` reads them back. A new fit setting is one field here (with its help and
check) plus the code that uses it.

This module imports neither torch nor anything else heavy: ``jlens --help`` builds its flags from it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from .kinds import (
    RULES,  # "jacobian" (docs/method.md §2), "relevance" (the R-lens, §9.1): the lens kinds' table
)

if TYPE_CHECKING:
    from typing_extensions import Self  # typing's own from Python 3.11

# How the backward passes run (jlens_core.fitting.estimator); the same Jacobian whichever.
METHODS = ("auto", "fused", "batched", "replicated")
# Expert fits (docs/method.md §9.1): the prompts the clustering is made from, by default.
DEFAULT_CLUSTER_PROMPTS = 64


def _flag(flag: str, help: str, *, dest: str | None = None, type: Callable[[str], Any] | None = None,
          default: Any = dataclasses.MISSING, choices: tuple[str, ...] | None = None,
          metavar: str | None = None, action: str | None = None) -> dict[str, Any]:
    """A field's ``jlens fit`` flag: its name, ``help`` (verbatim), and the argparse ``dest``, ``type``,
    ``choices``, ``metavar``, ``action`` (``"store_false"``: a switch that turns a true field off) and
    ``default`` (when the flag's default is not the field's own)."""
    spec: dict[str, Any] = {"flag": flag, "help": help}
    for key, value in (("dest", dest), ("type", type), ("choices", choices), ("metavar", metavar),
                       ("action", action)):
        if value is not None:
            spec[key] = value
    if default is not dataclasses.MISSING:
        spec["default"] = default
    return {"cli": spec}


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Fields:
    """``to_dict`` / ``from_dict`` / ``replace`` / the CLI, shared by the three dataclasses."""

    # what from_dict's error calls one key ("setting", "plan entry", "record entry")
    _what: ClassVar[str] = "setting"

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The field names, in order."""
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    def _check_keys(cls, keys: object) -> None:
        known = cls.field_names()
        for key in keys:  # type: ignore[attr-defined]
            if key not in known:
                raise ValueError(f"{cls.__name__} has no {cls._what} {key!r}: the known ones are {', '.join(known)}.")

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (tuples as lists)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """The object of ``data`` (a :meth:`to_dict`, or part of one: missing fields take their defaults).

        Raises:
            ValueError: a key that is no field (one sentence naming the known ones), or a bad value.
        """
        cls._check_keys(data)
        return cls(**dict(data))

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes``, checked like a new object.

        Raises:
            ValueError: a key that is no field, or a bad value.
        """
        self._check_keys(changes)
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    @classmethod
    def cli_fields(cls) -> list[dataclasses.Field]:
        """The fields that have a ``jlens fit`` flag, in order."""
        return [f for f in dataclasses.fields(cls) if "cli" in f.metadata]  # type: ignore[arg-type]

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser | Any) -> None:
        """Add each field's ``jlens fit`` flag to ``parser`` (name, default and help as the field's metadata says)."""
        for f in cls.cli_fields():
            spec = dict(f.metadata["cli"])
            flag = spec.pop("flag")
            spec.pop("help")
            spec.setdefault("default", f.default)
            parser.add_argument(flag, help=f.metadata["cli"]["help"], **spec)

    @classmethod
    def cli_dest(cls, name: str) -> str:
        """The argparse attribute the flag of field ``name`` fills."""
        f = next(f for f in dataclasses.fields(cls) if f.name == name)  # type: ignore[arg-type]
        spec = f.metadata["cli"]
        return str(spec.get("dest") or spec["flag"].lstrip("-").replace("-", "_"))

    @classmethod
    def from_args(cls, args: argparse.Namespace, **given: Any) -> Self:
        """The object of parsed ``jlens fit`` flags; ``given`` fields are taken as they are instead (those whose
        flag needs the model to read, e.g. ``source_layers`` from ``--layers``); the rest keep their defaults.

        Raises:
            ValueError: a bad value (one sentence naming it).
        """
        values = dict(given)
        for f in cls.cli_fields():
            if f.name not in values:
                values[f.name] = getattr(args, cls.cli_dest(f.name))
        return cls.from_dict(values)

    def cli_arguments(self) -> list[str]:
        """The ``jlens fit`` flags that give this object's values (fields at their flag's default left out;
        ``source_layers`` as a comma-separated ``--layers`` list)."""
        out: list[str] = []
        for f in self.cli_fields():
            spec = f.metadata["cli"]
            value = getattr(self, f.name)
            default = spec.get("default", f.default)
            if value is None or value == default:
                continue
            if spec.get("action") in ("store_true", "store_false"):
                out.append(spec["flag"])
                continue
            text = ",".join(str(v) for v in value) if isinstance(value, tuple) else str(value)
            # "--layers=-2,-1": argparse would take a value that starts with "-" (and is no number) for a flag
            out += [f"{spec['flag']}={text}"] if text.startswith("-") and "," in text else [spec["flag"], text]
        return out


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _dim_batch(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer or 'auto'") from None


def check_rules(rules: object) -> str:
    """``rules`` if it is one of :data:`RULES`.

    Raises:
        ValueError: any other value, in one sentence.
    """
    if rules not in RULES:
        raise ValueError(f"rules={rules!r} is not one of {RULES}: use 'jacobian' (ordinary gradients) or "
                         "'relevance' (the R-lens's backward rules, docs/method.md §9.1).")
    return str(rules)


@dataclass(frozen=True)
class FitSettings(_Fields):
    """What shapes a fitted lens (docs/method.md §2, §3, §9.1): a checkpoint resumes only under the same values.

    Attributes:
        source_layers: the layers the lens reads from (``None``: every layer below the target; negatives count
            from the end). :meth:`resolved` makes them concrete for a model.
        target_layer: the layer residuals are carried to (``None``: the last; negatives count from the end).
        skip_first: leading positions left out as attention sinks (>= 0).
        max_seq_len: prompts are truncated to this many tokens (>= 2).
        rules: ``"jacobian"`` (the J lens) or ``"relevance"`` (the R-lens).
        experts: ``E > 0`` also fits ``E`` expert Jacobians per layer (J++ / R++); 0: none.
        cluster_prompts: with experts, the first prompts the clustering is made from (>= 1); 0 without experts
            (any value given then is set to 0: it shapes nothing).

    Raises:
        ValueError: a bad value, in one sentence naming it.
    """

    source_layers: tuple[int, ...] | None = field(default=None, metadata=_flag(
        "--layers", "source layers: '0,4,8', '0:12', '0:12:2', 'all' (default: all below the target)",
        dest="layers"))
    target_layer: int | None = field(default=None, metadata=_flag(
        "--target-layer", "target layer, negative from the end (default -1)", type=int, default=-1))
    skip_first: int = field(default=16, metadata=_flag(
        "--skip-first", "leading positions left out as attention sinks (default 16)", type=int))
    max_seq_len: int = field(default=128, metadata=_flag(
        "--max-seq-len", "truncate prompts to this many tokens (default 128)", type=int))
    rules: str = field(default="jacobian", metadata=_flag(
        "--rules", "backward rules: 'jacobian' (default: the J-lens, ordinary gradients) or 'relevance' (the "
        "R-lens: norms' denominators constant, identity rule for activations, half rule for gated "
        "products; docs/method.md §9.1)", choices=RULES))
    experts: int = field(default=0, metadata=_flag(
        "--experts", "also fit E expert Jacobians per layer in the same backward passes, one per cluster of "
        "the source residuals (the J++ / R++ lens; default 0: none; docs/method.md §9.1)", type=int))
    cluster_prompts: int = field(default=DEFAULT_CLUSTER_PROMPTS, metadata=_flag(
        "--cluster-prompts", "with --experts: cluster the kept positions of the first N prompts (default 64)",
        type=int))

    def __post_init__(self) -> None:
        if self.source_layers is not None:
            if isinstance(self.source_layers, (str, bytes)) or not all(_int(x) for x in self.source_layers):
                raise ValueError(f"source_layers={self.source_layers!r} must be integer layer indices (or None: "
                                 "every layer below the target).")
            object.__setattr__(self, "source_layers", tuple(int(x) for x in self.source_layers))
        if self.target_layer is not None and not _int(self.target_layer):
            raise ValueError(f"target_layer={self.target_layer!r} must be an integer layer index (or None: the last).")
        check_rules(self.rules)
        if not _int(self.skip_first) or self.skip_first < 0:
            raise ValueError(f"skip_first={self.skip_first} must be >= 0.")
        if not _int(self.max_seq_len) or self.max_seq_len < 2:
            raise ValueError(f"max_seq_len={self.max_seq_len} must be at least 2.")
        if not _int(self.experts) or self.experts < 0:
            raise ValueError(f"experts={self.experts!r} must be an integer >= 0 (0: no expert lens).")
        if not self.experts:
            object.__setattr__(self, "cluster_prompts", 0)
        elif not _int(self.cluster_prompts) or self.cluster_prompts < 1:
            raise ValueError(f"cluster_prompts={self.cluster_prompts!r} must be an integer >= 1: the clustering "
                             "needs prompts.")

    def resolved(self, n_layers: int) -> FitSettings:
        """These settings for a model of ``n_layers`` layers: concrete, sorted, non-negative layers.

        Raises:
            ValueError: a layer out of range or not below the target (:func:`~jlens_core.layerspec.resolve_layers`).
        """
        from ..layerspec import resolve_layers

        sources, target = resolve_layers(n_layers, self.source_layers, self.target_layer)
        return dataclasses.replace(self, source_layers=tuple(sources), target_layer=target)

    @classmethod
    def from_lens(cls, source_layers: list[int], target_layer: int, rules: str,
                  settings: Mapping[str, Any]) -> FitSettings:
        """The settings a lens file records: its layers and rules, and its ``settings`` dict's entries of the other
        fields (:data:`FILE_SETTINGS`; the plan's and the record's entries are ignored). A field missing from an old
        file takes its default (``cluster_prompts``: set to 0 without experts)."""
        recorded = {name: settings[name] for name in FILE_SETTINGS if settings.get(name) is not None}
        return cls(**{**recorded, "source_layers": tuple(source_layers), "target_layer": int(target_layer),
                      "rules": rules})

    @classmethod
    def from_checkpoint(cls, saved: Mapping[str, Any]) -> FitSettings:
        """The settings a checkpoint's ``settings`` dict records (its model identity ignored); checkpoints from
        before ``rules`` are J fits, from before ``experts`` fits without experts."""
        return cls.from_dict({key: saved[key] for key in cls.field_names() if key in saved})


@dataclass(frozen=True)
class FitPlan(_Fields):
    """How a fit runs: the same lens whatever these are (docs/fitting.md).

    Attributes:
        dim_batch: output dimensions per backward pass (an integer >= 1, or ``"auto"``): memory, not result.
        max_memory: a budget (bytes, or ``"6GiB"``) for one prompt's working memory on each device the layers
            run on; ``None``: no budget.
        method: ``"auto"``, ``"fused"``, ``"batched"`` or ``"replicated"`` (same result, speed and memory differ).
        checkpoint_every: write the checkpoint every N prompts (>= 1).
        first_prompt: the index of the first prompt in the whole prompt list (>= 0): a prompt's half is the
            parity of its index there (docs/method.md §3.3), so slices of one list fitted apart and merged have
            the halves of one fit.
        halves: keep the even and odd prompts' sums apart as well (the lens's split halves, docs/method.md
            §3.3): three sums per layer instead of one, in the same backward passes.

    Raises:
        ValueError: a bad value, in one sentence naming it.
    """

    _what: ClassVar[str] = "plan entry"

    dim_batch: int | str = field(default=8, metadata=_flag(
        "--dim-batch", "output dimensions per backward pass: memory, not result (default 8; 'auto' sizes it "
        "from free GPU memory, or from --fit-memory; with --fit-memory an integer is the most)",
        type=_dim_batch, default=None))
    max_memory: int | str | None = field(default=None, metadata=_flag(
        "--fit-memory", "a budget such as 6GiB for one prompt's working memory on each device the layers run on, "
        "beyond the weights: dim_batch and the fused order follow from it (default: sized from "
        "free memory). Not --max-memory, which places the model's weights", dest="fit_memory", metavar="SIZE"))
    method: str = field(default="auto", metadata=_flag(
        "--method", "how the backward passes run, same result: 'fused' (analytic backward; Llama, Mistral, "
        "Qwen2, Gemma, Gemma 2, GPT-2, GPT-NeoX, Phi layouts), 'batched' (autograd, cotangents batched), "
        "'replicated' (autograd, prompt replicated) or 'auto' (default: 'fused' where supported, else 'batched')",
        choices=METHODS))
    checkpoint_every: int = field(default=1, metadata=_flag(
        "--checkpoint-every", "write the checkpoint every N prompts (default 1)", type=int))
    first_prompt: int = field(default=0, metadata=_flag(
        "--first-prompt", "start at this corpus text (default 0): fit disjoint slices anywhere, then `jlens merge`",
        type=int))
    halves: bool = field(default=True, metadata=_flag(
        "--no-halves", "keep no split halves (default: keep the even and odd prompts' means, docs/method.md §3.3, "
        "which makes the lens file about 3x the size)", action="store_false", dest="halves"))

    def __post_init__(self) -> None:
        if not _int(self.checkpoint_every) or self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every={self.checkpoint_every} must be >= 1.")
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is not one of {METHODS}.")
        if self.dim_batch != "auto" and (not _int(self.dim_batch) or int(self.dim_batch) < 1):
            raise ValueError(f"dim_batch={self.dim_batch!r} must be an integer >= 1 or 'auto'.")
        if not _int(self.first_prompt) or self.first_prompt < 0:
            raise ValueError(f"first_prompt={self.first_prompt!r} must be an integer >= 0.")
        if not isinstance(self.halves, bool):
            raise ValueError(f"halves={self.halves!r} must be True or False.")  # noqa: TRY004 - one error type for settings

    @classmethod
    def from_args(cls, args: argparse.Namespace, **given: Any) -> FitPlan:
        """As :meth:`_Fields.from_args`; ``--dim-batch`` left out is 8, or ``"auto"`` with ``--fit-memory``."""
        if "dim_batch" not in given and getattr(args, "dim_batch", None) is None:
            given["dim_batch"] = "auto" if getattr(args, "fit_memory", None) else 8
        return super().from_args(args, **given)  # type: ignore[return-value]

    @classmethod
    def from_lens(cls, settings: Mapping[str, Any]) -> FitPlan:
        """The plan a lens file's ``settings`` dict records (defaults where an old file has none)."""
        memory = settings.get("memory")
        return cls(dim_batch=settings.get("dim_batch", 8), method=settings.get("method", "auto"),
                   max_memory=memory.get("budget_bytes") if isinstance(memory, Mapping) else None,
                   first_prompt=int(settings.get("first_prompt", 0)), halves=bool(settings.get("halves", False)))


@dataclass(frozen=True)
class ExpertOrigin(_Fields):
    """Where a plain one-matrix lens combined from an expert lens came from
    (:meth:`~jlens_core.lenses.experts.ExpertLens.to_jacobian_lens`, docs/method.md §9.1): its file's settings
    record these as ``expert_kind``, ``expert_weights``, ``weight_items``, ``min_positions``, ``expert_counts``.

    Attributes:
        kind: the expert lens's kind (``"jacobian++"``, ``"relevance-experts"``, ...): the kind the combined lens
            reads as (:func:`~jlens_core.lenses.kinds.lens_kind`).
        weights: ``{layer: [E floats]}`` (layers as strings, as JSON keeps them), the weights it was combined with.
        weight_items: the labelled items the weights were learned on.
        min_positions: experts with fewer positions read with the pooled matrix.
        counts: ``{layer: [E ints]}``, the positions averaged into each expert.
    """

    _what: ClassVar[str] = "expert origin entry"

    kind: str | None = None
    weights: dict | None = None
    weight_items: tuple[str, ...] | None = None
    min_positions: int | None = None
    counts: dict | None = None

    # the lens file's settings key of each field
    KEYS: ClassVar[dict[str, str]] = {"kind": "expert_kind", "weights": "expert_weights",
                                      "weight_items": "weight_items", "min_positions": "min_positions",
                                      "counts": "expert_counts"}

    def __post_init__(self) -> None:
        if self.weight_items is not None:
            object.__setattr__(self, "weight_items", tuple(self.weight_items))

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> ExpertOrigin | None:
        """The origin a lens file's ``settings`` record (``None`` unless they name an ``expert_kind``)."""
        if not settings.get("expert_kind"):
            return None
        return cls(**{name: settings[key] for name, key in cls.KEYS.items() if key in settings})

    def to_settings(self) -> dict[str, Any]:
        """The entries of a lens file's ``settings`` (the fields given, under their file keys)."""
        return {key: _plain(getattr(self, name)) for name, key in self.KEYS.items() if getattr(self, name) is not None}


@dataclass(frozen=True)
class FitRecord(_Fields):
    """What a fit recorded: the model it ran on, the prompts, the diagnostics, why it stopped, and what happened to
    the lens since (merged, weighted, combined from experts).

    Attributes:
        model_name: the model's name.
        model_fingerprint: the model's fingerprint (``HFLensModel.fingerprint``).
        n_prompts: prompts averaged into the lens.
        n_skipped: prompts skipped (no valid position).
        diagnostics: one record per prompt x source layer (docs/method.md §3).
        stop_reason: why the fit stopped early (``None``: it read every prompt).
        half_prompts: ``(n_even, n_odd)``, the prompts in each half when the lens keeps its halves
            (docs/method.md §3.3); ``None`` otherwise.
        canary: the lens check's canary (:class:`~jlens_core.lenses.canary.Canary`, docs/method.md §4.2), when the
            lens has one; ``None`` otherwise. Not compared, and left out of :meth:`to_dict` (its file keeps it).
        settings_recorded: whether a jlens fit recorded the lens's :class:`FitSettings` (``skip_first`` and the
            rest); ``False`` for a lens built by hand from matrices or read from another library's file: its
            readings then count every position as fitted, and its fit settings are the defaults.
        provenance: the other entries its file's settings record, JSON-ready: how the fit ran (``dim_batch``,
            ``method``, ``first_prompt``, ``memory``: the plan, :class:`FitPlan`) and any entry this jlens gives no
            field (an older or foreign file's, e.g. ``source``).
        corpus: the corpus the prompts came from (``jlens fit``'s ``--corpus``), when recorded.
        weighting: how the expert weights were learned (``jlens weigh``: items, seed, scores), when they were.
        merged_from: how many lenses :meth:`~jlens_core.lenses.lens.JacobianLens.merge` made it from (``None``:
            not merged).
        combined_from: the expert lens a one-matrix lens was combined from (:class:`ExpertOrigin`), or ``None``.
    """

    _what: ClassVar[str] = "record entry"

    model_name: str | None = None
    model_fingerprint: dict | None = None
    n_prompts: int = 0
    n_skipped: int = 0
    diagnostics: tuple[dict, ...] = ()
    stop_reason: str | None = None
    half_prompts: tuple[int, int] | None = None
    canary: Any = field(default=None, compare=False, metadata={"json": False})
    settings_recorded: bool = True
    provenance: dict = field(default_factory=dict)
    corpus: str | None = None
    weighting: dict | None = None
    merged_from: int | None = None
    combined_from: ExpertOrigin | None = None

    def __post_init__(self) -> None:
        for name in ("n_prompts", "n_skipped"):
            value = getattr(self, name)
            if not _int(value) or value < 0:
                raise ValueError(f"{name}={value!r} must be an integer >= 0.")
        object.__setattr__(self, "diagnostics", tuple(self.diagnostics))
        object.__setattr__(self, "provenance", dict(self.provenance))
        if isinstance(self.combined_from, Mapping):
            object.__setattr__(self, "combined_from", ExpertOrigin.from_dict(self.combined_from))
        if self.half_prompts is not None:
            object.__setattr__(self, "half_prompts", tuple(int(n) for n in self.half_prompts))
            if len(self.half_prompts) != 2:
                raise ValueError(f"half_prompts={self.half_prompts!r} must be (n_even, n_odd).")

    def for_half(self, n_prompts: int) -> FitRecord:
        """The record of one of its lens's split halves (docs/method.md §3.3): ``n_prompts`` prompts, and no
        diagnostics, stop reason, canary or halves of its own."""
        return self.replace(n_prompts=n_prompts, diagnostics=(), stop_reason=None, canary=None, half_prompts=None)

    def to_dict(self) -> dict[str, Any]:
        """Every field but the canary, JSON-ready (tuples as lists, :attr:`combined_from` as a dict)."""
        out = {}
        for f in dataclasses.fields(self):
            if f.metadata.get("json", True):
                value = getattr(self, f.name)
                out[f.name] = value.to_dict() if isinstance(value, ExpertOrigin) else _plain(value)
        return out


# The entries of a lens file's settings dict (docs/method.md §4.1) that typed fields own: every FitSettings field
# but its layers and rules (the lens's own fields; an expert fit's ``experts`` and ``cluster_prompts`` only with
# experts), so a new fit setting is recorded and read back without more code; and the record's.
FILE_SETTINGS = tuple(name for name in FitSettings.field_names() if name not in ("source_layers", "rules"))
_EXPERT_SETTINGS = ("experts", "cluster_prompts")
_RECORD_KEYS = ("n_skipped", "corpus", "weighting", "merged_from", *ExpertOrigin.KEYS.values())


def split_lens_settings(settings: Mapping[str, Any] | None, *, source_layers: list[int], target_layer: int,
                        rules: str) -> tuple[FitSettings, dict[str, Any]]:
    """A lens file's ``settings`` dict (or a hand-built lens's) as types: its :class:`FitSettings` (defaults where it
    records none) and the :class:`FitRecord` fields it holds (``settings_recorded``, ``n_skipped``, ``provenance``,
    ``corpus``, ``weighting``, ``merged_from``, ``combined_from``), as keyword arguments.

    :func:`settings_view` gives the dict back, the same entries (the inverse, up to key order). A dict that
    records no ``skip_first`` was not made by a jlens fit: its other entries stay as they are in ``provenance``.
    """
    settings = dict(settings or {})
    recorded = "skip_first" in settings
    fit = FitSettings.from_lens(source_layers, target_layer, rules, settings)
    owned = (*FILE_SETTINGS, *_RECORD_KEYS) if recorded else ("target_layer", *_RECORD_KEYS[1:])
    record: dict[str, Any] = {
        "settings_recorded": recorded, "n_skipped": int(settings.get("n_skipped", 0)),
        "provenance": {key: value for key, value in settings.items() if key not in owned},
        "corpus": settings.get("corpus"), "weighting": settings.get("weighting"),
        "merged_from": settings.get("merged_from"), "combined_from": ExpertOrigin.from_settings(settings)}
    return fit, record


def settings_view(fit: FitSettings, record: FitRecord) -> dict[str, Any]:
    """The ``settings`` dict a lens file records (docs/method.md §4.1), from the lens's types: the result settings
    that are not the lens's own fields, ``n_skipped``, the plan and other :attr:`~FitRecord.provenance`,
    ``experts`` / ``cluster_prompts`` for an expert fit, and the record's ``corpus``, ``merged_from``,
    ``weighting`` and expert origin when it has them. A fresh dict."""
    out: dict[str, Any]
    if record.settings_recorded:
        out = {name: _plain(getattr(fit, name)) for name in FILE_SETTINGS if fit.experts or name not in _EXPERT_SETTINGS}
        out.update(record.provenance)
        out["n_skipped"] = record.n_skipped
    else:
        out = {**record.provenance, "target_layer": fit.target_layer}
    for key in ("corpus", "merged_from", "weighting"):
        if getattr(record, key) is not None:
            out[key] = _plain(getattr(record, key))
    if record.combined_from is not None:
        out.update(record.combined_from.to_settings())
    return out


def add_fit_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """Add the flags of :class:`FitSettings` and :class:`FitPlan` to a ``jlens fit`` parser."""
    FitSettings.add_arguments(parser)
    FitPlan.add_arguments(parser)


def plan_provenance(plan: FitPlan, *, memory: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What a fit records of its plan (:attr:`FitRecord.provenance`, its file's settings, docs/method.md §4.1):
    ``dim_batch`` and ``method``, ``first_prompt`` when not 0, and the memory plan when a budget was given."""
    out: dict[str, Any] = {"dim_batch": plan.dim_batch, "method": plan.method}
    if plan.first_prompt:
        out["first_prompt"] = plan.first_prompt
    if memory is not None:
        out["memory"] = dict(memory)
    return out


__all__ = ["DEFAULT_CLUSTER_PROMPTS", "FILE_SETTINGS", "METHODS", "ExpertOrigin", "FitPlan", "FitRecord", "FitSettings",
           "add_fit_arguments", "check_rules", "plan_provenance", "settings_view", "split_lens_settings"]
