"""Compare two hidden-state dumps and find the first (step, layer, op) where they part ways.

``B`` is the reference: an element is within tolerance when ``|a - b| <= atol + rtol * |b|`` (the
``numpy.allclose`` rule; two NaNs, or two equal infinities, at the same place count as equal).

Per ``(layer, op)`` the table holds:

* ``max_abs_err = max |a - b|``;
* ``max_rel_err = max |a - b| / (max |b| + eps)`` with ``eps = 1e-12``: the worst error relative to
  the scale of the reference tensor (not element-wise, so small entries do not blow it up);
* ``mean_abs_err = mean |a - b|``;
* ``first_bad_position``: the first position (axis 0, the token index) where any element is beyond
  tolerance, or ``None``; ``n_bad_positions``: how many positions are;
* ``within_tolerance``: no element beyond tolerance.

A NaN or infinity in one dump but not the other counts as an infinite error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .dump import Dump, load_dump

log = logging.getLogger(__name__)

EPS = 1e-12
COLUMNS = ("step", "layer", "op", "shape", "max_abs_err", "max_rel_err", "mean_abs_err",
           "first_bad_position", "n_bad_positions", "within_tolerance")
# run.json fields shown side by side when they differ
_SETTING_KEYS = (("model", "name"), ("model", "layout"), ("dtype",), ("device",), ("versions", "torch"),
                 ("versions", "transformers"), ("versions", "jlens"), ("versions", "numpy"),
                 ("platform", "machine"))


@dataclass(frozen=True)
class Divergence:
    """The first tensor (in step order) beyond tolerance."""

    step: int
    layer: int
    op: str
    position: int | None
    max_abs_err: float
    max_rel_err: float

    def describe(self) -> str:
        where = "embedding" if self.op == "embed" else ("final norm" if self.op == "final_norm"
                                                         else f"layer {self.layer} {self.op}")
        pos = f", first at position {self.position}" if self.position is not None else ""
        return (f"first divergence: step {self.step}, {where}{pos} "
                f"(max abs err {self.max_abs_err:.3g}, max rel err {self.max_rel_err:.3g})")


@dataclass
class DumpDiff:
    """The result of :func:`diff_dumps`.

    Attributes:
        table: one row per ``(layer, op)`` in both dumps, in A's step order; columns ``COLUMNS``.
        atol, rtol: the tolerance used.
        a, b: the two dump folders (``b`` is the reference).
        only_in_a, only_in_b: ``(layer, op)`` present in one dump only (not compared).
        settings: ``{setting: (value in A, value in B)}`` for run settings that differ
            (dtype, device, library versions, model name).
        n_tokens: prompt length.
    """

    table: pd.DataFrame
    atol: float
    rtol: float
    a: Path
    b: Path
    only_in_a: list[tuple[int, str]] = field(default_factory=list)
    only_in_b: list[tuple[int, str]] = field(default_factory=list)
    settings: dict[str, tuple] = field(default_factory=dict)
    n_tokens: int = 0

    @property
    def first_divergence(self) -> Divergence | None:
        """The first ``(step, layer, op)`` beyond tolerance, or ``None`` when all are within it."""
        bad = self.table[~self.table["within_tolerance"]]
        if bad.empty:
            return None
        row = bad.iloc[0]
        pos = row["first_bad_position"]
        return Divergence(step=int(row["step"]), layer=int(row["layer"]), op=str(row["op"]),
                          position=None if pos is None or pd.isna(pos) else int(pos),
                          max_abs_err=float(row["max_abs_err"]), max_rel_err=float(row["max_rel_err"]))

    @property
    def matches(self) -> bool:
        """Every compared tensor is within tolerance."""
        return bool(self.table["within_tolerance"].all())

    def to_text(self, *, max_rows: int | None = None) -> str:
        """A compact text report: settings that differ, the table, the first divergence."""
        lines = [f"A: {self.a}", f"B: {self.b} (reference)"]
        for key, (va, vb) in self.settings.items():
            lines.append(f"  {key}: A={va}  B={vb}")
        lines.append(f"{self.n_tokens} tokens, {len(self.table)} tensors compared, "
                     f"atol={self.atol:g} rtol={self.rtol:g}")
        shown = self.table if max_rows is None else self.table.head(max_rows)
        view = pd.DataFrame({
            "step": shown["step"], "layer": shown["layer"], "op": shown["op"],
            "max_abs": shown["max_abs_err"].map(lambda x: f"{x:.3g}"),
            "max_rel": shown["max_rel_err"].map(lambda x: f"{x:.3g}"),
            "mean_abs": shown["mean_abs_err"].map(lambda x: f"{x:.3g}"),
            "first_bad": shown["first_bad_position"].map(lambda x: "-" if x is None or pd.isna(x) else str(int(x))),
            "ok": shown["within_tolerance"].map(lambda x: "yes" if x else "NO"),
        })
        lines.append(view.to_string(index=False))
        if max_rows is not None and len(self.table) > max_rows:
            lines.append(f"... {len(self.table) - max_rows} more rows")
        for label, keys in (("only in A", self.only_in_a), ("only in B", self.only_in_b)):
            if keys:
                lines.append(f"{label} (not compared): " + ", ".join(f"L{la} {op}" for la, op in keys))
        div = self.first_divergence
        lines.append("match: every tensor is within tolerance" if div is None else div.describe())
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON-ready form: tolerance, paths, settings, rows, first divergence, match."""
        rows = []
        for rec in self.table.to_dict(orient="records"):
            pos = rec["first_bad_position"]
            rec["first_bad_position"] = None if pos is None or pd.isna(pos) else int(pos)
            rec["within_tolerance"] = bool(rec["within_tolerance"])
            for k in ("step", "layer", "n_bad_positions"):
                rec[k] = int(rec[k])
            for k in ("max_abs_err", "max_rel_err", "mean_abs_err"):
                v = float(rec[k])
                rec[k] = v if np.isfinite(v) else str(v)
            rows.append(rec)
        div = self.first_divergence
        return {"a": str(self.a), "b": str(self.b), "atol": self.atol, "rtol": self.rtol,
                "n_tokens": self.n_tokens, "matches": self.matches,
                "first_divergence": None if div is None else div.__dict__.copy(),
                "settings": {k: list(v) for k, v in self.settings.items()},
                "only_in_a": [list(k) for k in self.only_in_a], "only_in_b": [list(k) for k in self.only_in_b],
                "rows": rows}


