"""The files a fit writes next to its lens (``docs/method.md §3``): the run-file format, in one place.

``jlens fit --out runs/lens.safetensors`` writes, beside the lens::

    runs/lens.status.json          the fit's state (rewritten as it goes: state, pid, n_done, next_idx, eta, ...)
    runs/lens.diagnostics.jsonl    one record per prompt x layer, streamed
    runs/lens.ckpt                 the checkpoint (a resumed fit continues from it)

The CLI writes them and the app reads them; both name them through this module.
"""

from __future__ import annotations

import os
from pathlib import Path

STATUS = "status.json"
DIAGNOSTICS = "diagnostics.jsonl"
CHECKPOINT = "ckpt"


def sidecar(out: str | os.PathLike, kind: str) -> Path:
    """``lens.safetensors`` -> ``lens.<kind>`` (``diagnostics.jsonl``, ``status.json``, ``ckpt``)."""
    out = Path(out)
    stem = out.name[: -len(out.suffix)] if out.suffix else out.name
    return out.with_name(f"{stem}.{kind}")


def status_path(out: str | os.PathLike) -> Path:
    """The status file of the fit whose lens is ``out``."""
    return sidecar(out, STATUS)


def diagnostics_path(out: str | os.PathLike) -> Path:
    """The streamed diagnostics of the fit whose lens is ``out``."""
    return sidecar(out, DIAGNOSTICS)


def checkpoint_path(out: str | os.PathLike) -> Path:
    """The default checkpoint of the fit whose lens is ``out``."""
    return sidecar(out, CHECKPOINT)


__all__ = ["CHECKPOINT", "DIAGNOSTICS", "STATUS", "checkpoint_path", "diagnostics_path", "sidecar",
           "status_path"]
