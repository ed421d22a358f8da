"""Lenses in other libraries' formats: ``lens.export(path, format=...)`` and ``jlens export`` (docs/sharing.md).

Four formats, each a ``torch.save`` dict of plain values and tensors (``torch.load(path, weights_only=True)`` reads
it, no code from us needed):

* ``reference``: the reference jlens library's file, ``{"J": {layer: fp16 [d_model, d_model]}, "n_prompts",
  "source_layers", "d_model"}`` (layer ``l`` is the output of block ``l``; the last layer is the target and has no
  matrix). Nothing else: its reader keeps nothing else.
* ``transformer-lens``: the same keys plus ``metadata`` (the kind, rules, target, fit settings, model identity and
  provenance), for TransformerLens's ``JacobianLens`` loader.
* ``neuronpedia``: Neuronpedia's Hub layout, ``<model_id>/jlens/<dataset>/<slug>_jacobian_lens.pt`` (``jpp/`` and
  ``<slug>_jpp_lens.pt`` for a J++ / R++ lens, as its J++ converter writes them), ``<slug>_convergence.csv`` (the
  fit's per prompt x layer diagnostics) and ``config.yaml``; the ``.pt`` holds the reference keys plus
  ``provenance``: ``capture_point``, ``stream_reduce``, ``stream_index`` (the names of Neuronpedia's converters),
  the versions and the model revision.
* ``jpp``: the J++ layout as published, ``{"parameters": {"jacobians": {layer: fp32}}, "source_layers",
  "config"}``, for J++ and R++ lenses only.

What a format cannot hold (the split halves, the canary, expert matrices and weights, the R-lens rules, the
diagnostics) is named in one sentence (:attr:`ExportResult.left_out`, also logged), never dropped silently; a
format that cannot hold the lens's kind at all refuses it in one sentence (``ValueError``).
"""

from __future__ import annotations

import csv
import io
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._atomic import atomic_write, atomic_write_text
from .._version import __version__
from .kinds import BY_KIND, PLAIN_RULES, is_baseline, is_trained, lens_kind, relevance_backward
from .provenance import file_settings, lens_provenance

if TYPE_CHECKING:
    import torch

    from ..models.model import LensModel

log = logging.getLogger(__name__)

FORMATS = ("reference", "transformer-lens", "neuronpedia", "jpp")
FORMAT_NAMES = {"reference": "reference jlens", "transformer-lens": "TransformerLens", "neuronpedia": "Neuronpedia",
                "jpp": "J++"}
REFERENCE_KEYS = ("J", "n_prompts", "source_layers", "d_model")
EXPORT_FORMAT = "jlens-export"  # names our metadata / provenance records, for a reader to tell them apart
EXPORT_VERSION = 1
JPP_KINDS = ("jacobian++", "relevance++")
CONVERGENCE_COLUMNS = ("prompt_index", "layer", "n_prompts", "rel_change", "half_rel_diff", "jacobian_norm",
                       "seq_len", "n_valid")
