"""Lens objects: the fitted Jacobian lens and the logit lens (docs/method.md §4)."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import operator
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypedDict, TypeVar, cast

import torch
from jaxtyping import Float

from .._atomic import atomic_write
from .._keywords import checked_options
from ..models.model import LensModel, same_fingerprint
from .fit_settings import FitPlan, FitRecord, FitSettings, settings_view, split_lens_settings
from .header import FORMAT_NAME, LensFileError, half_prompts_of, read_header
from .kinds import BASELINE, BY_KIND, PLAIN_RULES, RULES, lens_kind, plain_kind
from .protocol import FittedLens, Lens
from .readout import ReadoutMixin

if TYPE_CHECKING:
    import pandas as pd
    from typing_extensions import Self, Unpack  # typing's own from Python 3.11

    from .canary import Canary

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
FP16_MAX = 65504.0
# The version that removes a fitted lens's deprecated ``settings`` dict view (read fit_settings and record instead).
SETTINGS_REMOVED_IN = "0.3.0"
# Split halves in a lens file (docs/method.md §3.3): each half's own tensors under "half.even." / "half.odd.",
# and a "halves" field in the header's metadata.
HALF_PREFIX = "half."
HALF_NAMES = ("even", "odd")
# Extra tensors a lens file may carry beside the lens's own, each set under its prefix: the halves, the canary.
EXTRA_PREFIXES = (HALF_PREFIX, "canary.")


@dataclass
class FileExtras:
    """What a lens file carries beside the lens's own tensors and metadata (docs/method.md §4.1): named extra
    tensors, each set under its own key prefix (:data:`EXTRA_PREFIXES`), and the header fields that describe
    them. Readers that know none of them read the lens as before; old files have none."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    def add(self, prefix: str, tensors: Mapping[str, torch.Tensor], **metadata: Any) -> None:
        """Add ``tensors`` under ``prefix`` (``{"J.3": t}`` -> ``{prefix + "J.3": t}``) and header ``metadata``."""
        self.tensors.update({prefix + name: tensor for name, tensor in tensors.items()})
        self.metadata.update(metadata)


