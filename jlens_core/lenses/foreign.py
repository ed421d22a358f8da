"""Lenses written by other libraries: the ``torch.save`` layouts jlens reads (docs/sharing.md).

Every ``.pt`` file is read with ``torch.load(..., weights_only=True)`` only: a pickle that needs code to load
(a class, a function) is refused, never run. The layouts known (:data:`LAYOUTS`):

* ``reference``: ``{"J": {layer: [d, d]} | [n, d, d], "n_prompts", "source_layers", "d_model"}`` (the reference
  jlens library's file); with ``metadata`` (jlens's TransformerLens export) or ``provenance`` (Neuronpedia's files,
  jlens's Neuronpedia export), whose model identity, target and rules are read where they are jlens's own;
* ``jpp``: ``{"parameters": {"jacobians": {layer: [d, d]}}, "source_layers", "config"}``, a J++ file as published:
  each layer's combined map only, so it reads as a J++ (or, with an ``lrp_mode``, R++) lens that cannot be
  re-weighted or merged (no expert matrices, clustering or weights);
* ``reference checkpoint``: ``{"jacobian_sum", "n_done", "next_idx", "source_layers", "target_layer",
  "skip_first"}``, a reference fit's checkpoint: not a lens; ``jlens fit --resume-from`` continues it
  (:func:`read_reference_checkpoint`).
"""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from .header import LensFileError
from .kinds import PLAIN_FITTED, expert_kind

# The lens class is passed in by JacobianLens.load (this module does not import lens.py, which imports it).
JacobianLens = Any

log = logging.getLogger(__name__)

LAYOUTS = {
    "reference": "J, n_prompts, source_layers, d_model (the reference jlens file; + metadata: TransformerLens; "
                 "+ provenance: Neuronpedia)",
    "jpp": "parameters.jacobians, source_layers, config (a J++ file)",
    "reference checkpoint": "jacobian_sum, n_done, next_idx, source_layers, target_layer, skip_first (continue it "
                            "with jlens fit --resume-from)",
}
CHECKPOINT_KEYS = ("jacobian_sum", "n_done", "next_idx")
EXPORT_FORMAT = "jlens-export"  # jlens_core.lenses.export's records
JPP_MISSING = ("the J++ file holds each layer's combined map only (no expert matrices, clustering or weights): it "
               "reads as a J++ lens but cannot be re-weighted (jlens weigh) or merged")


def load_torch_file(path: str | os.PathLike) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)``.

    Raises:
        LensFileError: a pickle that needs code to load (refused: one sentence naming what it asked for), or a file
            that is not a readable torch file.
    """
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        wanted = str(exc).split("\n\n")[-1].strip().splitlines()[0] if str(exc) else "code"
        raise LensFileError(f"{str(path)!r} is a pickle that needs code to load ({wanted[:160]}): jlens loads .pt "
                            "files with weights_only=True only, so it does not run it; ask its author for a file of "
                            "tensors and plain values (a reference, J++ or jlens export).") from None
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a damaged or foreign file
        raise LensFileError(f"{str(path)!r} is not a readable lens file: {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else 'unreadable'}.") from None


def layout_of(data: Any) -> str | None:
    """The :data:`LAYOUTS` key ``data`` (a loaded ``.pt`` file) is in, or ``None``."""
    if not isinstance(data, dict):
        return None
    if "J" in data and "d_model" in data:
        return "reference"
    parameters = data.get("parameters")
    if isinstance(parameters, dict) and "jacobians" in parameters and isinstance(data.get("config"), dict):
        return "jpp"
    if all(key in data for key in CHECKPOINT_KEYS):
        return "reference checkpoint"
    return None


def _unknown(path: Path, data: Any) -> LensFileError:
    found = ", ".join(sorted(map(str, data))) if isinstance(data, dict) else f"a {type(data).__name__}, not a dict"
    known = "; ".join(f"{name}: {keys}" for name, keys in LAYOUTS.items())
    return LensFileError(f"{str(path)!r} is in no lens layout jlens knows (keys found: {found or 'none'}); the "
                         f"layouts known are {known}.")


def load_foreign_lens(path: str | os.PathLike, cls: type[JacobianLens]) -> JacobianLens:
    """The lens in a ``.pt`` file of another library (module docstring), as a ``cls`` (:class:`JacobianLens`, passed
    by it: this module does not import it).

    Raises:
        LensFileError: a pickle needing code, an unknown layout (naming the keys found and the layouts known), a
            reference checkpoint (not a lens: how to continue it), or matrices of the wrong shape.
    """
    path = Path(path)
    data = load_torch_file(path)
    layout = layout_of(data)
    if layout is None:
        raise _unknown(path, data)
    if layout == "reference checkpoint":
        raise LensFileError(f"{str(path)!r} is a reference fit checkpoint, not a lens: continue it with `jlens fit "
                            f"--resume-from {path} ...` (docs/sharing.md), which writes the lens.")
    try:
        lens = _from_jpp(data, cls) if layout == "jpp" else _from_reference(data, cls)
    except (ValueError, TypeError, KeyError) as exc:
        raise LensFileError(f"{str(path)!r} is a {layout} file but not a consistent lens: {exc}") from None
    if layout == "jpp":
        log.info("%s: %s.", path, JPP_MISSING)
    return lens


def _matrices(raw: Any, layers: list[int]) -> dict[int, torch.Tensor]:
    if isinstance(raw, torch.Tensor):  # stacked [n_layers, d, d] in source_layers order
        layers = layers or list(range(raw.shape[0]))
        return {int(layer): raw[i] for i, layer in enumerate(layers)}
    return {int(k): v for k, v in raw.items()}


def _ours(record: Any) -> dict[str, Any]:
    """A jlens export's identity record (``metadata`` / ``provenance.jlens`` / ``config.jlens``), or ``{}``."""
    if isinstance(record, dict) and record.get("format") == EXPORT_FORMAT:
        return record
    if isinstance(record, dict) and isinstance(record.get("jlens"), dict):
        return _ours(record["jlens"])
    return {}