def _get(run: dict, keys: tuple[str, ...]) -> Any:
    value: Any = run
    for k in keys:
        value = value.get(k) if isinstance(value, dict) else None
    return value


def _check_same_tokens(a: Dump, b: Dump) -> None:
    ta, tb = a.token_ids, b.token_ids
    if ta == tb:
        return
    n = min(len(ta), len(tb))
    first = next((i for i in range(n) if ta[i] != tb[i]), None)
    if first is None:
        detail = f"A has {len(ta)} tokens and B has {len(tb)} (one is a prefix of the other)"
    else:
        detail = (f"they first differ at position {first} (A token {ta[first]}, B token {tb[first]}); "
                  f"A has {len(ta)} tokens, B has {len(tb)}")
    raise ValueError(f"The dumps {str(a.path)!r} and {str(b.path)!r} are not of the same tokens: {detail}. "
                     "Dump both with the same prompt, tokenizer and --max-seq-len.")


def compare_arrays(a: np.ndarray, b: np.ndarray, *, atol: float, rtol: float) -> dict:
    """Error statistics of ``a`` against the reference ``b`` (same shape, position on axis 0).

    Returns:
        ``{max_abs_err, max_rel_err, mean_abs_err, first_bad_position, n_bad_positions, within_tolerance}``
        (definitions in the module docstring).
    """
    a64 = a.astype(np.float64, copy=False)
    b64 = b.astype(np.float64, copy=False)
    with np.errstate(invalid="ignore", over="ignore"):
        same = (a64 == b64) | (np.isnan(a64) & np.isnan(b64))
        err = np.where(same, 0.0, np.abs(a64 - b64))
    err = np.nan_to_num(err, nan=np.inf, posinf=np.inf)
    with np.errstate(invalid="ignore", over="ignore"):
        bad = ~same & ((err > atol + rtol * np.abs(b64)) | ~np.isfinite(err))
    per_pos = bad.reshape(bad.shape[0], -1).any(axis=1) if bad.ndim else np.atleast_1d(bad)
    bad_positions = np.flatnonzero(per_pos)
    finite_b = np.abs(b64[np.isfinite(b64)])
    scale = float(finite_b.max()) if finite_b.size else 0.0
    max_abs = float(err.max()) if err.size else 0.0
    return {"max_abs_err": max_abs, "max_rel_err": max_abs / (scale + EPS),
            "mean_abs_err": float(err.mean()) if err.size else 0.0,
            "first_bad_position": int(bad_positions[0]) if bad_positions.size else None,
            "n_bad_positions": int(bad_positions.size), "within_tolerance": not bad_positions.size}


