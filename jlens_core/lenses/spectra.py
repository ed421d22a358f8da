"""Studying the fitted Jacobians: norms and spectra of ``J_l``.

Per source layer ``l`` of a :class:`~jlens_core.JacobianLens` (``d = d_model``, shrinkage applied,
i.e. the matrix :meth:`~jlens_core.JacobianLens.matrix` returns):

* ``fro_norm``: ``||J_l||_F / sqrt(d)`` (the identity scores 1; the RMS gain over directions);
* ``spectral_norm``: the largest singular value ``s_1``;
* ``dist_identity``: ``||J_l - I||_F / sqrt(d)`` (0 for the logit lens; on the scale of ``fro_norm``);
* ``effective_rank``: ``exp(H(p))`` with ``p_i = s_i / sum_j s_j`` (Roy & Vetterli, 2007): ``d`` for
  a multiple of the identity, 1 for a rank-one matrix;
* ``stable_rank``: ``||J_l||_F^2 / s_1^2`` (at most the rank; robust to tiny singular values).

Decoding the singular directions into tokens needs the token display, so it lives with the readings
(:mod:`jlens_core.reading.singular_directions`); the fit's per-prompt diagnostics live with the fit
(:mod:`jlens_core.fitting.diagnostics`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from .lens import JacobianLens
from .protocol import Lens

log = logging.getLogger(__name__)

LAYER_STATS_COLUMNS = ("layer", "fro_norm", "spectral_norm", "dist_identity", "effective_rank", "stable_rank")


# -- matrices ------------------------------------------------------------------------------------
def _jacobian_layers(lens: Lens) -> list[int]:
    jacobians = lens.jacobians if isinstance(lens, JacobianLens) else None  # matrices are the Jacobian lens's
    if not jacobians:
        raise ValueError("This is not a fitted Jacobian lens (the logit lens has J = I at every layer): load or "
                         "fit a Jacobian lens to study its matrices.")
    return sorted(jacobians)


def jacobian_matrix(lens: Lens, layer: int) -> torch.Tensor:
    """``J_layer`` of a fitted lens (shrinkage applied) in fp64, ``[d, d]``; a clear error for a logit lens
    or a layer the lens was not fitted at."""
    layers = _jacobian_layers(lens)
    if int(layer) not in layers:
        raise ValueError(f"The lens has no matrix at layer {layer}: it was fitted at layers {layers}.")
    return lens.matrix(int(layer)).double()


def singular_values(matrix: torch.Tensor | np.ndarray) -> np.ndarray:
    """Singular values of a square matrix, descending, as ``float64[d]`` (computed in fp64)."""
    mat = torch.as_tensor(np.asarray(matrix) if not isinstance(matrix, torch.Tensor) else matrix).double()
    if mat.dim() != 2:
        raise ValueError(f"Expected a matrix, got shape {tuple(mat.shape)}.")
    return torch.linalg.svdvals(mat).numpy()


def effective_rank(s: Sequence[float] | np.ndarray) -> float:
    """``exp`` of the entropy of the normalised singular values ``p = s / sum(s)`` (Roy & Vetterli).

    Returns 0 for an all-zero spectrum.
    """
    s = np.asarray(s, dtype=np.float64)
    total = float(s.sum())
    if total <= 0:
        return 0.0
    p = s[s > 0] / total
    return float(math.exp(-(p * np.log(p)).sum()))


def matrix_stats(matrix: torch.Tensor | np.ndarray, s: np.ndarray | None = None) -> dict[str, float]:
    """The per-layer statistics of the module docstring for one ``[d, d]`` matrix (``s``: its singular
    values when already computed).

    Returns:
        ``{"fro_norm", "spectral_norm", "dist_identity", "effective_rank", "stable_rank"}``.
    """
    mat = torch.as_tensor(np.asarray(matrix) if not isinstance(matrix, torch.Tensor) else matrix).double()
    if mat.dim() != 2 or mat.shape[0] != mat.shape[1]:
        raise ValueError(f"Expected a square matrix, got shape {tuple(mat.shape)}.")
    d = mat.shape[0]
    s = singular_values(mat) if s is None else np.asarray(s, dtype=np.float64)
    fro = float(mat.norm())
    top = float(s[0]) if len(s) else 0.0
    return {"fro_norm": fro / math.sqrt(d), "spectral_norm": top,
            "dist_identity": float((mat - torch.eye(d, dtype=mat.dtype)).norm()) / math.sqrt(d),
            "effective_rank": effective_rank(s), "stable_rank": fro * fro / (top * top) if top > 0 else 0.0}


def layer_stats(lens: Lens, layers: Iterable[int] | None = None) -> pd.DataFrame:
    """:func:`matrix_stats` of every fitted layer of ``lens`` (or of ``layers``), one row each.

    Returns:
        DataFrame with columns :data:`LAYER_STATS_COLUMNS`, layers ascending.

    Raises:
        ValueError: a logit lens (no matrices), or a layer the lens was not fitted at.
    """
    chosen = _jacobian_layers(lens) if layers is None else sorted({int(x) for x in layers})
    rows = [{"layer": layer, **matrix_stats(jacobian_matrix(lens, layer))} for layer in chosen]
    return pd.DataFrame(rows, columns=list(LAYER_STATS_COLUMNS))


def layer_stats_and_spectra(lens: Lens) -> tuple[pd.DataFrame, dict[int, np.ndarray]]:
    """:func:`layer_stats` of every fitted layer and its singular values, one SVD per layer.

    Returns:
        ``(stats, {layer: float64[d] singular values, descending})``.
    """
    rows, spectra = [], {}
    for layer in _jacobian_layers(lens):
        mat = jacobian_matrix(lens, layer)
        s = singular_values(mat)
        spectra[layer] = s
        rows.append({"layer": layer, **matrix_stats(mat, s)})
    return pd.DataFrame(rows, columns=list(LAYER_STATS_COLUMNS)), spectra


def stored_stats_and_spectra(lens: Lens, key: str, folder: str | os.PathLike | None = None,
                             ) -> tuple[pd.DataFrame, dict[int, np.ndarray]]:
    """:func:`layer_stats_and_spectra`, computed once per lens and kept on disk: ``<folder>/<sha256(key)>.npz``
    (default folder ``<jlens cache>/jacobian-stats``), so later calls and processes read it.

    Args:
        key: what names the lens (its file and version); ``""``: computed, not stored.
        folder: where the files go.

    A file that cannot be read is rebuilt; it is written atomically (two writers never share a temporary name).
    """
    from .._atomic import atomic_write
    from ..models.loading import cache_dir

    where = Path(folder) if folder is not None else cache_dir() / "jacobian-stats"
    path = where / (hashlib.sha256(key.encode()).hexdigest()[:20] + ".npz")
    if key and path.is_file():
        try:
            data = np.load(path, allow_pickle=False)
            stats = pd.DataFrame({c: data[f"stat_{c}"] for c in LAYER_STATS_COLUMNS})
            return stats, {int(k[2:]): data[k] for k in data.files if k.startswith("s_")}
        except (OSError, ValueError, KeyError):
            log.info("rebuilding the unreadable stored spectra %s", path)
    stats, singular = layer_stats_and_spectra(lens)
    if key:
        arrays = {**{f"stat_{c}": stats[c].to_numpy() for c in LAYER_STATS_COLUMNS},
                  **{f"s_{layer}": s for layer, s in singular.items()}}

        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:  # a file object: np.savez would add ".npz" to a temporary name
                np.savez(f, **arrays)

        atomic_write(path, write)
    return stats, singular


__all__ = ["LAYER_STATS_COLUMNS", "effective_rank", "jacobian_matrix", "layer_stats", "layer_stats_and_spectra", "matrix_stats",
           "singular_values", "stored_stats_and_spectra"]
