"""A lens file's header, read once: :func:`read_header` gives a :class:`LensHeader` (docs/method.md §3).

A jlens lens file is safetensors: 8 bytes (the header's length, little-endian), the header (JSON: each
tensor's dtype, shape and byte range, and ``__metadata__``, string to string), then the tensors. Its
``__metadata__`` holds ``format`` (``"jlens"`` for a Jacobian lens, ``"jlens-experts"`` for an expert lens;
none for a tuned lens) and ``jlens``, the lens's metadata as JSON (a tuned lens's says
``"format": "jlens-tuned"`` there). Everything that asks what a lens file holds (its kind, rules,
settings) reads the header through :func:`read_header`, which reads the header's bytes alone (no torch,
no tensor) and keeps it per file version (path, modification time, size, inode): asking again costs no
read until the file changes.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .kinds import expert_kind

FORMAT_NAME = "jlens"  # a Jacobian lens (J, R-lens, a combined J++ / R++ file)
EXPERTS_FORMAT_NAME = "jlens-experts"  # an expert lens
TUNED_FORMAT_NAME = "jlens-tuned"  # a tuned lens (in its jlens metadata: its header has no "format")
MAX_HEADER_BYTES = 1 << 26  # a longer header is not a lens file's (safetensors' own limit is 100 MB)


class LensFileError(ValueError):
    """A lens file that cannot be used: not a lens, truncated, a newer format, or for another model."""


class ForeignFileError(LensFileError):
    """A readable safetensors file that is not a jlens lens: its header has no ``jlens`` metadata."""


@dataclass(frozen=True)
class LensHeader:
    """What a lens file's header says, without its tensors.

    Attributes:
        path: the file.
        metadata: the safetensors ``__metadata__`` (string to string: ``format``, ``jlens``).
        info: the ``jlens`` metadata parsed (the lens's settings, rules, model identity, diagnostics...); shared
            by every caller of this file version: read it, do not change it (:meth:`fresh_info` gives a copy).
        tensors: ``{name: {"dtype", "shape", "data_offsets"}}`` per stored tensor.
    """

    path: Path
    metadata: dict[str, str]
    info: dict[str, Any] = field(repr=False)
    tensors: dict[str, dict[str, Any]] = field(repr=False)

    @property
    def format(self) -> str | None:
        """``"jlens"``, ``"jlens-experts"`` or ``"jlens-tuned"`` (None: none recorded)."""
        return self.metadata.get("format") or self.info.get("format")

    @property
    def is_expert(self) -> bool:
        """A full expert lens file (not its combined one-matrix file)."""
        return self.metadata.get("format") == EXPERTS_FORMAT_NAME

    @property
    def is_tuned(self) -> bool:
        return self.info.get("format") == TUNED_FORMAT_NAME

    @property
    def rules(self) -> str | None:
        """The fit's backward rules (``"jacobian"`` for a file from before rules); None for a tuned lens."""
        return None if self.is_tuned else str(self.info.get("rules", "jacobian"))

    @property
    def settings(self) -> dict[str, Any]:
        settings = self.info.get("settings")
        return settings if isinstance(settings, dict) else {}

    @property
    def half_prompts(self) -> tuple[int, int] | None:
        """``(n_even, n_odd)`` of a file that keeps its split halves (docs/method.md §3.3); ``None`` otherwise."""
        return half_prompts_of(self.info)

    @property
    def kind(self) -> str:
        """The lens kind the file holds (:mod:`jlens_core.lenses.kinds`): ``"tuned"``; an expert lens's kind by its
        rules and weights; a combined one-matrix file's ``expert_kind``; else its rules (``"jacobian"``,
        ``"relevance"``)."""
        if self.is_tuned:
            return "tuned"
        rules = self.rules or "jacobian"
        if self.is_expert:
            return expert_kind(rules, weighted=bool(self.info.get("weighted")))
        return str(self.settings.get("expert_kind") or rules)

    def fresh_info(self) -> dict[str, Any]:
        """The ``jlens`` metadata parsed anew: a copy the caller may keep and change (a loaded lens's fields)."""
        return json.loads(self.metadata["jlens"]) if "jlens" in self.metadata else {}


def read_header(path: str | os.PathLike) -> LensHeader:
    """The header of the lens file at ``path``, read once per file version (path, mtime, size, inode).

    Raises:
        FileNotFoundError: no file at ``path``.
        LensFileError: a folder, or not readable as safetensors (truncated, another kind of file), naming
            the path; :class:`ForeignFileError` (a ``LensFileError``): a safetensors file without jlens
            metadata.
    """
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"No lens file at {str(path)!r}.") from None
    if path.is_dir():
        raise LensFileError(f"{str(path)!r} is a folder, not a lens file.")
    return _read(str(path), st.st_mtime_ns, st.st_size, st.st_ino)


@functools.lru_cache(maxsize=64)
def _read(path: str, mtime_ns: int, size: int, inode: int) -> LensHeader:
    """The header of one version of a file (the arguments after ``path`` only key the cache)."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > MAX_HEADER_BYTES or length + 8 > size:
                raise ValueError(f"its first 8 bytes give a header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise TypeError("its header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        ends = [int(entry["data_offsets"][1]) for entry in header.values()]
        if max(ends, default=0) + length + 8 != size:
            raise ValueError(f"its tensors end at byte {max(ends, default=0) + length + 8}, the file at byte {size}")
    except (OSError, ValueError, struct.error, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise LensFileError(f"{path!r} is not a readable lens file (truncated or not safetensors): {exc}") from None
    if not isinstance(metadata, dict) or "jlens" not in metadata:
        raise ForeignFileError(f"{path!r} is a safetensors file but not a jlens lens (no jlens metadata in its "
                               "header).")
    try:
        info = json.loads(metadata["jlens"])
    except ValueError as exc:
        raise LensFileError(f"{path!r} has jlens metadata that is not JSON ({exc}): the file is damaged.") from None
    if not isinstance(info, dict):
        raise LensFileError(f"{path!r} has jlens metadata that is not a JSON object: the file is damaged.")
    return LensHeader(path=Path(path), metadata=dict(metadata), info=info, tensors=header)


def header_or_none(path: str | os.PathLike) -> LensHeader | None:
    """:func:`read_header`, or None for anything it refuses (a missing, foreign or damaged file): for questions
    such as "is this an expert lens file?" whose answer for such a file is no."""
    try:
        return read_header(path)
    except (OSError, LensFileError):
        return None


def half_prompts_of(info: Mapping[str, Any]) -> tuple[int, int] | None:
    """``(n_even, n_odd)`` from a lens file header's ``halves`` field (docs/method.md §3.3), or ``None`` when the
    file keeps no halves."""
    halves = info.get("halves")
    if not isinstance(halves, Mapping):
        return None
    n_even, n_odd = halves["n_prompts"]
    return int(n_even), int(n_odd)


__all__ = ["EXPERTS_FORMAT_NAME", "FORMAT_NAME", "MAX_HEADER_BYTES", "TUNED_FORMAT_NAME", "ForeignFileError",
           "LensFileError", "LensHeader", "half_prompts_of", "header_or_none",
           "read_header"]
