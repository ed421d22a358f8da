"""Studying the fitted Jacobians: norms, spectra, singular directions, and the fit's diagnostics.

Per source layer ``l`` of a :class:`~jlens_core.JacobianLens` (``d = d_model``, shrinkage applied,
i.e. the matrix :meth:`~jlens_core.JacobianLens.matrix` returns):

* ``fro_norm``: ``||J_l||_F / sqrt(d)`` (the identity scores 1; the RMS gain over directions);
* ``spectral_norm``: the largest singular value ``s_1``;
* ``dist_identity``: ``||J_l - I||_F / sqrt(d)`` (0 for the logit lens; on the scale of ``fro_norm``);
* ``effective_rank``: ``exp(H(p))`` with ``p_i = s_i / sum_j s_j`` (Roy & Vetterli, 2007): ``d`` for
  a multiple of the identity, 1 for a rank-one matrix;
* ``stable_rank``: ``||J_l||_F^2 / s_1^2`` (at most the rank; robust to tiny singular values).

:func:`top_directions` decodes the top singular directions ``J_l = U S V^T`` into tokens through
the model's unembedding: the *output* direction ``u_i`` lives in the target layer's residual
space, the *input* direction ``v_i`` in layer ``l``'s (read as the logit lens would). A singular
vector's sign is arbitrary, so both signs are decoded: the score of a direction ``x`` is
``unembed(c x) - unembed(-c x)`` with ``c = sqrt(d)`` (a residual of unit RMS). The difference
cancels the final norm's and head's biases; for an RMS norm it is exactly twice the head's
reading of ``x``. ``"+"`` lists the tokens with the highest score, ``"-"`` those with the lowest.

The diagnostics helpers turn the per prompt x layer records of a fit (``lens.diagnostics`` or the
``<lens>.diagnostics.jsonl`` that ``jlens fit`` streams) into tables for plots: the convergence of
the running mean (relative change vs prompts averaged, which falls about as ``1/n`` once settled)
and the per-prompt Jacobian norms (heavy-tailed outliers stand out).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

log = logging.getLogger(__name__)

LAYER_STATS_COLUMNS = ("layer", "fro_norm", "spectral_norm", "dist_identity", "effective_rank", "stable_rank")
DIRECTION_COLUMNS = ("direction", "singular_value", "side", "sign", "tokens", "scores")
DIAGNOSTIC_COLUMNS = ("prompt_index", "layer", "seq_len", "n_valid", "seconds", "jacobian_norm", "rel_change",
                      "n_prompts")


# -- matrices ------------------------------------------------------------------------------------
def _jacobian_layers(lens: Any) -> list[int]:
    jacobians = getattr(lens, "jacobians", None)
    if not jacobians:
        raise ValueError("This is not a fitted Jacobian lens (the logit lens has J = I at every layer): load or "
                         "fit a Jacobian lens to study its matrices.")
    return sorted(jacobians)


def _matrix(lens: Any, layer: int) -> torch.Tensor:
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


def matrix_stats(matrix: torch.Tensor | np.ndarray) -> dict[str, float]:
    """The per-layer statistics of the module docstring for one ``[d, d]`` matrix.

    Returns:
        ``{"fro_norm", "spectral_norm", "dist_identity", "effective_rank", "stable_rank"}``.
    """
    mat = torch.as_tensor(np.asarray(matrix) if not isinstance(matrix, torch.Tensor) else matrix).double()
    if mat.dim() != 2 or mat.shape[0] != mat.shape[1]:
        raise ValueError(f"Expected a square matrix, got shape {tuple(mat.shape)}.")
    d = mat.shape[0]
    s = singular_values(mat)
    fro = float(mat.norm())
    top = float(s[0]) if len(s) else 0.0
    return {"fro_norm": fro / math.sqrt(d), "spectral_norm": top,
            "dist_identity": float((mat - torch.eye(d, dtype=mat.dtype)).norm()) / math.sqrt(d),
            "effective_rank": effective_rank(s), "stable_rank": fro * fro / (top * top) if top > 0 else 0.0}


def layer_stats(lens: Any, layers: Iterable[int] | None = None) -> pd.DataFrame:
    """:func:`matrix_stats` of every fitted layer of ``lens`` (or of ``layers``), one row each.

    Returns:
        DataFrame with columns :data:`LAYER_STATS_COLUMNS`, layers ascending.

    Raises:
        ValueError: a logit lens (no matrices), or a layer the lens was not fitted at.
    """
    chosen = _jacobian_layers(lens) if layers is None else sorted({int(x) for x in layers})
    rows = [{"layer": layer, **matrix_stats(_matrix(lens, layer))} for layer in chosen]
    return pd.DataFrame(rows, columns=list(LAYER_STATS_COLUMNS))


def layer_spectrum(lens: Any, layer: int) -> np.ndarray:
    """Singular values of ``J_layer`` (shrinkage applied), descending, ``float64[d_model]``.

    Raises:
        ValueError: a logit lens, or a layer the lens was not fitted at.
    """
    return singular_values(_matrix(lens, layer))


def _direction_scores(model: Any, directions: torch.Tensor) -> torch.Tensor:
    """``unembed(c x) - unembed(-c x)`` for each row ``x`` of ``directions [n, d]``: ``[n, vocab]`` fp32."""
    c = math.sqrt(directions.shape[-1])
    dtype = getattr(model, "dtype", torch.float32)
    device = getattr(model, "device", "cpu")
    x = (c * directions).to(device=device, dtype=dtype)
    with torch.no_grad():
        return (model.unembed(x).float() - model.unembed(-x).float()).cpu()


def top_directions(model: Any, lens: Any, layer: int, *, n_directions: int = 5, top_k: int = 8,
                   show_whitespace: bool = False, sides: Sequence[str] = ("output", "input")) -> pd.DataFrame:
    """The top singular directions of ``J_layer``, decoded into tokens through the unembedding.

    Args:
        model: the lens's model (an :class:`~jlens_core.HFLensModel`: ``unembed``, ``tokenizer``).
        lens: a fitted :class:`~jlens_core.JacobianLens`.
        layer: a fitted source layer.
        n_directions: how many singular directions (largest singular values first).
        top_k: tokens listed per direction and sign.
        show_whitespace: whitespace as glyphs in token strings.
        sides: ``"output"`` (``u_i``, target-layer space) and/or ``"input"`` (``v_i``, layer space).

    Returns:
        DataFrame, one row per direction x side x sign, columns :data:`DIRECTION_COLUMNS`:
        ``direction`` (0-based, by singular value), ``singular_value``, ``side``, ``sign`` (``"+"``
        or ``"-"``), ``tokens`` (display strings, best first) and ``scores`` (their scores, see the
        module docstring).

    Raises:
        ValueError: a logit lens, a layer the lens was not fitted at, a bad count, an unknown side,
            or a lens of another width.
    """
    from .tokens import TokenDisplay

    if int(n_directions) < 1 or int(top_k) < 1:
        raise ValueError(f"n_directions={n_directions} and top_k={top_k} must be at least 1.")
    bad = [s for s in sides if s not in ("output", "input")]
    if bad or not sides:
        raise ValueError(f"sides must be among 'output' and 'input', got {list(sides)}.")
    if getattr(model, "d_model", lens.d_model) != lens.d_model:
        raise ValueError(f"The lens is for d_model={lens.d_model}; the model has d_model={model.d_model}.")
    mat = _matrix(lens, layer)
    u, s, vh = torch.linalg.svd(mat)
    n = min(int(n_directions), len(s))
    display = TokenDisplay.for_model(model)
    strings = display.strings(show_whitespace)
    vocab = len(strings)
    rows = []
    for side in sides:
        dirs = (u[:, :n].T if side == "output" else vh[:n]).float()  # [n, d]
        scores = _direction_scores(model, dirs)  # [n, vocab]
        k = min(int(top_k), scores.shape[-1])
        for i in range(n):
            for sign, row in (("+", scores[i]), ("-", -scores[i])):
                values, ids = row.topk(k)
                rows.append({"direction": i, "singular_value": float(s[i]), "side": side, "sign": sign,
                             "tokens": [strings[j] if j < vocab else f"<id:{j}>" for j in ids.tolist()],
                             "scores": [round(float(v), 4) for v in values]})
    return pd.DataFrame(rows, columns=list(DIRECTION_COLUMNS))


# -- fit diagnostics -------------------------------------------------------------------------------
def read_diagnostics(path: str | os.PathLike) -> list[dict]:
    """Records of a ``<lens>.diagnostics.jsonl`` file, skipping a partly written last line.

    A fit appends one JSON record per prompt x layer and flushes once per prompt, so a reader may
    see half a line at the end; it is left out. A missing file reads as no records.
    """
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                log.debug("%s:%d: not (yet) a complete JSON record; skipped", path, lineno)
                continue
            if isinstance(rec, dict):
                records.append(rec)
    return records


def diagnostics_frame(records: Iterable[dict]) -> pd.DataFrame:
    """The fit's per prompt x layer records as a table, with ``n_prompts`` added.

    ``n_prompts`` is the number of prompts in the running mean after this one (1 for the first
    prompt that counted; skipped prompts have no records and do not count). ``rel_change`` is NaN
    where undefined (the first prompt).

    Returns:
        DataFrame with columns :data:`DIAGNOSTIC_COLUMNS`, sorted by prompt then layer.
    """
    frame = pd.DataFrame(list(records))
    if frame.empty:
        return pd.DataFrame({c: pd.Series(dtype="float64") for c in DIAGNOSTIC_COLUMNS})
    for col in DIAGNOSTIC_COLUMNS[:-1]:
        if col not in frame:
            frame[col] = np.nan
    frame = frame[list(DIAGNOSTIC_COLUMNS[:-1])].copy()
    frame["rel_change"] = pd.to_numeric(frame["rel_change"], errors="coerce").astype("float64")
    frame["jacobian_norm"] = pd.to_numeric(frame["jacobian_norm"], errors="coerce").astype("float64")
    frame = frame.drop_duplicates(["prompt_index", "layer"], keep="last")
    order = {idx: i + 1 for i, idx in enumerate(sorted(frame["prompt_index"].unique()))}
    frame["n_prompts"] = frame["prompt_index"].map(order).astype("int64")
    return frame.sort_values(["prompt_index", "layer"]).reset_index(drop=True)


def convergence_frame(diagnostics: pd.DataFrame | Iterable[dict]) -> pd.DataFrame:
    """Relative change of the running mean per layer vs prompts averaged, for a log-log plot.

    Returns:
        DataFrame ``n_prompts, layer, rel_change`` of the records where it is defined and positive.
    """
    frame = diagnostics if isinstance(diagnostics, pd.DataFrame) else diagnostics_frame(diagnostics)
    if frame.empty:
        return pd.DataFrame({"n_prompts": pd.Series(dtype="int64"), "layer": pd.Series(dtype="int64"),
                             "rel_change": pd.Series(dtype="float64")})
    out = frame.loc[frame["rel_change"].notna() & (frame["rel_change"] > 0), ["n_prompts", "layer", "rel_change"]]
    return out.reset_index(drop=True)


def one_over_n_guide(convergence: pd.DataFrame) -> pd.DataFrame:
    """A ``c / n`` reference line for :func:`convergence_frame`, through the median of the last half.

    ``c`` is the median over the records of the later half of the prompts of ``rel_change * n``,
    so the guide sits on the curves where they have settled.

    Returns:
        DataFrame ``n_prompts, rel_change`` (two points, first and last prompt), empty when there
        is nothing to guide.
    """
    if convergence.empty:
        return pd.DataFrame({"n_prompts": pd.Series(dtype="float64"), "rel_change": pd.Series(dtype="float64")})
    n = convergence["n_prompts"].astype("float64")
    late = convergence[n >= n.max() / 2]
    c = float(np.median(late["rel_change"] * late["n_prompts"]))
    lo, hi = float(n.min()), float(n.max())
    return pd.DataFrame({"n_prompts": [lo, hi], "rel_change": [c / lo, c / hi]})


def norm_matrix(diagnostics: pd.DataFrame | Iterable[dict]) -> pd.DataFrame:
    """``||J_l^prompt||_F / sqrt(d)`` as a prompt x layer table (index ``prompt_index``, columns layers)."""
    frame = diagnostics if isinstance(diagnostics, pd.DataFrame) else diagnostics_frame(diagnostics)
    if frame.empty:
        return pd.DataFrame()
    return frame.pivot_table(index="prompt_index", columns="layer", values="jacobian_norm", aggfunc="last")


__all__ = ["DIAGNOSTIC_COLUMNS", "DIRECTION_COLUMNS", "LAYER_STATS_COLUMNS", "convergence_frame",
           "diagnostics_frame", "effective_rank", "layer_spectrum", "layer_stats", "matrix_stats", "norm_matrix",
           "one_over_n_guide", "read_diagnostics", "singular_values", "top_directions"]