def diff_dumps(a_dir: str | Path | Dump, b_dir: str | Path | Dump, *, atol: float = 1e-5,
               rtol: float = 1e-3) -> DumpDiff:
    """Compare dump ``A`` with the reference dump ``B``, tensor by tensor, in A's step order.

    Args:
        a_dir, b_dir: dump folders (or :class:`~jlens_core.debugging.dump.Dump` objects from ``load_dump``).
        atol, rtol: tolerance; an element is bad when ``|a - b| > atol + rtol * |b|``.

    Returns:
        A :class:`DumpDiff` (``.table``, ``.first_divergence``, ``.matches``, ``.to_text()``).

    Raises:
        FileNotFoundError: a dump folder does not exist.
        ValueError: a damaged dump (see ``load_dump``), dumps of different tokens, no ``(layer, op)``
            in common, a ``(layer, op)`` whose shapes differ, or a negative / non-finite tolerance.
    """
    for name, value in (("atol", atol), ("rtol", rtol)):
        if not np.isfinite(value) or value < 0:
            raise ValueError(f"{name}={value} must be a finite number >= 0.")
    a = a_dir if isinstance(a_dir, Dump) else load_dump(a_dir)
    b = b_dir if isinstance(b_dir, Dump) else load_dump(b_dir)
    _check_same_tokens(a, b)
    b_keys = {e.key: e for e in b.entries}
    a_keys = set(a.keys)
    common = [e for e in a.entries if e.key in b_keys]
    if not common:
        raise ValueError(f"The dumps {str(a.path)!r} and {str(b.path)!r} have no (layer, op) in common: "
                         f"A has {sorted(a_keys)}, B has {sorted(b_keys)}.")
    rows = []
    for ea in common:
        eb = b_keys[ea.key]
        if ea.shape != eb.shape:
            raise ValueError(f"Layer {ea.layer} op {ea.op!r} has shape {list(ea.shape)} in A but {list(eb.shape)} "
                             "in B: the dumps are not of the same model architecture.")
        stats = compare_arrays(a.array(*ea.key), b.array(*ea.key), atol=atol, rtol=rtol)
        rows.append({"step": ea.step, "layer": ea.layer, "op": ea.op, "shape": list(ea.shape), **stats})
    table = pd.DataFrame(rows, columns=list(COLUMNS))
    table["first_bad_position"] = table["first_bad_position"].astype(object)
    table["within_tolerance"] = table["within_tolerance"].astype(bool)
    settings = {}
    for keys in _SETTING_KEYS:
        va, vb = _get(a.run, keys), _get(b.run, keys)
        if va != vb:
            settings[".".join(keys)] = (va, vb)
    only_a = [k for k in a.keys if k not in b_keys]
    only_b = [k for k in b.keys if k not in a_keys]
    if only_a or only_b:
        log.info("Not compared: %d tensors only in A, %d only in B.", len(only_a), len(only_b))
    return DumpDiff(table=table, atol=float(atol), rtol=float(rtol), a=a.path, b=b.path, only_in_a=only_a,
                    only_in_b=only_b, settings=settings, n_tokens=len(a.token_ids))


def divergence_curve(diff: DumpDiff, op: str = "residual") -> pd.DataFrame:
    """Per-layer error of one op, for plotting (the app's "Compare runs" page).

    Args:
        diff: a :func:`diff_dumps` result.
        op: ``"residual"``, ``"attn"``, ``"mlp"``, ``"embed"`` or ``"final_norm"``.

    Returns:
        DataFrame with columns ``layer, max_abs_err, max_rel_err``, sorted by layer
        (``embed`` is layer -1, ``final_norm`` is layer ``n_layers``).

    Raises:
        ValueError: ``op`` is not in the diff (the message lists the ops it has).
    """
    rows = diff.table[diff.table["op"] == op]
    if rows.empty:
        have = sorted(set(diff.table["op"]))
        raise ValueError(f"The diff has no op {op!r}: it has {have}.")
    return rows[["layer", "max_abs_err", "max_rel_err"]].sort_values("layer").reset_index(drop=True)
