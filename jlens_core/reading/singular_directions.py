"""The top singular directions of a fitted ``J_l``, decoded into tokens through the unembedding.

``J_l = U S V^T``: the *output* direction ``u_i`` lives in the target layer's residual space, the
*input* direction ``v_i`` in layer ``l``'s (read as the logit lens would). A singular vector's sign
is arbitrary, so both signs are decoded: the score of a direction ``x`` is
``unembed(c x) - unembed(-c x)`` with ``c = sqrt(d)`` (a residual of unit RMS). The difference
cancels the final norm's and head's biases; for an RMS norm it is exactly twice the head's
reading of ``x``. ``"+"`` lists the tokens with the highest score, ``"-"`` those with the lowest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd
import torch

from ..lenses.protocol import Lens
from ..lenses.spectra import jacobian_matrix
from ..models.model import LensModel
from .tokens import TokenDisplay, display_ids

DIRECTION_COLUMNS = ("direction", "singular_value", "side", "sign", "tokens", "scores")


def _direction_scores(model: LensModel, directions: torch.Tensor) -> torch.Tensor:
    """``unembed(c x) - unembed(-c x)`` for each row ``x`` of ``directions [n, d]``: ``[n, vocab]`` fp32."""
    c = math.sqrt(directions.shape[-1])
    x = (c * directions).to(device=model.device, dtype=model.dtype)
    with torch.no_grad():
        return (model.unembed(x).float() - model.unembed(-x).float()).cpu()


def top_directions(model: LensModel, lens: Lens, layer: int, *, n_directions: int = 5, top_k: int = 8,
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
    if int(n_directions) < 1 or int(top_k) < 1:
        raise ValueError(f"n_directions={n_directions} and top_k={top_k} must be at least 1.")
    bad = [s for s in sides if s not in ("output", "input")]
    if bad or not sides:
        raise ValueError(f"sides must be among 'output' and 'input', got {list(sides)}.")
    if model.d_model != lens.d_model:
        raise ValueError(f"The lens is for d_model={lens.d_model}; the model has d_model={model.d_model}.")
    mat = jacobian_matrix(lens, layer)
    u, s, vh = torch.linalg.svd(mat)
    n = min(int(n_directions), len(s))
    display = TokenDisplay.for_model(model)
    strings = display.strings(show_whitespace)
    rows = []
    for side in sides:
        dirs = (u[:, :n].T if side == "output" else vh[:n]).float()  # [n, d]
        scores = _direction_scores(model, dirs)  # [n, vocab]
        k = min(int(top_k), scores.shape[-1])
        for i in range(n):
            for sign, row in (("+", scores[i]), ("-", -scores[i])):
                values, ids = row.topk(k)
                rows.append({"direction": i, "singular_value": float(s[i]), "side": side, "sign": sign,
                             "tokens": display_ids(strings, ids.tolist()),
                             "scores": [round(float(v), 4) for v in values]})
    return pd.DataFrame(rows, columns=list(DIRECTION_COLUMNS))


__all__ = ["DIRECTION_COLUMNS", "top_directions"]