FP16_MAX = 65504.0


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote.

    Attributes:
        format: one of :data:`FORMATS`.
        files: the files written, the lens file first.
        left_out: one sentence naming what the format cannot hold of this lens (``None``: nothing).
    """

    format: str
    files: tuple[Path, ...]
    left_out: str | None = None

    @property
    def path(self) -> Path:
        """The lens file written."""
        return self.files[0]


def slug(name: str | None) -> str:
    """A file-name stem from a model name: its last path part, runs of other characters than ``[0-9A-Za-z._-]``
    as one ``-`` (the stem Neuronpedia's files use)."""
    base = (name or "model").rstrip("/").split("/")[-1]
    return re.sub(r"[^0-9A-Za-z._-]+", "-", base).strip("-") or "model"


def hub_name(source: str | None) -> str | None:
    """``source`` when it is a Hub id (``owner/name``), else ``None`` (a local folder is no name to share)."""
    if not source or source.startswith(("/", ".", "~", "local:")) or source.count("/") != 1:
        return None
    return source


def default_file_name(lens: Any, format: str) -> str:
    """The file an export to ``format`` writes in a folder: ``<slug>_jacobian_lens.pt`` (``reference``),
    ``<slug>_jacobian_lens.tl.pt`` (``transformer-lens``), ``<slug>_jpp_lens.pt`` (``jpp``)."""
    stem = slug(getattr(lens, "model_name", None))
    return {"reference": f"{stem}_jacobian_lens.pt", "transformer-lens": f"{stem}_jacobian_lens.tl.pt",
            "jpp": f"{stem}_jpp_lens.pt"}.get(format, f"{stem}_jacobian_lens.pt")


def _check_format(format: str) -> None:
    if format not in FORMATS:
        raise ValueError(f"Unknown export format {format!r}: use one of {', '.join(FORMATS)}.")


def _kind_name(kind: str) -> str:
    return BY_KIND[kind].name if kind in BY_KIND else f"{kind} lens"


def exportable_matrices(lens: Any, format: str) -> dict[int, torch.Tensor]:
    """``{layer: fp32 [d, d]}``: the matrices ``lens`` reads with (an expert lens's weighted sums, shrinkage
    applied), for ``format``.

    Raises:
        ValueError: the format cannot hold the lens's kind (one sentence: why, and which format can).
    """
    kind = lens_kind(lens)
    if not hasattr(lens, "matrix") or not getattr(lens, "source_layers", None) or is_trained(kind) or is_baseline(kind):
        raise ValueError(f"A {_kind_name(kind)} has no fitted matrices J_l, so no {FORMAT_NAMES[format]} file can "
                         "hold it: share a tuned lens as its own tuned-lens folder (docs/tuned-lens.md).")
    if format == "jpp" and kind not in JPP_KINDS:
        raise ValueError(f"The J++ layout holds J++ and R++ lenses (expert lenses with learned weights); this is a "
                         f"{_kind_name(kind)}: export it as reference, transformer-lens or neuronpedia.")
    last = int(getattr(lens, "n_layers", lens.target_layer + 1)) - 1
    if format in ("reference", "neuronpedia") and lens.target_layer != last:
        raise ValueError(f"The {FORMAT_NAMES[format]} format reads every lens as carried to the last layer ({last}); "
                         f"this lens targets layer {lens.target_layer}: export it as transformer-lens, which records "
                         "its target.")
    return {int(layer): lens.matrix(layer).float().cpu() for layer in lens.source_layers}


def _fp16(matrices: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    import torch

    worst = max(float(m.abs().max()) for m in matrices.values())
    if not worst < FP16_MAX or not math.isfinite(worst):
        raise ValueError(f"The lens has a value of magnitude {worst:.3g}, beyond float16's range ({FP16_MAX}), and "
                         "this format stores float16: export it as jpp (float32) or keep the jlens file.")
    return {layer: m.to(torch.float16).contiguous() for layer, m in matrices.items()}


def left_out(lens: Any, format: str) -> str | None:
    """One sentence naming what ``format`` cannot hold of ``lens`` (``None``: it holds everything that matters to
    a reading)."""
    kind = lens_kind(lens)
    parts: list[str] = []
    if getattr(lens, "n_experts", None) is not None:  # an ExpertLens (not imported: it imports this module's caller)
        parts.append("its expert matrices, clustering and weights (each layer's weighted sum is written)")
    if format == "reference":
        if relevance_backward(getattr(lens, "rules", PLAIN_RULES)):
            parts.append("its R-lens rules (a reader takes the matrices for a J lens's)")
        if kind in BY_KIND and BY_KIND[kind].experts:
            parts.append(f"that it is a {_kind_name(kind)}")
        parts.append("its fit settings, model identity and provenance")
    if getattr(lens, "raw_halves", None) is not None:
        parts.append("its split halves (so no stability marks, docs/method.md §3.3)")
    if getattr(lens, "canary", None) is not None:
        parts.append("its forward canary (use `jlens check --refit` on the export, docs/sharing.md)")
    if format != "neuronpedia" and getattr(lens, "diagnostics", None):
        parts.append("its per-prompt diagnostics")
    if not parts:
        return None
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"The {FORMAT_NAMES[format]} format cannot hold {listed}: they stay in the jlens file."


def _identity(lens: Any, provenance: dict[str, Any]) -> dict[str, Any]:
    """The model identity, fit settings and provenance an export records (plain values only)."""
    settings = file_settings(lens)
    return {"format": EXPORT_FORMAT, "format_version": EXPORT_VERSION, "jlens": __version__,
            "kind": lens_kind(lens), "rules": getattr(lens, "rules", "jacobian"),
            "model_name": lens.model_name, "model_fingerprint": lens.model_fingerprint,
            "n_layers": int(lens.n_layers), "target_layer": int(lens.target_layer),
            "skip_first": settings.get("skip_first"), "max_seq_len": settings.get("max_seq_len"),
            "corpus": settings.get("corpus"), "shrinkage": float(getattr(lens, "shrinkage", 0.0)),
            "provenance": provenance}


def _save(path: Path, payload: dict[str, Any]) -> Path:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, lambda tmp: torch.save(payload, tmp), shared=True)


def _lens_path(lens: Any, path: str | os.PathLike, format: str) -> Path:
    path = Path(path).expanduser()
    return path / default_file_name(lens, format) if path.is_dir() or path.suffix != ".pt" else path


def export_lens(lens: Any, path: str | os.PathLike, format: str = "reference", *, model: LensModel | None = None,
                model_id: str | None = None, dataset: str | None = None) -> ExportResult:
    """Write ``lens`` in another library's format (module docstring; docs/sharing.md).

    Args:
        lens: a :class:`~jlens_core.lenses.lens.JacobianLens` (J, R-lens, a combined J++ / R++ file) or an
            :class:`~jlens_core.lenses.experts.ExpertLens`.
        path: for ``reference``, ``transformer-lens`` and ``jpp``, the ``.pt`` file, or a folder to write
            :func:`default_file_name` in; for ``neuronpedia``, the root of the Hub layout.
        format: one of :data:`FORMATS`.
        model: the model the lens belongs to, for a lens fitted before provenance records existed (its revision
            and capture point are then taken from it); checked against the lens (``check_model``).
        model_id: Neuronpedia's model id (the layout's first folder); default: the slug of the model's name, lower
            case.
        dataset: the layout's corpus folder; default: the slug of the corpus the lens records.

    Returns:
        :class:`ExportResult`: the files written and what the format could not hold (also logged).

    Raises:
        ValueError: an unknown format, a kind the format cannot hold, values beyond float16 (formats storing it).
        LensFileError: ``model`` is another model's.
    """
    _check_format(format)
    matrices = exportable_matrices(lens, format)
    if model is not None:
        lens.check_model(model)
    provenance = lens_provenance(lens, model)
    note = left_out(lens, format)
    if format == "neuronpedia":
        files = _neuronpedia(lens, Path(path).expanduser(), matrices, provenance, model_id=model_id, dataset=dataset)
    else:
        target = _lens_path(lens, path, format)
        if format == "jpp":
            payload = _jpp_payload(lens, matrices, provenance)
        else:
            payload = _reference_payload(lens, _fp16(matrices))
            if format == "transformer-lens":
                payload["metadata"] = _identity(lens, provenance)
        files = (_save(target, payload),)
    if note:
        log.warning("%s", note)  # never silently: the result carries it too
    return ExportResult(format, files, note)


def _reference_payload(lens: Any, matrices: dict[int, torch.Tensor]) -> dict[str, Any]:
    return {"J": matrices, "n_prompts": int(lens.n_prompts), "source_layers": sorted(matrices),
            "d_model": int(lens.d_model)}


def _jpp_payload(lens: Any, matrices: dict[int, torch.Tensor], provenance: dict[str, Any]) -> dict[str, Any]:
    """The J++ layout as published (fp32 maps under ``parameters.jacobians``; its config's names: ``d_model``,
    ``num_prompts_trained_on``, ``hf_model_name``, ``max_seq_len``, ``skip_first_n_positions``, ``lrp_mode``,
    ``relative_end_transport_layer``), with our identity under ``jlens``."""
    settings = file_settings(lens)
    config = {"d_model": int(lens.d_model), "num_prompts_trained_on": int(lens.n_prompts),
              "hf_model_name": hub_name(provenance.get("model_source")) or lens.model_name,
              "max_seq_len": settings.get("max_seq_len"), "skip_first_n_positions": settings.get("skip_first"),
              # the R++ lens's relevance rules; None for J++ (the J rules: plain gradients)
              "lrp_mode": "relevance" if relevance_backward(getattr(lens, "rules", PLAIN_RULES)) else None,
              "relative_end_transport_layer": int(lens.target_layer) - int(lens.n_layers),
              "jlens": _identity(lens, provenance)}
    return {"parameters": {"jacobians": {layer: m.contiguous() for layer, m in matrices.items()}},
            "source_layers": sorted(matrices), "config": config}


def convergence_csv(lens: Any) -> str:
    """The fit's diagnostics as CSV (:data:`CONVERGENCE_COLUMNS`): one row per counted prompt x source layer, in fit
    order; ``n_prompts`` is the prompts counted up to that row's. A header alone when the lens records none."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CONVERGENCE_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    seen: dict[int, int] = {}
    for record in getattr(lens, "diagnostics", None) or []:
        index = int(record.get("prompt_index", -1))
        seen.setdefault(index, len(seen) + 1)
        writer.writerow({**{key: record.get(key) for key in CONVERGENCE_COLUMNS}, "n_prompts": seen[index]})
    return out.getvalue()


def _neuronpedia(lens: Any, root: Path, matrices: dict[int, torch.Tensor], provenance: dict[str, Any], *,
                 model_id: str | None, dataset: str | None) -> tuple[Path, ...]:
    """Neuronpedia's Hub layout under ``root``: the lens ``.pt``, ``<slug>_convergence.csv``, ``config.yaml``."""
    import yaml  # a dependency of transformers

    kind = lens_kind(lens)
    method = "jpp" if kind in JPP_KINDS else "jlens"
    hf_name = hub_name(provenance.get("model_source")) or lens.model_name
    stem = slug(hf_name)
    model_id = model_id or slug(lens.model_name).lower()
    settings = file_settings(lens)
    dataset = dataset or slug(str(settings.get("corpus") or "unknown-corpus"))
    folder = root / model_id / method / dataset
    name = f"{stem}_{'jpp' if method == 'jpp' else 'jacobian'}_lens.pt"
    capture = {key: provenance.get(key) for key in ("capture_point", "stream_reduce", "stream_index")}
    if provenance.get("stream_reduce_detail"):
        capture["stream_reduce_detail"] = provenance["stream_reduce_detail"]
    record = {"source": f"jlens {__version__} export", "method": method, **capture,
              "lrp_mode": "relevance" if relevance_backward(getattr(lens, "rules", PLAIN_RULES)) else None,
              "jlens": _identity(lens, provenance)}
    payload = {**_reference_payload(lens, _fp16(matrices)), "provenance": record}
    lens_file = _save(folder / name, payload)
    csv_file = atomic_write_text(folder / f"{stem}_convergence.csv", convergence_csv(lens), shared=True)
    layers = sorted(matrices)
    body = {"np_model_id": model_id, "hf_model_name": hf_name,
            "dataset": {"name": settings.get("corpus"), "split": settings.get("split")},
            "fit": {"method": method, "kind": kind, "rules": getattr(lens, "rules", "jacobian"),
                    "n_prompts": int(lens.n_prompts), "max_seq_len": settings.get("max_seq_len"),
                    "target_layer": int(lens.target_layer), "skip_first": settings.get("skip_first")},
            "lens": {"file": name, "convergence": csv_file.name, "dtype": "float16", "d_model": int(lens.d_model),
                     "source_layers_first": layers[0], "source_layers_last": layers[-1],
                     "n_source_layers": len(layers), **capture},
            "provenance": {key: provenance.get(key) for key in ("transformers", "torch", "jlens", "model_name",
                                                                 "model_revision", "model_source")},
            "attribution": f"Exported by jlens {__version__} (`jlens export --format neuronpedia`); the .pt's own "
                           "provenance is authoritative."}
    text = "# A Jacobian lens exported by jlens; the .pt file's provenance is authoritative.\n" + \
        yaml.safe_dump(body, sort_keys=False)
    config_file = atomic_write_text(folder / "config.yaml", text, shared=True)
    return lens_file, csv_file, config_file


__all__ = ["CONVERGENCE_COLUMNS", "FORMATS", "REFERENCE_KEYS", "ExportResult", "convergence_csv", "default_file_name",
           "export_lens", "exportable_matrices", "left_out", "slug"]
