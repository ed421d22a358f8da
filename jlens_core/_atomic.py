"""Atomic file writes (a leaf module: imports nothing from jlens_core).

A file is written to a temporary file in the same folder, then renamed over the target, so a reader
never sees half a file and a crash leaves the previous version in place.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | os.PathLike, write: Callable[[str], None], *, shared: bool = False) -> Path:
    """Call ``write(temporary_path)``, then rename the temporary file to ``path``.

    Args:
        shared: make the file readable by everyone (``0o644``; ``mkstemp`` makes it private), for files
            meant to be passed around such as lenses.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        if shared:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def atomic_write_text(path: str | os.PathLike, text: str, *, encoding: str = "utf-8", shared: bool = False) -> Path:
    """Write ``text`` to ``path`` atomically (:func:`atomic_write`); returns ``path`` as a :class:`Path`."""
    def write(tmp: str) -> None:
        Path(tmp).write_text(text, encoding=encoding)

    return atomic_write(path, write, shared=shared)
