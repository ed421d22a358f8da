"""The tuned lens (Belrose et al., 2023): a trained affine translator per layer, read as
``unembed(h + A_l h + b_l)``.

``A_l`` and ``b_l`` start at zero, so an untrained tuned lens is the logit lens exactly; training
(:func:`jlens_core.fitting.tuning.train_tuned_lens`) minimises ``KL(final || lens)`` over corpus
tokens. It has the reading interface of :class:`~jlens_core.JacobianLens` (``kind``, ``layers``,
``source_layers``, ``target_layer``, ``transport``, ``check_model``), so ``read_prompt``,
``evaluate``, ``pass_at_k``, the interventions (its read direction is ``(I + A_l)^T C (gamma u_t)``)
and every app view take it.

Files: safetensors (``A.<layer>`` ``[d, d]``, ``b.<layer>`` ``[d]``) with JSON metadata like the
Jacobian lens's (format ``jlens-tuned``, model identity, layers, training settings, final held-out
KL). :meth:`TunedLens.load` also reads **tuned-lens's own released format**: a folder with
``config.json`` (``d_model``, ``num_hidden_layers``, ``base_model_name_or_path``) and ``params.pt``
(``layer_translators`` state dict; translator ``i`` reads ``hidden_states[i]``, so jlens layer ``l``
is translator ``l + 1``; translator 0, on the embeddings, has no jlens layer and is dropped).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float

from .._atomic import atomic_write
from ..models.model import LensModel
from .header import TUNED_FORMAT_NAME, ForeignFileError, LensFileError, read_header
from .kinds import TRAINED
from .lens import FrozenAttributes, ReadOnlySettings, SourceLayersMixin, cached_on_device, check_made_for

if TYPE_CHECKING:
    from .protocol import FittedLens

log = logging.getLogger(__name__)

FORMAT_NAME = TUNED_FORMAT_NAME
FORMAT_VERSION = 1


class TunedLens(FrozenAttributes, SourceLayersMixin):
    """Per source layer ``l``: ``transport(h) = h + h A_l^T + b_l`` (``A_l [d, d]``, ``b_l [d]``).

    Args:
        translators: ``{layer: (A, b)}`` (zero matrices give the logit lens).
        d_model: residual width.
        target_layer: the model's last layer (where every lens is the model's output).
        n_layers: the model's layer count (default ``target_layer + 1``).
        model_name, model_fingerprint: the model's identity (checked on load and before reading).
        settings: how it was trained (steps, tokens, lr, ...; :class:`~jlens_core.fitting.tuning.TuneSettings`
            and what the trainer adds): kept read-only.
        metrics: e.g. ``{"heldout_kl_bits": {layer: kl}}`` at the end of training: kept read-only.

    An immutable value, as every lens: derive a changed one with :meth:`replace`.
    """

    def describe(self) -> str:
        """One line about the lens for a reader (the app's lens boxes): layers and target, its training (steps x
        tokens, or the tuned-lens format it was read from) and its mean held-out KL (bits) where recorded."""
        layers = self.source_layers
        parts = [f"layers {layers[0]}..{layers[-1]} → {self.target_layer}" if layers else "no layers"]
        trained: dict[str, Any] = dict(self.settings)
        if trained.get("source") == "tuned-lens":
            parts.append("tuned-lens format")
        if trained.get("steps"):
            parts.append(f"{trained['steps']} steps × {trained.get('tokens_per_step', '?')} tokens")
        metrics: dict[str, Any] = dict(self.metrics or {})
        kl = metrics.get("heldout_kl_bits")
        if kl:
            parts.append(f"held-out KL {sum(kl.values()) / len(kl):.2f} bits")
        return " · ".join(parts)

    # the constructor's fields, which replace() copies
    _FIELDS = ("translators", "d_model", "target_layer", "n_layers", "model_name", "model_fingerprint", "settings",
               "metrics")

    kind = TRAINED  # "tuned" (the kinds' table)

    def __init__(self,
                 translators: dict[int, tuple[Float[torch.Tensor, "d_model d_model"], Float[torch.Tensor, " d_model"]]],
                 d_model: int, *,
                 target_layer: int, n_layers: int | None = None, model_name: str = "",
                 model_fingerprint: dict | None = None, settings: dict | None = None,
                 metrics: dict | None = None) -> None:
        self.d_model = int(d_model)
        self.target_layer = int(target_layer)
        self.n_layers = int(n_layers) if n_layers is not None else self.target_layer + 1
        self.translators: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer, (a, b) in sorted(translators.items()):
            layer = int(layer)
            if not 0 <= layer < self.target_layer:
                raise ValueError(f"Translator layer {layer} is outside 0..{self.target_layer - 1} (below the target "
                                 f"layer {self.target_layer}).")
            a, b = torch.as_tensor(a).float().cpu(), torch.as_tensor(b).float().cpu()
            if tuple(a.shape) != (self.d_model, self.d_model) or tuple(b.shape) != (self.d_model,):
                raise ValueError(f"Translator {layer} has shapes {tuple(a.shape)} and {tuple(b.shape)}; expected "
                                 f"({self.d_model}, {self.d_model}) and ({self.d_model},).")
            self.translators[layer] = (a, b)
        self.model_name = model_name
        self.model_fingerprint = model_fingerprint
        self.settings = ReadOnlySettings(settings or {})
        self.metrics = ReadOnlySettings(metrics or {})
        self._device_cache: dict[tuple[int, torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self._freeze()

    def replace(self, **changes: Any) -> TunedLens:
        """A copy with ``changes`` (as ``dataclasses.replace``): any constructor field (``translators``, ``settings``,
        ``metrics``, ...); ``lens.replace(settings={**lens.settings, "corpus": c})`` records more.

        Raises:
            TypeError: a name that is no field.
            ValueError: a bad value (as the constructor).
        """
        unknown = [k for k in changes if k not in self._FIELDS]
        if unknown:
            raise TypeError(f"TunedLens.replace has no field {unknown[0]!r}: the known ones are {', '.join(self._FIELDS)}.")
        return TunedLens(**{**{name: getattr(self, name) for name in self._FIELDS}, **changes})

    @classmethod
    def zeros(cls, model: LensModel, layers: Iterable[int] | None = None, **kwargs: Any) -> TunedLens:
        """An untrained tuned lens for ``model`` (the logit lens), at ``layers`` (default: all sources)."""
        target = model.n_layers - 1
        chosen = range(target) if layers is None else sorted({int(x) for x in layers})
        d = model.d_model
        return cls({layer: (torch.zeros(d, d), torch.zeros(d)) for layer in chosen}, d, target_layer=target,
                   n_layers=model.n_layers, model_name=model.name, model_fingerprint=model.fingerprint(), **kwargs)

    def __repr__(self) -> str:
        layers = self.source_layers
        span = f"{layers[0]}..{layers[-1]}" if layers else "none"
        return f"TunedLens(layers {span} -> {self.target_layer}, d_model={self.d_model})"

    @property
    def source_layers(self) -> list[int]:
        return sorted(self.translators)

    @property
    def skip_first(self) -> int | None:
        """The leading positions its training left out (its settings' ``skip_first``), or ``None``."""
        value = self.settings.get("skip_first")
        return None if value is None else int(value)

    def matrix(self, layer: int) -> Float[torch.Tensor, "d_model d_model"]:
        """``I + A_layer`` (fp32): the linear part of the transport."""
        a, _ = self.translators[int(layer)]
        return torch.eye(self.d_model) + a

    def transport(self, h: Float[torch.Tensor, "*batch d_model"],
                  layer: int) -> Float[torch.Tensor, "*batch d_model"]:
        """``h + h A^T + b`` over the last axis (identity at the target layer).

        Raises:
            KeyError: no translator at ``layer``.
            ValueError: the last axis is not ``d_model``.
        """
        if h.shape[-1] != self.d_model:
            raise ValueError(f"h has width {h.shape[-1]}, this lens is for d_model={self.d_model}.")
        if layer == self.target_layer:
            return h
        if int(layer) not in self.translators:
            raise KeyError(f"The tuned lens has no translator at layer {layer}; it reads layers {self.source_layers}.")
        def on_device() -> tuple[torch.Tensor, torch.Tensor]:
            a, b = self.translators[int(layer)]
            return a.to(device=h.device, dtype=h.dtype), b.to(device=h.device, dtype=h.dtype)

        a, b = cached_on_device(self._device_cache, int(layer), h, on_device)
        return h + h @ a.T + b

    def check_model(self, model: LensModel) -> None:
        """Raise :class:`LensFileError` if this lens was trained for another model than ``model``."""
        check_made_for(self, model, what="tuned lens", made="trained for", remedy="load the lens of this model")

    # -- files ---------------------------------------------------------------------------------------
    def metadata(self) -> dict:
        return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "model_name": self.model_name,
                "model_fingerprint": self.model_fingerprint, "d_model": self.d_model, "layers": self.source_layers,
                "target_layer": self.target_layer, "n_layers": self.n_layers, "settings": self.settings,
                "metrics": self.metrics}

    def save(self, path: str | os.PathLike, *, dtype: str | torch.dtype = "float32") -> Path:
        """Write safetensors with the metadata in its header, atomically; ``dtype`` ``"float32"`` or
        ``"float16"`` (half the size; read back as fp32).

        Raises:
            ValueError: another dtype, or fp16 storage of values beyond fp16's range.
        """
        from safetensors.torch import save_file

        store = {"float32": torch.float32, "float16": torch.float16}.get(str(dtype).replace("torch.", ""))
        if store is None:
            raise ValueError(f"dtype={dtype!r}: a tuned lens is stored as float32 or float16.")
        tensors = {}
        for layer, (a, b) in self.translators.items():
            if store == torch.float16 and max(float(a.abs().max()), float(b.abs().max())) > 65504.0:
                raise ValueError(f"Translator {layer} holds values beyond fp16's range: save as float32.")
            tensors[f"A.{layer}"] = a.to(store).contiguous()
            tensors[f"b.{layer}"] = b.to(store).contiguous()
        meta = {"jlens": json.dumps(self.metadata())}
        return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta), shared=True)

    @classmethod
    def load(cls, path: str | os.PathLike, *, model: LensModel | None = None) -> TunedLens:
        """A tuned lens from a jlens ``.safetensors`` file or a tuned-lens folder (``config.json`` +
        ``params.pt``); with ``model``, checked against it.

        Raises:
            FileNotFoundError: no such file or folder.
            LensFileError: not a tuned lens, a corrupt params file, or a lens of another model.
        """
        path = Path(path)
        if path.is_dir():
            lens = cls._load_tuned_lens_folder(path, model)
        elif path.is_file():
            lens = cls._load_safetensors(path)
        else:
            raise FileNotFoundError(f"No tuned lens at {str(path)!r}: give a .safetensors file or a tuned-lens folder "
                                    "(config.json and params.pt).")
        if model is not None:
            lens.check_model(model)
        return lens

    @classmethod
    def _load_safetensors(cls, path: Path) -> TunedLens:
        from safetensors import safe_open

        try:
            header = read_header(path)
        except ForeignFileError:
            raise LensFileError(f"{str(path)!r} is not a tuned lens file (format None).") from None
        except LensFileError as exc:
            raise LensFileError(f"{str(path)!r} cannot be read as a tuned lens ({exc}).") from None
        info = header.fresh_info()
        if info.get("format") != FORMAT_NAME:
            raise LensFileError(f"{str(path)!r} is not a tuned lens file (format {info.get('format')!r}).")
        try:
            with safe_open(str(path), framework="pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
        except Exception as exc:  # noqa: BLE001 - safetensors raises several kinds on a bad file
            raise LensFileError(f"{str(path)!r} cannot be read as a tuned lens ({type(exc).__name__}: {exc}).") from None
        translators = {}
        for layer in info["layers"]:
            try:
                translators[int(layer)] = (tensors[f"A.{layer}"], tensors[f"b.{layer}"])
            except KeyError:
                raise LensFileError(f"{str(path)!r} lists layer {layer} but holds no translator for it "
                                    "(truncated?).") from None
        return cls(translators, info["d_model"], target_layer=info["target_layer"], n_layers=info.get("n_layers"),
                   model_name=info.get("model_name", ""), model_fingerprint=info.get("model_fingerprint"),
                   settings=info.get("settings"), metrics=info.get("metrics"))

    @classmethod
    def _load_tuned_lens_folder(cls, folder: Path, model: LensModel | None) -> TunedLens:
        config_path, params_path = folder / "config.json", folder / "params.pt"
        if not config_path.is_file() or not params_path.is_file():
            raise LensFileError(f"{str(folder)!r} is not a tuned-lens folder: it needs config.json and params.pt.")
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
            d_model, n_hidden = int(config["d_model"]), int(config["num_hidden_layers"])
        except (ValueError, KeyError, TypeError) as exc:
            raise LensFileError(f"{str(config_path)!r} is not a tuned-lens config (needs d_model and "
                                f"num_hidden_layers): {exc}.") from None
        if model is not None and (d_model != model.d_model or n_hidden != model.n_layers):
            raise LensFileError(f"The tuned lens in {str(folder)!r} is for {config.get('base_model_name_or_path')!r} "
                                f"(d_model {d_model}, {n_hidden} layers); {model.name!r} has d_model {model.d_model} "
                                f"and {model.n_layers} layers.")
        try:
            state = torch.load(params_path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - torch raises several kinds on a corrupt file
            raise LensFileError(f"{str(params_path)!r} is corrupt or not a tuned-lens params file "
                                f"({type(exc).__name__}).") from None
        if not isinstance(state, dict):
            raise LensFileError(f"{str(params_path)!r} holds a {type(state).__name__}, not a state dict.")
        state = {k.removeprefix("layer_translators."): v for k, v in state.items()}
        translators = {}
        for index in range(1, n_hidden):  # translator i reads hidden_states[i] = the output of layer i - 1
            weight = state.get(f"{index}.weight")
            if weight is None:
                raise LensFileError(f"{str(params_path)!r} has no translator {index} ({index}.weight); it holds "
                                    f"{sorted(state)[:6]}...")
            bias = state.get(f"{index}.bias", torch.zeros(d_model))
            translators[index - 1] = (weight, bias)
        return cls(translators, d_model, target_layer=n_hidden - 1, n_layers=n_hidden,
                   model_name=str(config.get("base_model_name_or_path", "")),
                   model_fingerprint=model.fingerprint() if model is not None else None,
                   settings={"source": "tuned-lens", "config": config})

    def save_tuned_lens_folder(self, folder: str | os.PathLike) -> Path:
        """Write tuned-lens's own format (``config.json`` + ``params.pt``; translator 0 left at zero)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        d = self.d_model
        state = {}
        for index in range(self.n_layers):
            a, b = self.translators.get(index - 1, (torch.zeros(d, d), torch.zeros(d)))
            state[f"{index}.weight"], state[f"{index}.bias"] = a.clone(), b.clone()
        torch.save(state, folder / "params.pt")
        (folder / "config.json").write_text(json.dumps({
            "base_model_name_or_path": self.model_name, "d_model": d, "num_hidden_layers": self.n_layers,
            "bias": True, "base_model_revision": None, "unembed_hash": None, "lens_type": "linear_tuned_lens"}))
        return folder


if TYPE_CHECKING:  # mypy checks here that the tuned lens implements the protocol every signature takes
    _tuned_is_a_fitted_lens: type[FittedLens] = TunedLens

__all__ = ["TunedLens"]