def _lens(cls: type[JacobianLens], matrices: dict[int, torch.Tensor], n_prompts: int, d_model: int,
          ours: dict[str, Any], settings: dict[str, Any], rules: str = "jacobian") -> JacobianLens:
    if ours:
        kind = ours.get("kind")
        settings.update({k: ours[k] for k in ("skip_first", "max_seq_len", "corpus") if ours.get(k) is not None})
        if ours.get("provenance"):
            settings["provenance"] = ours["provenance"]
        if kind and kind not in PLAIN_FITTED:
            settings["expert_kind"] = kind
        rules = str(ours.get("rules") or rules)
    return cls(matrices, n_prompts, d_model, target_layer=ours.get("target_layer"),
                        n_layers=ours.get("n_layers"), settings=settings, model_name=ours.get("model_name"),
                        model_fingerprint=ours.get("model_fingerprint"), rules=rules)


def _from_reference(data: dict[str, Any], cls: type[JacobianLens]) -> JacobianLens:
    layers = [int(layer) for layer in data.get("source_layers") or []]
    ours = _ours(data.get("metadata")) or _ours(data.get("provenance"))
    source = ("jlens export" if ours else "Neuronpedia file" if "provenance" in data else "reference jlens file")
    settings: dict[str, Any] = {"source": source}
    provenance = data.get("provenance")
    if isinstance(provenance, dict) and not ours:  # Neuronpedia's own record: kept as read
        settings["provenance"] = {k: v for k, v in provenance.items() if isinstance(v, (str, int, float, bool))
                                  or v is None}
    return _lens(cls, _matrices(data["J"], layers), int(data.get("n_prompts", 0)), int(data["d_model"]), ours,
                 settings)


def _from_jpp(data: dict[str, Any], cls: type[JacobianLens]) -> JacobianLens:
    config = data["config"]
    ours = _ours(config)
    layers = [int(layer) for layer in data.get("source_layers") or []]
    lrp_mode = config.get("lrp_mode")
    rules = "relevance" if lrp_mode not in (None, False, "", "none") else "jacobian"
    plain = {k: v for k, v in config.items() if isinstance(v, (str, int, float, bool)) or v is None}
    settings: dict[str, Any] = {"source": "J++ file", "expert_kind": expert_kind(rules, weighted=True),
                                "jpp_config": plain, "import_note": JPP_MISSING}
    if config.get("skip_first_n_positions") is not None:
        settings["skip_first"] = int(config["skip_first_n_positions"])
    if config.get("max_seq_len") is not None:
        settings["max_seq_len"] = int(config["max_seq_len"])
    matrices = _matrices(data["parameters"]["jacobians"], layers)
    if not ours and int(config.get("relative_end_transport_layer", -1)) != -1:
        raise ValueError(f"its maps carry residuals to block {config['relative_end_transport_layer']} (relative), "
                         "and the file does not say how many layers the model has")
    return _lens(cls, matrices, int(config.get("num_prompts_trained_on", 0)), int(config["d_model"]), ours,
                 settings, rules)


def read_reference_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A reference fit checkpoint (:data:`LAYOUTS`): ``{"jacobian_sum": {layer: fp64 [d, d]}, "n_done", "next_idx",
    "source_layers", "target_layer", "skip_first", ...}`` as stored (other keys kept), sums as float64.

    Raises:
        LensFileError: not a reference checkpoint (naming the keys found and the layouts known), or a pickle that
            needs code.
    """
    path = Path(path)
    data = load_torch_file(path)
    if layout_of(data) != "reference checkpoint":
        raise _unknown(path, data) if layout_of(data) is None else LensFileError(
            f"{str(path)!r} is a {layout_of(data)} file, not a reference fit checkpoint: load it as a lens instead.")
    out = dict(data)
    out["jacobian_sum"] = {int(k): torch.as_tensor(v).double() for k, v in data["jacobian_sum"].items()}
    return out


__all__ = ["LAYOUTS", "layout_of", "load_foreign_lens", "load_torch_file", "read_reference_checkpoint"]
