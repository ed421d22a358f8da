"""Lens objects: the fitted Jacobian lens and the logit lens (docs/method.md §4)."""

from __future__ import annotations

import functools
import json
import logging
import operator
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

from .._atomic import atomic_write
from ..models.model import LensModel, same_fingerprint
from .fit_settings import FitPlan, FitRecord, FitSettings
from .header import FORMAT_NAME, LensFileError, read_header
from .kinds import RULES
from .protocol import FittedLens, Lens

if TYPE_CHECKING:
    from .canary import Canary

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
FP16_MAX = 65504.0
# Fit settings that shape the result: lenses that differ in any of them cannot be merged.
RESULT_SETTINGS = ("skip_first", "max_seq_len", "target_layer")
# The backward rules a lens can be fitted with (docs/method.md §9.1): "jacobian" is the J-lens, "relevance" the R-lens.
LENS_RULES = RULES  # ("jacobian", "relevance"): the rules of the lens kinds' table


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


class SourceLayersMixin:
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

    @property
    def fit_settings(self) -> FitSettings:
        """What shaped this lens (:class:`~jlens_core.lenses.fit_settings.FitSettings`): its layers and rules, and
        the ``settings`` its fit recorded (defaults where an old file has none)."""
        return FitSettings.from_lens(self.source_layers, self.target_layer, self.rules, self.settings)

    @property
    def fit_plan(self) -> FitPlan:
        """How its fit ran (:class:`~jlens_core.lenses.fit_settings.FitPlan`), as far as its settings record it."""
        return FitPlan.from_lens(self.settings)

    @property
    def record(self) -> FitRecord:
        """What its fit recorded (:class:`~jlens_core.lenses.fit_settings.FitRecord`): model, prompts counted and
        skipped, diagnostics, stop reason."""
        return FitRecord(model_name=self.model_name, model_fingerprint=self.model_fingerprint,
                         n_prompts=self.n_prompts, n_skipped=int(self.settings.get("n_skipped", 0)),
                         diagnostics=tuple(self.diagnostics), stop_reason=self.stop_reason)

    def matrix(self, layer: int) -> torch.Tensor:
        raise NotImplementedError

    def transport(self, h: torch.Tensor, layer: int) -> torch.Tensor:
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
    if all("n_skipped" in lens.settings for lens in lenses):
        settings["n_skipped"] = sum(int(lens.settings["n_skipped"]) for lens in lenses)
    return total, settings


def prompt_weighted_mean(weighted: Iterable[tuple[torch.Tensor, int]], total: int) -> torch.Tensor:
    """``sum_i n_i M_i / total`` in float64, returned as fp32."""
    return functools.reduce(operator.add, [mat.double() * n for mat, n in weighted]).div(total).float()


class LogitLens:
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

    def transport(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        """Identity: ``[..., d_model] -> [..., d_model]``."""
        return h

    def matrix(self, layer: int) -> torch.Tensor:
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

    Raises:
        ValueError: a matrix that is not ``[d_model, d_model]``, no matrices, or unknown ``rules``.
    """

    def __init__(self, jacobians: dict[int, torch.Tensor], n_prompts: int, d_model: int, *,
                 target_layer: int | None = None, n_layers: int | None = None, settings: dict | None = None,
                 model_name: str | None = None, model_fingerprint: dict | None = None,
                 diagnostics: list[dict] | None = None, shrinkage: float = 0.0, stop_reason: str | None = None,
                 rules: str = "jacobian") -> None:
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

    def matrix(self, layer: int) -> torch.Tensor:
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
        copy = JacobianLens(self.jacobians, self.n_prompts, self.d_model, target_layer=self.target_layer,
                            n_layers=self.n_layers, settings=self.settings, model_name=self.model_name,
                            model_fingerprint=self.model_fingerprint, diagnostics=self.diagnostics,
                            shrinkage=alpha, stop_reason=self.stop_reason, rules=self.rules)
        copy.canary = self.canary  # the same model: the same canary
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

    def save(self, path: str | os.PathLike, *, dtype: str | torch.dtype = "float32") -> Path:
        """Write safetensors weights (``J.<layer>``) with the JSON metadata in the header, atomically.

        ``dtype`` is ``float32`` or ``float16``. fp16 refuses values that would overflow: it warns and
        stores fp32 instead.

        Returns:
            The path written.
        """
        from safetensors.torch import save_file

        from .canary import canary_file_parts

        store = storage_dtype(dtype, self.jacobians.values())
        tensors = {f"J.{layer}": mat.to(store).contiguous() for layer, mat in self.jacobians.items()}
        meta = {"format": FORMAT_NAME, "jlens": json.dumps(self.metadata())}
        extra_tensors, extra_meta = canary_file_parts(self)  # the lens check's canary, when it has one (§4.2)
        tensors.update(extra_tensors)
        meta.update(extra_meta)
        return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta), shared=True)

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
                                              "(no jlens metadata in its header).", prefix="J.",
                                              key=lambda k: int(k.split(".", 1)[1]))
        rules = checked_rules(path, info, what="lens", version=FORMAT_VERSION)
        missing = [layer for layer in info.get("source_layers", []) if layer not in tensors]
        if missing or not tensors:
            raise LensFileError(f"{str(path)!r} lacks the matrices of layers {missing or 'all'}.")
        lens = cls(tensors, info["n_prompts"], info["d_model"], target_layer=info.get("target_layer"),
                   n_layers=info.get("n_layers"), settings=info.get("settings"),
                   model_name=info.get("model_name"), model_fingerprint=info.get("model_fingerprint"),
                   diagnostics=info.get("diagnostics"), stop_reason=info.get("stop_reason"), rules=rules)
        lens.canary = read_canary(path)
        return lens

    @classmethod
    def _load_reference(cls, path: Path) -> JacobianLens:
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise LensFileError(f"{str(path)!r} is not a readable lens file: {exc}") from exc
        if not isinstance(data, dict) or not {"J", "n_prompts", "d_model"} <= set(data):
            raise LensFileError(f"{str(path)!r} is a torch file but not a lens (expected keys J, n_prompts, "
                                "source_layers, d_model).")
        mats = data["J"]
        layers = list(data.get("source_layers") or [])
        if isinstance(mats, torch.Tensor):  # stacked [n_layers, d, d] in source_layers order
            if not layers:
                layers = list(range(mats.shape[0]))
            mats = {int(layer): mats[i] for i, layer in enumerate(layers)}
        else:
            mats = {int(k): v for k, v in mats.items()}
        return cls(mats, int(data["n_prompts"]), int(data["d_model"]), target_layer=data.get("target_layer"),
                   settings={"source": "reference jlens file"}, model_name=data.get("model_name"))

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
        merged = cls(mats, total, first.d_model, target_layer=first.target_layer, n_layers=first.n_layers,
                     settings=settings, model_name=first.model_name, model_fingerprint=first.model_fingerprint,
                     diagnostics=diagnostics, rules=first.rules)
        merged.canary = next((lens.canary for lens in lenses if lens.canary is not None), None)  # one model (§4.2)
        return merged


def lens_layers(lens: Lens, layers: Iterable[int] | None = None) -> list[int]:
    """The readable layers of ``lens`` (optionally restricted to ``layers``), sorted."""
    available = lens.layers
    if layers is None:
        return available
    return [layer for layer in sorted(set(layers)) if layer in available]


if TYPE_CHECKING:  # mypy checks here that each lens implements the protocol every signature takes
    _logit_is_a_lens: type[Lens] = LogitLens
    _jacobian_is_a_fitted_lens: type[FittedLens] = JacobianLens
