"""Where a lens's matrices come from: the software that ran the model, the model's revision, the activation read.

A lens is a property of one model's weights *and* of the code that ran them (docs/method.md §4.2): a transformers
release that changes a rope scaling changes the residuals a lens reads. Every lens file jlens writes records, in its
``settings`` (the existing metadata path, docs/method.md §4.1), a ``provenance`` record:

* ``transformers``, ``torch``, ``jlens``: the versions the fit ran under;
* ``model_name``, ``model_revision`` (the Hub commit the weights came from, when transformers knows it, else
  ``None``), ``model_source`` (the Hub id the weights were read from, or ``local:<folder name>``);
* ``capture_point``: ``"block_output"``, the output of decoder block ``l`` (the residual jlens reads at layer
  ``l``, before the final norm: the layer-``l`` entry of the reference's ``J``);
* ``stream_reduce`` / ``stream_index``: ``"none"`` / ``None`` for a single residual stream; a multi-stream model's
  residual is the model's own collapse of its streams (``"model"``, described in ``stream_reduce_detail``).

Exports (:mod:`jlens_core.lenses.export`) copy it into the formats that have room for it. A lens fitted before
provenance existed has none: :func:`lens_provenance` then takes what the file's canary recorded (its versions) and
marks the rest unknown (``None``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..models.model import LensModel

CAPTURE_POINT = "block_output"
PROVENANCE_KEY = "provenance"  # the key of the record in a lens's settings
FIELDS = ("transformers", "torch", "jlens", "model_name", "model_revision", "model_source", "capture_point",
          "stream_reduce", "stream_index")


def file_settings(lens: Any) -> dict[str, Any]:
    """The ``settings`` dict ``lens``'s file records (``settings_dict()``, docs/method.md §4.1); ``{}`` for a lens
    without one (the logit lens)."""
    made = getattr(lens, "settings_dict", None)
    return dict(made()) if callable(made) else {}


def _source(name_or_path: str | None) -> str | None:
    """A Hub id as given; a local folder as ``local:<its name>`` (its full path is nobody else's business)."""
    if not name_or_path:
        return None
    path = Path(str(name_or_path)).expanduser()
    return f"local:{path.name}" if path.is_absolute() or path.exists() else str(name_or_path)


def model_provenance(model: LensModel) -> dict[str, Any]:
    """The provenance record of a lens fitted now on ``model`` (the fields of :data:`FIELDS`)."""
    from .canary import versions  # the versions running now, as the canary records them

    hf_config = getattr(getattr(model, "hf_model", None), "config", None) or model.config
    readout = getattr(model, "stream_readout", None)
    record: dict[str, Any] = {**versions(), "model_name": model.name,
                              "model_revision": getattr(hf_config, "_commit_hash", None),
                              "model_source": _source(getattr(hf_config, "_name_or_path", None)),
                              "capture_point": CAPTURE_POINT, "stream_reduce": "none", "stream_index": None}
    if readout is not None:  # several streams: the residual is the model's own collapse of them
        record.update(stream_reduce="model", stream_reduce_detail=str(readout.description))
    return record


def lens_provenance(lens: Any, model: LensModel | None = None) -> dict[str, Any]:
    """The provenance of ``lens``: the record its settings hold; else, for a lens fitted before records existed,
    ``model``'s (when given: the caller vouches that the lens belongs to it) with the versions of the lens's
    canary (when it has one), else the canary's versions and ``None`` for the rest. Every key of :data:`FIELDS`
    is present."""
    recorded = file_settings(lens).get(PROVENANCE_KEY)
    if isinstance(recorded, dict):
        return {**dict.fromkeys(FIELDS), **recorded}
    record: dict[str, Any] = dict.fromkeys(FIELDS)
    record.update(model_name=getattr(lens, "model_name", None), capture_point=CAPTURE_POINT)
    if model is not None:
        record.update(model_provenance(model))
        record.update(dict.fromkeys(("transformers", "torch", "jlens")))  # the fit's versions are not today's
    canary = getattr(lens, "canary", None)
    then = getattr(canary, "versions", None)
    if isinstance(then, dict):
        record.update({k: then.get(k) for k in ("transformers", "torch", "jlens")})
    record["recorded"] = False  # reconstructed, not written by the fit
    return record


__all__ = ["CAPTURE_POINT", "FIELDS", "PROVENANCE_KEY", "file_settings", "lens_provenance", "model_provenance"]