def extra_tensors(tensors: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors of a lens file under ``prefix``, named without it."""
    return {name[len(prefix):]: tensor for name, tensor in tensors.items() if name.startswith(prefix)}


def own_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of a lens file that are the lens's own (under no :data:`EXTRA_PREFIXES` prefix)."""
    return {name: tensor for name, tensor in tensors.items() if not name.startswith(EXTRA_PREFIXES)}



def check_made_for(lens: FittedLens, model: LensModel, *, what: str, made: str, remedy: str) -> None:
    """Raise :class:`LensFileError` unless ``lens`` matches ``model``'s shape and unembedding.

    ``what`` names the lens in the message ("lens", "tuned lens"), ``made`` how it was made ("fitted
    on", "trained for"), ``remedy`` what to do instead.
    """
    if lens.d_model != model.d_model or lens.target_layer >= model.n_layers:
        raise LensFileError(f"This {what} is for a model with d_model={lens.d_model} and target layer "
                            f"{lens.target_layer} ({lens.model_name!r}); {model.name!r} has "
                            f"d_model={model.d_model} and {model.n_layers} layers.")
    if not same_fingerprint(lens.model_fingerprint, model.fingerprint()):
        raise LensFileError(f"This {what} was {made} {lens.model_name!r}, whose unembedding differs from "
                            f"that of {model.name!r}: {remedy}.")


_T = TypeVar("_T")
_K = TypeVar("_K")


def cached_on_device(cache: dict[tuple[int, torch.device, torch.dtype], _T], layer: int, h: torch.Tensor,
                     make: Callable[[], _T]) -> _T:
    """``cache[(layer, h.device, h.dtype)]``, made by ``make()`` when missing; a new entry drops the
    entries of other devices and dtypes (a lens keeps its matrices on one device and dtype at a time)."""
    key = (layer, h.device, h.dtype)
    value = cache.get(key)
    if value is None:
        value = make()
        for other in [k for k in cache if k[1:] != key[1:]]:
            del cache[other]
        cache[key] = value
    return value


class ReadOnlySettings(dict):
    """A lens's settings dict (the fitted lens's deprecated ``lens.settings`` view, a tuned lens's ``settings`` and
    ``metrics``): a dict (JSON-ready, ``isinstance(x, dict)``) that refuses changes, since the lens is an immutable
    value (derive a copy with ``lens.replace``)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("A lens's settings are a read-only view (of lens.fit_settings and lens.record for a fitted "
                        "lens): derive a changed lens with lens.replace(...) (e.g. lens.replace(corpus=...)).")

    __setitem__ = __delitem__ = __ior__ = update = setdefault = pop = popitem = clear = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:  # pickle and deepcopy rebuild it whole (item by item would be refused)
        return (type(self), (dict(self),))


class FrozenAttributes:
    """A lens is an immutable value: once made (:meth:`_freeze`), setting a public attribute raises; derive a copy
    with ``lens.replace(...)`` instead. Private attributes (caches) stay settable."""

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_") and self.__dict__.get("_frozen"):
            raise AttributeError(f"{type(self).__name__} is an immutable value: derive a copy with "
                                 f"lens.replace({name}=...) instead of setting {name}.")
        object.__setattr__(self, name, value)

    def _freeze(self) -> None:
        object.__setattr__(self, "_frozen", True)


class SourceLayersMixin(ReadoutMixin):
    """``layers`` from ``source_layers`` and ``target_layer``: shared by the fitted and trained lenses."""

    target_layer: int

    @property
    def source_layers(self) -> list[int]:
        raise NotImplementedError

    @property
    def layers(self) -> list[int]:
        """Readable layers: the source layers plus the target (where the lens is the identity)."""
        return self.source_layers + [self.target_layer]


class MatrixTransportMixin(FrozenAttributes, SourceLayersMixin):
    """A lens fitted by ``jlens fit`` that reads with one matrix per source layer (:meth:`matrix`): shared by
    :class:`JacobianLens` and the expert lens.

    An immutable value (docs/method.md §4): its matrices, its :attr:`fit_settings`
    (:class:`~jlens_core.lenses.fit_settings.FitSettings`, what shaped it), its :attr:`record`
    (:class:`~jlens_core.lenses.fit_settings.FitRecord`, what its fit recorded: model, prompts, diagnostics, stop
    reason, provenance, halves, canary, corpus, weighting, merge history) and its split halves. A derived lens is a
    copy with some of those replaced (:meth:`replace`, as ``dataclasses.replace``); setting an attribute raises.
    Each class lists its constructor's fields in ``_FIELDS`` and builds itself in ``_setup`` (the one place its
    fields are checked); ``__init__`` and every copy go through it.
    """

    d_model: int
    n_layers: int
    fit_settings: FitSettings
    record: FitRecord
    _device_cache: dict[tuple[int, torch.device, torch.dtype], torch.Tensor]
    _halves: tuple[Any, Any] | None
    # the fields of the class's constructor (``_setup``'s keywords), which :meth:`replace` copies
    _FIELDS: ClassVar[tuple[str, ...]] = ()

    def describe(self) -> str:
        """One line about the lens for a reader (the app's lens boxes and Jacobians page): prompts, layers and
        target, experts, and the recorded settings that shape it, read from :attr:`fit_settings` and :attr:`record`."""
        fit, record = self.fit_settings, self.record
        layers = self.source_layers
        span = f"{layers[0]}..{layers[-1]}" if len(layers) > 1 else str(layers[0])
        parts = [f"{self.n_prompts} prompts", f"layers {span} → {self.target_layer}"]
        # a one-matrix file is a combination of experts only when it says so (ExpertLens.to_jacobian_lens)
        experts = getattr(self, "n_experts", None) or (fit.experts if record.combined_from is not None else None)
        if experts:
            weighted = BY_KIND[lens_kind(self)].weighted
            parts.append(f"{experts} experts, {'learned' if weighted else 'uniform'} weights"
                         + (", combined into one matrix" if isinstance(self, JacobianLens) else ""))
        recorded = {"max_seq_len": fit.max_seq_len if record.settings_recorded else None,
                    "skip_first": self.skip_first, "corpus": record.corpus}
        parts += [f"{key} {value}" for key, value in recorded.items() if value is not None]
        shrinkage = float(getattr(self, "shrinkage", 0.0) or 0.0)  # the J lens's; an expert lens has none
        if shrinkage:
            parts.append(f"shrinkage {shrinkage:g}")
        if record.stop_reason:
            parts.append("stopped early")
        return " · ".join(parts)

    def _fields(self) -> dict[str, Any]:
        """This lens's constructor fields (``_FIELDS``), as held (``halves`` as kept: :attr:`raw_halves`)."""
        return {name: self._halves if name == "halves" else getattr(self, name) for name in self._FIELDS}

    # the class's constructor: its fields (``_FIELDS``) by keyword, checked; every lens is built by it
    _setup: Callable[..., None]

    def _set_fit(self, *, layers: Sequence[int], n_layers: int | None, fit_settings: FitSettings, record: FitRecord,
                 halves: Sequence[Any] | None) -> None:
        """Set the fields every fitted lens has (``layers``: its source layers, sorted), check its halves and freeze
        it. The settings take the lens's layers (and a target above them when they name none); the record takes the
        halves' prompt counts."""
        if not isinstance(fit_settings, FitSettings) or not isinstance(record, FitRecord):
            raise TypeError(f"A {type(self).__name__} takes a FitSettings and a FitRecord, not "
                            f"{type(fit_settings).__name__} and {type(record).__name__}.")
        target = fit_settings.target_layer if fit_settings.target_layer is not None else max(layers) + 1
        if fit_settings.source_layers != tuple(layers) or fit_settings.target_layer != target:
            fit_settings = dataclasses.replace(fit_settings, source_layers=tuple(layers), target_layer=target)
        self.fit_settings = fit_settings
        self.n_layers = int(n_layers) if n_layers is not None else target + 1
        self._set_halves(halves)
        half_prompts = None if self._halves is None else (self._halves[0].n_prompts, self._halves[1].n_prompts)
        self.record = record if record.half_prompts == half_prompts else record.replace(half_prompts=half_prompts)
        self._device_cache = {}
        self._freeze()

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` (as ``dataclasses.replace``), checked like a new lens: any of the class's
        constructor fields (``_FIELDS``: its matrices, ``d_model``, ``n_layers``, ``fit_settings``, ``record``,
        ``halves``, ...), or a field of :attr:`record` by name (``lens.replace(canary=c)`` is
        ``lens.replace(record=lens.record.replace(canary=c))``).

        Raises:
            TypeError: a name that is neither.
            ValueError: a bad value (as the constructor).
        """
        fields = self._fields()
        record_changes = {k: v for k, v in changes.items() if k not in fields and k in FitRecord.field_names()}
        unknown = [k for k in changes if k not in fields and k not in record_changes]
        if unknown:
            raise TypeError(f"{type(self).__name__}.replace has no field {unknown[0]!r}: the known ones are "
                            f"{', '.join(fields)} and the record's ({', '.join(FitRecord.field_names())}).")
        fields.update({k: v for k, v in changes.items() if k in fields})
        if record_changes:
            fields["record"] = fields["record"].replace(**record_changes)
        copy = object.__new__(type(self))
        copy._setup(**fields)
        return copy

    # -- what its fit recorded (read from the types) ------------------------------------------------
    @property
    def target_layer(self) -> int:  # type: ignore[override]  # the settings' (a plain attribute elsewhere)
        """The layer the lens carries residuals to (:attr:`fit_settings`)."""
        return int(self.fit_settings.target_layer)  # type: ignore[arg-type]  # set by _set_fit

    @property
    def rules(self) -> str:
        """The fit's backward rules (:data:`~jlens_core.lenses.kinds.RULES`)."""
        return self.fit_settings.rules

    @property
    def n_prompts(self) -> int:
        """Prompts averaged into the lens (:attr:`record`)."""
        return self.record.n_prompts

    @property
    def model_name(self) -> str | None:
        return self.record.model_name

    @property
    def model_fingerprint(self) -> dict | None:
        return self.record.model_fingerprint

    @property
    def diagnostics(self) -> list[dict]:
        """One record per prompt x source layer (docs/method.md §3): a fresh list of the record's."""
        return list(self.record.diagnostics)

    @property
    def stop_reason(self) -> str | None:
        return self.record.stop_reason

    @property
    def canary(self) -> Canary | None:
        """The forward canary of the lens check (docs/method.md §4.2), made by the fit: the record's."""
        return self.record.canary  # type: ignore[no-any-return]

    @property
    def skip_first(self) -> int | None:
        """The first position a reading counts as fitted: the fit's ``skip_first``; ``None`` when no jlens fit
        recorded its settings (a lens built by hand from matrices, an imported file)."""
        return self.fit_settings.skip_first if self.record.settings_recorded else None

    @property
    def settings(self) -> Mapping[str, Any]:
        """Deprecated: the ``settings`` dict its file records, as a read-only view of :attr:`fit_settings` and
        :attr:`record` (:func:`~jlens_core.lenses.fit_settings.settings_view`). Goes in jlens
        :data:`SETTINGS_REMOVED_IN`."""
        warnings.warn(f"{type(self).__name__}.settings is deprecated and goes in jlens {SETTINGS_REMOVED_IN}: read "
                      "lens.fit_settings (FitSettings), lens.record (FitRecord: n_skipped, provenance, corpus, "
                      "weighting, merged_from, combined_from) or lens.skip_first instead.", DeprecationWarning,
                      stacklevel=2)
        return ReadOnlySettings(self.settings_dict())

    def settings_dict(self) -> dict[str, Any]:
        """The ``settings`` dict its file's header records (docs/method.md §4.1), made from the types: a fresh dict."""
        return settings_view(self.fit_settings, self.record)

    def _set_halves(self, halves: Sequence[Any] | None) -> None:
        """Keep the split halves (docs/method.md §3.3): two lenses of this class and layers (a half may hold 0
        prompts: a fit of one prompt, a slice to merge), or ``None``.

        Raises:
            ValueError: not two lenses of this class, width and layers.
        """
        self._halves = None
        if halves is None:
            return
        halves = tuple(halves)
        if len(halves) != 2 or any(type(h) is not type(self) or h.d_model != self.d_model
                                   or h.source_layers != self.source_layers for h in halves):
            raise ValueError(f"halves must be two {type(self).__name__}s of width {self.d_model} and layers "
                             f"{self.source_layers} (the even and the odd prompts' lenses).")
        self._halves = (halves[0], halves[1])

    @property
    def raw_halves(self) -> tuple[Any, Any] | None:
        """The even and odd halves as kept, a half of 0 prompts included (for merging and saving); ``None``
        without halves. Use :meth:`halves` to read them."""
        return self._halves

    @property
    def half_prompts(self) -> tuple[int, int] | None:
        """``(n_even, n_odd)``: the prompts in each half, or ``None`` without halves."""
        return self.record.half_prompts

    def halves(self) -> tuple[Any, Any] | None:
        """The split halves (docs/method.md §3.3): ``(even, odd)``, lenses of this class and layers, the means
        of the even and the odd prompts of the fit (a prompt's half is the parity of its index in the whole
        prompt list); ``None`` when the lens (or its file) keeps none, or when a half holds no prompt."""
        if self._halves is None or min(h.n_prompts for h in self._halves) == 0:
            return None
        return self._halves

    def half_diagnostics(self) -> pd.DataFrame:
        """Per source layer, how far the halves agree and what that predicts for the lens (docs/method.md §3.3).

        Columns: ``layer``, ``n_even``, ``n_odd``, ``half_rel_diff`` and ``predicted_rel_se``
        (:func:`half_agreement`). Matrices as read (:meth:`matrix`).

        Raises:
            ValueError: the lens has no halves (one sentence: how to get them).
        """
        import pandas as pd

        halves = self.halves()
        if halves is None:
            raise ValueError("This lens keeps no split halves (fitted with --no-halves or before halves existed, "
                             "or a half has no prompt): fit it again to get them (docs/method.md §3.3).")
        even, odd = halves
        n_even, n_odd = even.n_prompts, odd.n_prompts
        rows = []
        for layer in self.source_layers:
            rel, se = half_agreement(self.matrix(layer), even.matrix(layer), odd.matrix(layer), n_even, n_odd)
            rows.append({"layer": layer, "n_even": n_even, "n_odd": n_odd, "half_rel_diff": rel,
                         "predicted_rel_se": se})
        return pd.DataFrame(rows)

    def _half_extras(self, extras: FileExtras, store: torch.dtype) -> None:
        """Add the halves' tensors (each half's own, :meth:`_file_tensors`, under ``half.even.`` / ``half.odd.``)
        and the header's ``halves`` field to ``extras``; nothing without halves."""
        if self._halves is None:
            return
        for name, half in zip(HALF_NAMES, self._halves):
            extras.add(f"{HALF_PREFIX}{name}.", half._file_tensors(store, for_half=True))
        extras.metadata["halves"] = {"prefix": HALF_PREFIX, "names": list(HALF_NAMES),
                                     "n_prompts": list(self.half_prompts or ())}

    def _file_tensors(self, store: torch.dtype, *, for_half: bool = False) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _dtype_matrices(self) -> list[torch.Tensor]:
        """The matrices whose values decide a file's storage dtype (:func:`storage_dtype`), as held."""
        raise NotImplementedError

    @property
    def fit_plan(self) -> FitPlan:
        """How its fit ran (:class:`~jlens_core.lenses.fit_settings.FitPlan`), as far as its record's provenance
        says; ``halves`` says whether it keeps its halves."""
        return FitPlan.from_lens(self.record.provenance).replace(halves=self._halves is not None)

    def matrix(self, layer: int) -> Float[torch.Tensor, "d_model d_model"]:
        raise NotImplementedError

    def export(self, path: str | os.PathLike, format: str = "reference", **options: Any) -> Any:
        """Write this lens in another library's format: ``reference``, ``transformer-lens``, ``neuronpedia`` or
        ``jpp`` (:func:`jlens_core.lenses.export.export_lens`, its options and errors; docs/sharing.md). Returns
        its :class:`~jlens_core.lenses.export.ExportResult` (the files, and what the format cannot hold)."""
        from .export import export_lens

        return export_lens(self, path, format, **options)

    def transport(self, h: Float[torch.Tensor, "*batch d_model"],
                  layer: int) -> Float[torch.Tensor, "*batch d_model"]:
        """``J_l @ h`` over the last axis (``J_l`` = :meth:`matrix`): ``[..., d_model] -> [..., d_model]``,
        in ``h``'s dtype and device.

        Raises:
            KeyError: the lens was not fitted at ``layer``.
            ValueError: the last axis of ``h`` is not ``d_model``.
        """
        if h.shape[-1] != self.d_model:
            raise ValueError(f"h has width {h.shape[-1]}, this lens is for d_model={self.d_model}.")
        if layer == self.target_layer:
            return h
        mat = cached_on_device(self._device_cache, layer, h,
                               lambda: self.matrix(layer).to(device=h.device, dtype=h.dtype))
        return h @ mat.T

    # -- combining -----------------------------------------------------------------------------
    @classmethod
    def _check_merge(cls, lenses: Sequence[Any]) -> None:
        """Raise ``ValueError`` if ``lenses`` cannot be merged for a reason of the class's own (none here)."""

    @classmethod
    def _merged_matrices(cls, lenses: Sequence[Any], total: int) -> dict[str, Any]:
        """The class's matrix fields of the merge of ``lenses`` (``total``: their prompts, at least 1)."""
        raise NotImplementedError

    @classmethod
    def merge(cls, lenses: Sequence[Self]) -> Self:
        """Lenses fitted on disjoint prompt sets as one (docs/method.md §3): the ``n_prompts``-weighted mean of their
        matrices (an expert lens adds its experts' position sums and counts), in float64; their halves merged
        alike when every lens keeps them (the halves add up like the lens, §3.3).

        Raises:
            ValueError: no lenses, lenses of different rules, widths, layers, fit settings or models (an expert
                lens: also learned weights, E or clusterings), or lenses that hold no prompt.
        """
        lenses = list(lenses)
        if not lenses:
            raise ValueError("merge needs at least one lens.")
        cls._check_merge(lenses)
        for other in lenses[1:]:
            check_mergeable(lenses[0], other)
        record = merged_record(lenses)
        halves = None
        if all(lens.raw_halves is not None for lens in lenses):
            parts = [[lens.raw_halves[h] for lens in lenses] for h in (0, 1)]  # type: ignore[index]  # all kept
            halves = (cls._merged_part(parts[0], record.for_half(0)), cls._merged_part(parts[1], record.for_half(0)))
        elif any(lens.raw_halves is not None for lens in lenses):
            log.info("Merged without split halves: some of the lenses keep none.")
        return cls._merged_part(lenses, record, halves=halves)

    @classmethod
    def _merged_part(cls, lenses: Sequence[Self], record: FitRecord, *, halves: tuple[Self, Self] | None = None) -> Self:
        """The lens (or one half: ``lenses`` are the lenses' halves of one parity) of a merge, with ``record`` and
        the prompts of ``lenses``; zeros where none of them holds a prompt (a merged half may)."""
        total = sum(lens.n_prompts for lens in lenses)
        return lenses[0].replace(record=record.replace(n_prompts=total), halves=halves,
                                 **cls._merged_matrices(lenses, max(total, 1)))


def storage_dtype(dtype: str | torch.dtype, matrices: Iterable[torch.Tensor]) -> torch.dtype:
    """The dtype a lens file stores ``matrices`` in: ``dtype`` (``float32`` or ``float16``), or float32
    with a warning when a value would overflow float16.

    Raises:
        ValueError: another dtype.
    """
    dtype = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
             "fp16": torch.float16}.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in (torch.float32, torch.float16):
        raise ValueError(f"dtype={dtype} is not supported: use float32 or float16.")
    if dtype == torch.float16:
        worst = max(float(m.abs().max()) for m in matrices)
        if not worst < FP16_MAX:
            warnings.warn(f"The lens has a value of magnitude {worst:.3g}, beyond float16's range "
                          f"({FP16_MAX}); storing float32 instead.", stacklevel=3)  # points at save's caller
            return torch.float32
    return cast(torch.dtype, dtype)


def read_lens_safetensors(path: Path, format_name: str, not_ours: str, *, prefix: str = "",
                          key: Callable[[str], _K]) -> tuple[dict[str, Any], dict[_K, torch.Tensor]]:
    """The JSON metadata of a lens file (its header: :func:`~jlens_core.lenses.header.read_header`) and its tensors
    whose names start with ``prefix`` (named by ``key``).

    Raises:
        LensFileError: the header's format is not ``format_name`` (the message: ``path`` then ``not_ours``),
            or the file cannot be read.
    """
    from safetensors import safe_open

    header = read_header(path)
    if header.metadata.get("format") != format_name:
        raise LensFileError(f"{str(path)!r} {not_ours}")
    info = header.fresh_info()
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {key(k): f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}  # noqa: SIM118
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise LensFileError(f"{str(path)!r} is not a readable lens file (truncated or not safetensors): "
                            f"{exc}") from exc
    return info, tensors


def checked_rules(path: Path, info: dict[str, Any], *, what: str, version: int) -> str:
    """The backward rules a lens file's metadata records (``"jacobian"`` when it predates the R-lens).

    Raises:
        LensFileError: a format version above ``version`` (``what`` names the format), or unknown rules.
    """
    if info.get("format_version", 0) > version:
        raise LensFileError(f"{str(path)!r} has {what} format version {info['format_version']}; this jlens "
                            f"reads up to {version}. Upgrade jlens.")
    rules = info.get("rules", "jacobian")  # files from before the R-lens are J-lenses
    if rules not in RULES:
        raise LensFileError(f"{str(path)!r} records rules={rules!r}, which this jlens does not know "
                            f"(it reads {' and '.join(RULES)}): upgrade jlens or refit the lens.")
    return rules


def check_mergeable(first: MatrixTransportMixin, other: MatrixTransportMixin) -> None:
    """Raise ``ValueError`` unless both fitted lenses (Jacobian or expert lenses) average the same quantity: one
    class, the same rules, width, layers and :class:`~jlens_core.lenses.fit_settings.FitSettings` (what shapes the
    result), on one model (and what the class checks of its own, ``_check_merge``)."""
    if other.rules != first.rules:
        raise ValueError(f"Cannot merge a {first.rules} lens with a {other.rules} lens: they average different "
                         "quantities (docs/method.md §9.1), so merge lenses of one kind only.")
    if other.d_model != first.d_model:
        raise ValueError(f"Cannot merge lenses of widths {first.d_model} and {other.d_model}.")
    if other.source_layers != first.source_layers:
        raise ValueError(f"Cannot merge lenses of layers {first.source_layers} and {other.source_layers}.")
    for key in FitSettings.field_names():  # what shapes the result: FitSettings' own fields
        a, b = getattr(first.fit_settings, key), getattr(other.fit_settings, key)
        if a != b:
            raise ValueError(f"Cannot merge lenses fitted with different {key}: {a} vs {b}.")
    if not same_fingerprint(first.model_fingerprint, other.model_fingerprint):
        raise ValueError(f"Cannot merge lenses of different models ({first.model_name!r} and "
                         f"{other.model_name!r}).")


def merged_record(lenses: Sequence[MatrixTransportMixin]) -> FitRecord:
    """The record of the merge of fitted lenses on disjoint prompt sets: the first's, with the prompts and skipped
    prompts of all, their diagnostics in order, ``merged_from``, the first canary (one model: one canary,
    docs/method.md §4.2), no stop reason, and where slices of one prompt list start (``first_prompt``).

    Raises:
        ValueError: they hold no prompt.
    """
    total = sum(lens.n_prompts for lens in lenses)
    if total <= 0:
        raise ValueError("Cannot merge lenses that hold zero prompts.")
    first = lenses[0].record
    provenance = dict(first.provenance)
    if any("first_prompt" in lens.record.provenance for lens in lenses):  # slices of one list: where the first starts
        provenance["first_prompt"] = min(int(lens.record.provenance.get("first_prompt", 0)) for lens in lenses)
    return first.replace(n_prompts=total, n_skipped=sum(lens.record.n_skipped for lens in lenses),
                         diagnostics=tuple(rec for lens in lenses for rec in lens.record.diagnostics),
                         stop_reason=None, merged_from=len(lenses), provenance=provenance,
                         canary=next((lens.canary for lens in lenses if lens.canary is not None), None))


def half_rel_diff(full: torch.Tensor, even: torch.Tensor, odd: torch.Tensor) -> float:
    """``||J_even - J_odd||_F / ||J||_F`` (docs/method.md §3.3), in the matrices' dtype (pass float64): how far a
    lens's split halves disagree, relative to the lens."""
    return float((even - odd).norm() / full.norm().clamp_min(1e-300))


def predicted_rel_se(rel_diff: float, n_even: int, n_odd: int) -> float:
    """The predicted relative standard error (Frobenius) of the full mean of ``n = n_even + n_odd`` prompts from its
    halves' :func:`half_rel_diff` (docs/method.md §3.3): ``rel_diff sqrt(n_even n_odd) / n`` (``rel_diff / 2`` for
    equal halves)."""
    return rel_diff * (n_even * n_odd) ** 0.5 / (n_even + n_odd)


def half_agreement(full: torch.Tensor, even: torch.Tensor, odd: torch.Tensor, n_even: int,
                   n_odd: int) -> tuple[float, float]:
    """``(half_rel_diff, predicted_rel_se)`` of one layer's matrices (in float64), :func:`half_rel_diff` and
    :func:`predicted_rel_se`."""
    rel = half_rel_diff(full.double(), even.double(), odd.double())
    return rel, predicted_rel_se(rel, n_even, n_odd)


class RecordKeywords(TypedDict, total=False):
    """What a fit recorded, given to a lens constructor keyword by keyword (``model_name=...``, ``settings=...``:
    the documented constructors): read into the lens's :class:`FitSettings` and :class:`FitRecord`
    (:func:`fit_types`). ``from_fit`` takes the two types instead."""

    settings: Mapping | None
    model_name: str | None
    model_fingerprint: dict | None
    diagnostics: list[dict] | None
    stop_reason: str | None


def record_types(record: Mapping[str, Any], *, layers: Sequence[int], target_layer: int, rules: str,
                 n_prompts: int) -> tuple[FitSettings, FitRecord]:
    """:func:`fit_types` of a constructor's :class:`RecordKeywords` (``record``, checked by the caller).

    Raises:
        ValueError: as :func:`fit_types`.
    """
    return fit_types(record.get("settings"), layers=layers, target_layer=target_layer, rules=rules,
                     n_prompts=n_prompts, model_name=record.get("model_name"),
                     model_fingerprint=record.get("model_fingerprint"), diagnostics=record.get("diagnostics"),
                     stop_reason=record.get("stop_reason"))


def fit_types(settings: Mapping[str, Any] | None, *, layers: Sequence[int], target_layer: int, rules: str,
              n_prompts: int, model_name: str | None, model_fingerprint: dict | None,
              diagnostics: Iterable[dict] | None, stop_reason: str | None) -> tuple[FitSettings, FitRecord]:
    """The :class:`FitSettings` and :class:`FitRecord` of a lens given by loose fields and a ``settings`` dict (the
    classes' documented constructors, a file's header: :func:`~jlens_core.lenses.fit_settings.split_lens_settings`).

    Raises:
        ValueError: unknown ``rules``, or a bad value in ``settings``.
    """
    fit, parts = split_lens_settings(settings, source_layers=list(layers), target_layer=int(target_layer), rules=rules)
    return fit, FitRecord(model_name=model_name, model_fingerprint=model_fingerprint, n_prompts=int(n_prompts),
                          diagnostics=tuple(diagnostics or ()), stop_reason=stop_reason, **parts)


def prompt_weighted_mean(weighted: Iterable[tuple[torch.Tensor, int]], total: int) -> torch.Tensor:
    """``sum_i n_i M_i / total`` in float64, returned as fp32."""
    return functools.reduce(operator.add, [mat.double() * n for mat, n in weighted]).div(total).float()


class LogitLens(FrozenAttributes, ReadoutMixin):
    """The logit lens: ``J_l = I`` at every layer. Same reading interface as :class:`JacobianLens`.

    Args:
        n_layers: decoder layers of the model (all are readable, the last is the model's output).
        d_model: residual width.
    """

    kind = BASELINE  # "logit" (the kinds' table)

    def __init__(self, n_layers: int, d_model: int) -> None:
        self.n_layers = int(n_layers)
        self.d_model = int(d_model)
        self.target_layer = self.n_layers - 1
        self._freeze()

    skip_first: int | None = None  # nothing fitted: every position is read as it is

    @property
    def settings(self) -> Mapping[str, Any]:
        """Deprecated: ``{}`` (it fits nothing); read :attr:`skip_first`. Goes in jlens :data:`SETTINGS_REMOVED_IN`."""
        warnings.warn(f"LogitLens.settings is deprecated and goes in jlens {SETTINGS_REMOVED_IN}: read "
                      "lens.skip_first (None: it fits nothing).", DeprecationWarning, stacklevel=2)
        return ReadOnlySettings()

    @classmethod
    def for_model(cls, model: LensModel) -> LogitLens:
        return cls(model.n_layers, model.d_model)

    @property
    def layers(self) -> list[int]:
        """Layers this lens can read, including the target (where every lens is the model output)."""
        return list(range(self.n_layers))

    @property
    def source_layers(self) -> list[int]:
        """Every layer below the target."""
        return list(range(self.target_layer))

    def transport(self, h: Float[torch.Tensor, "*batch d_model"],
                  layer: int) -> Float[torch.Tensor, "*batch d_model"]:
        """Identity: ``[..., d_model] -> [..., d_model]``."""
        return h

    def matrix(self, layer: int) -> Float[torch.Tensor, "d_model d_model"]:
        """``I``, fp32 ``[d_model, d_model]``.

        Raises:
            KeyError: ``layer`` outside ``0..n_layers - 1``.
        """
        if not 0 <= int(layer) < self.n_layers:
            raise KeyError(f"The logit lens reads layers 0..{self.n_layers - 1}, not layer {layer}.")
        return torch.eye(self.d_model)

    def check_model(self, model: LensModel) -> None:
        """Raise :class:`LensFileError` unless ``model`` has this lens's width and layer count."""
        if self.d_model != model.d_model or self.n_layers != model.n_layers:
            raise LensFileError(f"This {self.kind} lens is for a model with d_model={self.d_model} and "
                                f"{self.n_layers} layers; {model.name!r} has d_model={model.d_model} and "
                                f"{model.n_layers} layers. Use LogitLens.for_model(model).")

    def __repr__(self) -> str:
        return f"LogitLens(n_layers={self.n_layers}, d_model={self.d_model})"


class JacobianLens(MatrixTransportMixin):
    """A fitted Jacobian lens: ``lens_l(h) = unembed(J_l @ h)``. An immutable value (:class:`MatrixTransportMixin`):
    derive copies with :meth:`replace`, :meth:`with_shrinkage`, :meth:`with_halves`.

    This constructor makes a lens from a ``{layer: matrix}`` dict and loose fields (an importer of another
    library's lens file, a test); a fit, a file and a merge make theirs from the types, :meth:`from_fit`.

    Args:
        jacobians: ``{source_layer: Tensor[d_model, d_model]}``; row ``i`` is target dimension ``i``.
        n_prompts: prompts averaged into the lens.
        d_model: residual width.
        target_layer: the layer the lens carries residuals to (non-negative index; default: above the last source).
        n_layers: decoder layers of the model (default ``target_layer + 1``).
        settings: a lens file's settings dict (``skip_first``, ``max_seq_len``, ``dim_batch``, ...), read into
            :attr:`fit_settings` and :attr:`record` (:func:`~jlens_core.lenses.fit_settings.split_lens_settings`);
            without ``skip_first`` the lens records no fit settings (readings count every position as fitted).
        model_name / model_fingerprint: model identity (see ``HFLensModel.fingerprint``).
        diagnostics: per prompt x layer fit records (docs/method.md §3).
        shrinkage: ``a`` in ``(1 - a) J + a I`` applied by :meth:`transport` (default 0).
        stop_reason: why its fit stopped early, if it did.
        rules: the backward rules of the fit: ``"jacobian"`` (the J-lens, default) or ``"relevance"``
            (the R-lens, docs/method.md §9.1). :attr:`kind` names the lens by them.
        halves: the split halves ``(even, odd)``, two :class:`JacobianLens` of the same layers (docs/method.md
            §3.3), or ``None``; read them with :meth:`halves`.

    Raises:
        ValueError: a matrix that is not ``[d_model, d_model]``, no matrices, unknown ``rules``, a bad setting, or
            halves that are not two lenses of these layers.
    """

    _FIELDS = ("jacobians", "d_model", "n_layers", "fit_settings", "record", "shrinkage", "halves")
    jacobians: dict[int, Float[torch.Tensor, "d_model d_model"]]
    shrinkage: float

    def __init__(self, jacobians: Mapping[int, Float[torch.Tensor, "d_model d_model"]], n_prompts: int, d_model: int,
                 *,
                 target_layer: int | None = None, n_layers: int | None = None, shrinkage: float = 0.0,
                 rules: str = PLAIN_RULES, halves: tuple[JacobianLens, JacobianLens] | None = None,
                 **record_keywords: Unpack[RecordKeywords]) -> None:
        keywords = checked_options("JacobianLens", record_keywords, RecordKeywords)
        if not jacobians:
            raise ValueError("A JacobianLens needs at least one layer's matrix.")
        layers = sorted(int(layer) for layer in jacobians)
        target = int(target_layer) if target_layer is not None else layers[-1] + 1
        fit_settings, record = record_types(keywords, layers=layers, target_layer=target, rules=rules,
                                            n_prompts=n_prompts)
        self._setup(jacobians=jacobians, d_model=d_model, n_layers=n_layers, fit_settings=fit_settings, record=record,
                    shrinkage=shrinkage, halves=halves)

    @classmethod
    def from_fit(cls, jacobians: Mapping[int, Float[torch.Tensor, "d_model d_model"]], fit_settings: FitSettings,
                 record: FitRecord, *, d_model: int, n_layers: int | None = None,
                 halves: tuple[JacobianLens, JacobianLens] | None = None, shrinkage: float = 0.0) -> JacobianLens:
        """The lens of ``jacobians`` with its types: what shaped it (``fit_settings``: its layers are the matrices',
        its rules the lens's) and what its fit recorded (``record``).

        Raises:
            ValueError: as the constructor.
        """
        lens = object.__new__(cls)
        lens._setup(jacobians=jacobians, d_model=d_model, n_layers=n_layers, fit_settings=fit_settings,
                    record=record, shrinkage=shrinkage, halves=halves)
        return lens

    def _setup(self, *, jacobians: Mapping[int, torch.Tensor], d_model: int, n_layers: int | None,
               fit_settings: FitSettings, record: FitRecord, shrinkage: float,
               halves: Sequence[JacobianLens] | None) -> None:
        if not jacobians:
            raise ValueError("A JacobianLens needs at least one layer's matrix.")
        self.d_model = int(d_model)
        mats: dict[int, torch.Tensor] = {}
        for layer, mat in sorted(jacobians.items()):
            mat = torch.as_tensor(mat)
            if tuple(mat.shape) != (self.d_model, self.d_model):
                raise ValueError(f"The matrix of layer {layer} has shape {tuple(mat.shape)}, expected "
                                 f"({self.d_model}, {self.d_model}).")
            mats[int(layer)] = mat.float().cpu()
        self.jacobians = mats
        self.shrinkage = float(shrinkage)
        self._set_fit(layers=sorted(mats), n_layers=n_layers, fit_settings=fit_settings, record=record, halves=halves)

    @property
    def kind(self) -> str:
        """``"jacobian"`` (the J-lens) or ``"relevance"`` (the R-lens): names the lens in readings and tables."""
        return plain_kind(self.rules)

    def __repr__(self) -> str:
        rules = "" if self.rules == PLAIN_RULES else f", rules={self.rules!r}"
        return (f"JacobianLens(model={self.model_name!r}, layers={self.source_layers[0]}..{self.source_layers[-1]}"
                f" ({len(self.source_layers)}), target={self.target_layer}, d_model={self.d_model}, "
                f"n_prompts={self.n_prompts}{rules})")

    # -- reading -------------------------------------------------------------------------------
    @property
    def source_layers(self) -> list[int]:
        return sorted(self.jacobians)

    def matrix(self, layer: int) -> Float[torch.Tensor, "d_model d_model"]:
        """``J_l`` with shrinkage applied: ``(1 - a) J_l + a I``, fp32 ``[d_model, d_model]``.

        Raises:
            KeyError: the lens was not fitted at ``layer``.
        """
        if layer == self.target_layer:
            return torch.eye(self.d_model)
        if layer not in self.jacobians:
            raise KeyError(f"This lens was fitted at layers {self.source_layers}, not at layer {layer}.")
        mat = self.jacobians[layer]
        if self.shrinkage:
            mat = (1.0 - self.shrinkage) * mat + self.shrinkage * torch.eye(self.d_model)
        return mat

    def with_shrinkage(self, alpha: float) -> JacobianLens:
        """A copy whose :meth:`transport` uses ``(1 - alpha) J + alpha I`` (``0 <= alpha <= 1``), its halves too."""
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"shrinkage alpha={alpha} must lie in [0, 1].")
        halves = None if self._halves is None else (self._halves[0].with_shrinkage(alpha),
                                                    self._halves[1].with_shrinkage(alpha))
        return self.replace(shrinkage=alpha, halves=halves)

    def with_halves(self, halves: tuple[JacobianLens, JacobianLens] | None) -> JacobianLens:
        """A copy with the same matrices, record and canary that keeps ``halves`` (the even and the odd prompts'
        lenses, e.g. from a refit of the same prompts; docs/method.md §3.3), or none.

        Raises:
            ValueError: not two lenses of this class, width and layers.
        """
        return self.replace(halves=halves)

    def check_model(self, model: LensModel) -> None:
        """Raise :class:`LensFileError` if this lens was fitted for another model than ``model``."""
        check_made_for(self, model, what="lens", made="fitted on",
                       remedy="fit a lens for this model, or load its own lens")

    # -- files ---------------------------------------------------------------------------------
    def metadata(self) -> dict:
        return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "model_name": self.model_name,
                "model_fingerprint": self.model_fingerprint, "d_model": self.d_model,
                "n_layers": self.n_layers, "source_layers": self.source_layers,
                "target_layer": self.target_layer, "n_prompts": self.n_prompts, "settings": self.settings_dict(),
                "rules": self.rules, "stop_reason": self.stop_reason, "diagnostics": self.diagnostics}

    def _file_tensors(self, store: torch.dtype, *, for_half: bool = False) -> dict[str, torch.Tensor]:
        return {f"J.{layer}": mat.to(store).contiguous() for layer, mat in self.jacobians.items()}

    def _dtype_matrices(self) -> list[torch.Tensor]:
        return list(self.jacobians.values())

    def save(self, path: str | os.PathLike, *, dtype: str | torch.dtype = "float32", halves: bool = True) -> Path:
        """Write safetensors weights (``J.<layer>``) with the JSON metadata in the header, atomically.

        ``dtype`` is ``float32`` or ``float16``. fp16 refuses values that would overflow: it warns and
        stores fp32 instead. ``halves`` (default) also writes the split halves when the lens keeps them
        (``half.even.J.<layer>``, ``half.odd.J.<layer>`` and a ``halves`` header field, docs/method.md §3.3): the
        file is then about 3x the size.

        Returns:
            The path written.
        """
        write_lens_file(path, FORMAT_NAME, self.metadata(), self, dtype, halves)
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike, *, model: LensModel | None = None) -> JacobianLens:
        """Read a lens written by :meth:`save`, or by the reference ``jlens`` library (``torch.save``).

        Args:
            model: if given, the lens must belong to it (same width and unembedding).

        Raises:
            FileNotFoundError: no such file.
            LensFileError: not a lens file, a truncated one, or a lens for another model.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"No lens file at {str(path)!r}.")
        with open(path, "rb") as f:
            head = f.read(8)
        lens = cls._load_reference(path) if head[:2] == b"PK" else cls._load_safetensors(path)
        if model is not None:
            lens.check_model(model)
        return lens

    @classmethod
    def from_pretrained(cls, repo_or_path: str | os.PathLike, filename: str | None = None,
                        revision: str | None = None, *, model: LensModel | None = None) -> JacobianLens:
        """A lens from a local file or folder, or from a Hugging Face Hub repository.

        Args:
            repo_or_path: a lens file, a folder holding one lens file, ``owner/repo`` on the Hub, or a
                full ``hf://owner/repo[@revision]/path`` spec.
            filename: the file's path in the repo (or folder); default: its only ``.pt`` /
                ``.safetensors`` file.
            revision: the Hub branch, tag or commit (default ``main``).
            model: if given, the lens must belong to it.

        Raises:
            FileNotFoundError: nothing found (the message says what was tried: the Hub cache, the Hub;
                ``HF_HUB_OFFLINE`` honoured).
            LensFileError: not a lens, truncated, or for another model.
        """
        from .hub import LENS_SUFFIXES, hub_lens_file, is_hub_spec, parse_hub_spec

        spec = str(repo_or_path)
        if is_hub_spec(spec):
            repo, rev, path = parse_hub_spec(spec)
            return cls.load(hub_lens_file(repo, filename or path, revision or rev), model=model)
        local = Path(spec).expanduser()
        if local.is_file():
            return cls.load(local, model=model)
        if local.is_dir():
            if filename:
                return cls.load(local / filename, model=model)
            found = sorted(p for p in local.iterdir() if p.suffix in LENS_SUFFIXES)
            if len(found) != 1:
                raise FileNotFoundError(f"{spec!r} holds {len(found)} lens files; give filename=.")
            return cls.load(found[0], model=model)
        if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
            return cls.load(hub_lens_file(spec, filename, revision), model=model)
        raise FileNotFoundError(f"No lens at {spec!r}: give a lens file, a folder, owner/repo on the Hub or "
                                "hf://owner/repo[@revision]/path.")

    @classmethod
    def _load_safetensors(cls, path: Path) -> JacobianLens:
        from .canary import read_canary

        info, tensors = read_lens_safetensors(path, FORMAT_NAME, "is a safetensors file but not a jlens lens "
                                              "(no jlens metadata in its header).", key=str)
        rules = checked_rules(path, info, what="lens", version=FORMAT_VERSION)

        def matrices(named: Mapping[str, torch.Tensor]) -> dict[int, torch.Tensor]:
            return {int(k.split(".", 1)[1]): v for k, v in named.items() if k.startswith("J.")}

        own = matrices(own_tensors(tensors))
        missing = [layer for layer in info.get("source_layers", []) if layer not in own]
        if missing or not own:
            raise LensFileError(f"{str(path)!r} lacks the matrices of layers {missing or 'all'}.")
        try:
            target = info.get("target_layer")
            fit_settings, record = fit_types(
                info.get("settings"), layers=sorted(own), target_layer=int(target) if target is not None else max(own) + 1,
                rules=rules, n_prompts=info["n_prompts"], model_name=info.get("model_name"),
                model_fingerprint=info.get("model_fingerprint"), diagnostics=info.get("diagnostics"),
                stop_reason=info.get("stop_reason"))
            shape: dict[str, Any] = {"d_model": info["d_model"], "n_layers": info.get("n_layers")}
            halves = None
            half_prompts = half_prompts_of(info)
            if half_prompts is not None:
                halves = tuple(cls.from_fit(matrices(extra_tensors(tensors, f"{HALF_PREFIX}{name}.")), fit_settings,
                                            record.for_half(n), **shape) for name, n in zip(HALF_NAMES, half_prompts))
            # the lens check's canary (docs/method.md §4.2), when the file has one
            return cls.from_fit(own, fit_settings, record.replace(canary=read_canary(path)), halves=halves,  # type: ignore[arg-type]
                                **shape)
        except ValueError as exc:
            raise LensFileError(f"{str(path)!r} is not a consistent lens: {exc}") from exc

    @classmethod
    def _load_reference(cls, path: Path) -> JacobianLens:
        from .foreign import load_foreign_lens  # the .pt layouts of other libraries (docs/sharing.md)

        return load_foreign_lens(path, cls)

    # -- combining -----------------------------------------------------------------------------
    @classmethod
    def _merged_matrices(cls, lenses: Sequence[JacobianLens], total: int) -> dict[str, Any]:
        """The ``n_prompts``-weighted mean of the lenses' matrices (float64, kept fp32), unshrunk."""
        return {"jacobians": {layer: prompt_weighted_mean([(lens.jacobians[layer], lens.n_prompts) for lens in lenses],
                                                          total) for layer in lenses[0].source_layers},
                "shrinkage": 0.0}


def write_lens_file(path: str | os.PathLike, format_name: str, info: dict[str, Any], lens: MatrixTransportMixin,
                    dtype: str | torch.dtype, halves: bool, extras: FileExtras | None = None) -> None:
    """Write ``lens`` as a safetensors lens file, atomically: its own tensors (:meth:`_file_tensors`), its halves
    when it keeps them and ``halves`` is set, and ``extras`` (named extra tensors and header fields), with
    ``info`` as the header's ``jlens`` JSON. The lens's matrices and its written halves' (:meth:`_dtype_matrices`)
    decide the storage dtype (:func:`storage_dtype`)."""
    from safetensors.torch import save_file

    from .canary import canary_file_parts

    extras = extras if extras is not None else FileExtras()
    raw = lens.raw_halves if halves else None
    store = storage_dtype(dtype, [m for part in (lens, *(raw or ())) for m in part._dtype_matrices()])
    tensors = lens._file_tensors(store)
    if halves:
        lens._half_extras(extras, store)
    tensors.update(extras.tensors)
    meta = {"format": format_name, "jlens": json.dumps({**info, **extras.metadata})}
    canary_tensors, canary_meta = canary_file_parts(lens)  # the lens check's canary, when it has one (§4.2)
    tensors.update(canary_tensors)
    meta.update(canary_meta)
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta), shared=True)


def lens_layers(lens: Lens, layers: Iterable[int] | None = None) -> list[int]:
    """The readable layers of ``lens`` (optionally restricted to ``layers``), sorted."""
    available = lens.layers
    if layers is None:
        return available
    return [layer for layer in sorted(set(layers)) if layer in available]


if TYPE_CHECKING:  # mypy checks here that each lens implements the protocol every signature takes
    _logit_is_a_lens: type[Lens] = LogitLens
    _jacobian_is_a_fitted_lens: type[FittedLens] = JacobianLens
