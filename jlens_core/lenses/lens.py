"""Lens objects: the fitted Jacobian lens and the logit lens (docs/method.md §4)."""

from __future__ import annotations

import functools
import json
import logging
import operator
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from jaxtyping import Float

from .._atomic import atomic_write
from ..models.model import LensModel, same_fingerprint
from .fit_settings import FitPlan, FitRecord, FitSettings
from .header import FORMAT_NAME, LensFileError, half_prompts_of, read_header
from .kinds import RULES
from .protocol import FittedLens, Lens
from .readout import ReadoutMixin

if TYPE_CHECKING:
    import pandas as pd

    from .canary import Canary

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
FP16_MAX = 65504.0
# Fit settings that shape the result: lenses that differ in any of them cannot be merged.
RESULT_SETTINGS = ("skip_first", "max_seq_len", "target_layer")
# The backward rules a lens can be fitted with (docs/method.md §9.1): "jacobian" is the J-lens, "relevance" the R-lens.
LENS_RULES = RULES  # ("jacobian", "relevance"): the rules of the lens kinds' table
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


class MatrixTransportMixin(SourceLayersMixin):
    """The transport of a lens that reads with one matrix per source layer (:meth:`matrix`), kept on the
    reading's device and dtype: shared by :class:`JacobianLens` and the expert lens."""

    d_model: int
    rules: str
    _device_cache: dict[tuple[int, torch.device, torch.dtype], torch.Tensor]

    def _set_fit_record(self, n_prompts: int, target_layer: int, n_layers: int | None, settings: dict | None,
                        model_name: str | None, model_fingerprint: dict | None, diagnostics: list[dict] | None,
                        stop_reason: str | None) -> None:
        """Set what a fit records besides its matrices (the constructors' arguments of those names)."""
        self.n_prompts = int(n_prompts)
        self.target_layer = int(target_layer)
        self.n_layers = int(n_layers) if n_layers is not None else self.target_layer + 1
        self.settings = dict(settings or {})
        self.settings.setdefault("target_layer", self.target_layer)
        self.model_name = model_name
        self.model_fingerprint = model_fingerprint
        self.diagnostics = list(diagnostics or [])
        self.stop_reason = stop_reason
        self._device_cache = {}
        self.canary: Canary | None = None  # the forward canary of the lens check (docs/method.md §4.2), set by fit

    def _set_halves(self, halves: Sequence[Any] | None) -> None:
        """Keep the split halves (docs/method.md §3.3): two lenses of this class and layers (a half may hold 0
        prompts: a fit of one prompt, a slice to merge), or ``None``.

        Raises:
            ValueError: not two lenses of this class, width and layers.
        """
        self._halves: tuple[Any, Any] | None = None
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
        return None if self._halves is None else (self._halves[0].n_prompts, self._halves[1].n_prompts)

    def halves(self) -> tuple[Any, Any] | None:
        """The split halves (docs/method.md §3.3): ``(even, odd)``, lenses of this class and layers, the means
        of the even and the odd prompts of the fit (a prompt's half is the parity of its index in the whole
        prompt list); ``None`` when the lens (or its file) keeps none, or when a half holds no prompt."""
        if self._halves is None or min(h.n_prompts for h in self._halves) == 0:
            return None
        return self._halves

    def half_diagnostics(self) -> pd.DataFrame:
        """Per source layer, how far the halves agree and what that predicts for the lens (docs/method.md §3.3).

        Columns: ``layer``, ``n_even``, ``n_odd``, ``half_rel_diff`` = ``||J_even - J_odd||_F / ||J||_F`` and
        ``predicted_rel_se`` = ``||J_even - J_odd||_F sqrt(n_even n_odd) / (n ||J||_F)``, the predicted relative
        standard error (Frobenius) of the full mean of ``n`` prompts (``half_rel_diff / 2`` for equal halves).
        Matrices as read (:meth:`matrix`).

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
        n = n_even + n_odd
        rows = []
        for layer in self.source_layers:
            full = self.matrix(layer).double()
            diff = float((even.matrix(layer).double() - odd.matrix(layer).double()).norm())
            rel = diff / max(float(full.norm()), 1e-300)
            rows.append({"layer": layer, "n_even": n_even, "n_odd": n_odd, "half_rel_diff": rel,
                         "predicted_rel_se": rel * (n_even * n_odd) ** 0.5 / n})
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
    def fit_settings(self) -> FitSettings:
        """What shaped this lens (:class:`~jlens_core.lenses.fit_settings.FitSettings`): its layers and rules, and
        the ``settings`` its fit recorded (defaults where an old file has none)."""
        return FitSettings.from_lens(self.source_layers, self.target_layer, self.rules, self.settings)

    @property
    def fit_plan(self) -> FitPlan:
        """How its fit ran (:class:`~jlens_core.lenses.fit_settings.FitPlan`), as far as its settings record it;
        ``halves`` says whether it keeps its halves."""
        return FitPlan.from_lens(self.settings).replace(halves=self._halves is not None)

    @property
    def record(self) -> FitRecord:
        """What its fit recorded (:class:`~jlens_core.lenses.fit_settings.FitRecord`): model, prompts counted and
        skipped, diagnostics, stop reason."""
        return FitRecord(model_name=self.model_name, model_fingerprint=self.model_fingerprint,
                         n_prompts=self.n_prompts, n_skipped=int(self.settings.get("n_skipped", 0)),
                         diagnostics=tuple(self.diagnostics), stop_reason=self.stop_reason,
                         half_prompts=self.half_prompts)

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
    if rules not in LENS_RULES:
        raise LensFileError(f"{str(path)!r} records rules={rules!r}, which this jlens does not know "
                            f"(it reads {' and '.join(LENS_RULES)}): upgrade jlens or refit the lens.")
    return rules


def check_mergeable(first: MatrixTransportMixin, other: MatrixTransportMixin) -> None:
    """Raise ``ValueError`` unless both fitted lenses (Jacobian or expert lenses) were fitted with the same result settings on one model."""
    for key in RESULT_SETTINGS:
        if first.settings.get(key) != other.settings.get(key):
            raise ValueError(f"Cannot merge lenses fitted with different {key}: "
                             f"{first.settings.get(key)} vs {other.settings.get(key)}.")
    if not same_fingerprint(first.model_fingerprint, other.model_fingerprint):
        raise ValueError(f"Cannot merge lenses of different models ({first.model_name!r} and "
                         f"{other.model_name!r}).")


def merged_prompts(lenses: Sequence[MatrixTransportMixin]) -> tuple[int, dict[str, Any]]:
    """The prompts fitted lenses (Jacobian or expert lenses) on disjoint prompt sets hold together, and their merged settings.

    Raises:
        ValueError: they hold no prompt.
    """
    total = sum(lens.n_prompts for lens in lenses)
    if total <= 0:
        raise ValueError("Cannot merge lenses that hold zero prompts.")
    settings = dict(lenses[0].settings, merged_from=len(lenses))
    if any("first_prompt" in lens.settings for lens in lenses):  # slices of one list: where the first one starts
        settings["first_prompt"] = min(int(lens.settings.get("first_prompt", 0)) for lens in lenses)
    if all("n_skipped" in lens.settings for lens in lenses):
        settings["n_skipped"] = sum(int(lens.settings["n_skipped"]) for lens in lenses)
    return total, settings


def prompt_weighted_mean(weighted: Iterable[tuple[torch.Tensor, int]], total: int) -> torch.Tensor:
    """``sum_i n_i M_i / total`` in float64, returned as fp32."""
    return functools.reduce(operator.add, [mat.double() * n for mat, n in weighted]).div(total).float()


class LogitLens(ReadoutMixin):
    """The logit lens: ``J_l = I`` at every layer. Same reading interface as :class:`JacobianLens`.

    Args:
        n_layers: decoder layers of the model (all are readable, the last is the model's output).
        d_model: residual width.
    """

    kind = "logit"

    def __init__(self, n_layers: int, d_model: int) -> None:
        self.n_layers = int(n_layers)
        self.d_model = int(d_model)
        self.target_layer = self.n_layers - 1
        self.settings: dict[str, Any] = {}  # nothing fitted: every position is read as it is

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
    """A fitted Jacobian lens: ``lens_l(h) = unembed(J_l @ h)``.

    Args:
        jacobians: ``{source_layer: Tensor[d_model, d_model]}``; row ``i`` is target dimension ``i``.
        n_prompts: prompts averaged into the lens.
        d_model: residual width.
        target_layer: the layer the lens carries residuals to (non-negative index).
        n_layers: decoder layers of the model (default ``target_layer + 1``).
        settings: fit settings (``skip_first``, ``max_seq_len``, ``dim_batch``, ...).
        model_name / model_fingerprint: model identity (see ``HFLensModel.fingerprint``).
        diagnostics: per prompt x layer fit records (docs/method.md §3).
        shrinkage: ``a`` in ``(1 - a) J + a I`` applied by :meth:`transport` (default 0).
        rules: the backward rules of the fit: ``"jacobian"`` (the J-lens, default) or ``"relevance"``
            (the R-lens, docs/method.md §9.1). :attr:`kind` is the same word.
        halves: the split halves ``(even, odd)``, two :class:`JacobianLens` of the same layers (docs/method.md
            §3.3), or ``None``; read them with :meth:`halves`.

    Raises:
        ValueError: a matrix that is not ``[d_model, d_model]``, no matrices, unknown ``rules``, or halves that
            are not two lenses of these layers.
    """

    def __init__(self, jacobians: dict[int, Float[torch.Tensor, "d_model d_model"]], n_prompts: int, d_model: int,
                 *,
                 target_layer: int | None = None, n_layers: int | None = None, settings: dict | None = None,
                 model_name: str | None = None, model_fingerprint: dict | None = None,
                 diagnostics: list[dict] | None = None, shrinkage: float = 0.0, stop_reason: str | None = None,
                 rules: str = "jacobian", halves: tuple[JacobianLens, JacobianLens] | None = None) -> None:
        if not jacobians:
            raise ValueError("A JacobianLens needs at least one layer's matrix.")
        if rules not in LENS_RULES:
            raise ValueError(f"rules={rules!r} is not one of {LENS_RULES}.")
        self.rules = rules
        self.d_model = int(d_model)
        self.jacobians: dict[int, torch.Tensor] = {}
        for layer, mat in sorted(jacobians.items()):
            mat = torch.as_tensor(mat)
            if tuple(mat.shape) != (self.d_model, self.d_model):
                raise ValueError(f"The matrix of layer {layer} has shape {tuple(mat.shape)}, expected "
                                 f"({self.d_model}, {self.d_model}).")
            self.jacobians[int(layer)] = mat.float().cpu()
        self._set_fit_record(n_prompts, target_layer if target_layer is not None else max(self.jacobians) + 1,
                             n_layers, settings, model_name, model_fingerprint, diagnostics, stop_reason)
        self.shrinkage = float(shrinkage)
        self._set_halves(halves)

    @property
    def kind(self) -> str:
        """``"jacobian"`` (the J-lens) or ``"relevance"`` (the R-lens): names the lens in readings and tables."""
        return self.rules

    def __repr__(self) -> str:
        rules = "" if self.rules == "jacobian" else f", rules={self.rules!r}"
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
        """A copy whose :meth:`transport` uses ``(1 - alpha) J + alpha I`` (``0 <= alpha <= 1``)."""
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"shrinkage alpha={alpha} must lie in [0, 1].")
        halves = None if self._halves is None else (self._halves[0].with_shrinkage(alpha),
                                                    self._halves[1].with_shrinkage(alpha))
        return self._copy(shrinkage=alpha, halves=halves)

    def with_halves(self, halves: tuple[JacobianLens, JacobianLens] | None) -> JacobianLens:
        """A copy with the same matrices, record and canary that keeps ``halves`` (the even and the odd prompts'
        lenses, e.g. from a refit of the same prompts; docs/method.md §3.3), or none.

        Raises:
            ValueError: not two lenses of this class, width and layers.
        """
        return self._copy(shrinkage=self.shrinkage, halves=halves)

    def _copy(self, *, shrinkage: float, halves: tuple[JacobianLens, JacobianLens] | None) -> JacobianLens:
        copy = JacobianLens(self.jacobians, self.n_prompts, self.d_model, target_layer=self.target_layer,
                            n_layers=self.n_layers, settings=self.settings, model_name=self.model_name,
                            model_fingerprint=self.model_fingerprint, diagnostics=self.diagnostics,
                            shrinkage=shrinkage, stop_reason=self.stop_reason, rules=self.rules, halves=halves)
        copy.canary = self.canary  # the same model: the same canary (docs/method.md §4.2)
        return copy

    def check_model(self, model: LensModel) -> None:
        """Raise :class:`LensFileError` if this lens was fitted for another model than ``model``."""
        check_made_for(self, model, what="lens", made="fitted on",
                       remedy="fit a lens for this model, or load its own lens")

    # -- files ---------------------------------------------------------------------------------
    def metadata(self) -> dict:
        return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "model_name": self.model_name,
                "model_fingerprint": self.model_fingerprint, "d_model": self.d_model,
                "n_layers": self.n_layers, "source_layers": self.source_layers,
                "target_layer": self.target_layer, "n_prompts": self.n_prompts, "settings": self.settings,
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
        common: dict[str, Any] = {"target_layer": info.get("target_layer"), "n_layers": info.get("n_layers"),
                                  "settings": info.get("settings"), "model_name": info.get("model_name"),
                                  "model_fingerprint": info.get("model_fingerprint"), "rules": rules}
        halves = None
        half_prompts = half_prompts_of(info)
        if half_prompts is not None:
            halves = tuple(cls(matrices(extra_tensors(tensors, f"{HALF_PREFIX}{name}.")), n, info["d_model"],
                               **common) for name, n in zip(HALF_NAMES, half_prompts))
        try:
            lens = cls(own, info["n_prompts"], info["d_model"], diagnostics=info.get("diagnostics"),
                       stop_reason=info.get("stop_reason"), halves=halves, **common)  # type: ignore[arg-type]
        except ValueError as exc:
            raise LensFileError(f"{str(path)!r} is not a consistent lens: {exc}") from exc
        lens.canary = read_canary(path)  # the lens check's canary (docs/method.md §4.2), when the file has one
        return lens

    @classmethod
    def _load_reference(cls, path: Path) -> JacobianLens:
        from .foreign import load_foreign_lens  # the .pt layouts of other libraries (docs/sharing.md)

        return load_foreign_lens(path, cls)

    # -- combining -----------------------------------------------------------------------------
    @classmethod
    def merge(cls, lenses: Sequence[JacobianLens]) -> JacobianLens:
        """The ``n_prompts``-weighted mean of lenses fitted on disjoint prompt sets.

        Raises:
            ValueError: no lenses, or lenses of different rules, layers, widths, target, settings or model.
        """
        lenses = list(lenses)
        if not lenses:
            raise ValueError("merge needs at least one lens.")
        first = lenses[0]
        for other in lenses[1:]:
            if other.rules != first.rules:
                raise ValueError(f"Cannot merge a {first.rules} lens with a {other.rules} lens: they average "
                                 "different quantities (docs/method.md §9.1), so merge lenses of one kind only.")
            if other.d_model != first.d_model:
                raise ValueError(f"Cannot merge lenses of widths {first.d_model} and {other.d_model}.")
            if other.source_layers != first.source_layers:
                raise ValueError(f"Cannot merge lenses of layers {first.source_layers} and {other.source_layers}.")
            check_mergeable(first, other)
        total, settings = merged_prompts(lenses)
        mats = {layer: prompt_weighted_mean([(lens.jacobians[layer], lens.n_prompts) for lens in lenses], total)
                for layer in first.source_layers}
        diagnostics = [rec for lens in lenses for rec in lens.diagnostics]
        halves = None
        if all(lens.raw_halves is not None for lens in lenses):  # the halves add up like the lens (§3.3)
            halves = tuple(_merged_half(cls, [lens.raw_halves[h] for lens in lenses], settings)  # type: ignore[index]
                           for h in (0, 1))
        elif any(lens.raw_halves is not None for lens in lenses):
            log.info("Merged without split halves: some of the lenses keep none.")
        merged = cls(mats, total, first.d_model, target_layer=first.target_layer, n_layers=first.n_layers,
                     settings=settings, model_name=first.model_name, model_fingerprint=first.model_fingerprint,
                     diagnostics=diagnostics, rules=first.rules, halves=halves)  # type: ignore[arg-type]
        merged.canary = next((lens.canary for lens in lenses if lens.canary is not None), None)  # one model (§4.2)
        return merged


def _merged_half(cls: type[JacobianLens], halves: Sequence[JacobianLens], settings: dict) -> JacobianLens:
    """One half of a merge: the ``n_prompts``-weighted mean of that half of each lens (zeros when none of
    them holds a prompt of it)."""
    first = halves[0]
    total = sum(h.n_prompts for h in halves)
    mats = {layer: prompt_weighted_mean([(h.jacobians[layer], h.n_prompts) for h in halves], max(total, 1))
            for layer in first.source_layers}
    return cls(mats, total, first.d_model, target_layer=first.target_layer, n_layers=first.n_layers,
               settings=settings, model_name=first.model_name, model_fingerprint=first.model_fingerprint,
               rules=first.rules)


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
