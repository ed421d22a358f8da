"""The reading file: readings saved to one JSON document that reopens without the model (docs/method.md §6.1).

:func:`save_readings` writes one or several :class:`~jlens_core.reading.prompt_reading.PromptReading`
(the lenses of :func:`~jlens_core.reading.reader.read_prompts`, an edited reading beside its clean one),
the model's and each lens's identity, and optionally the :class:`~jlens_core.reading.generation.Generation`
read and a :class:`~jlens_core.reading.run_comparison.RunComparison`; :func:`load_readings` gives them
back as a :class:`ReadingFile`. Every number is stored exactly (arrays in their own dtype,
:mod:`~jlens_core.reading.json_arrays`), so a loaded reading's grids, frame and cells equal the
original's. A loaded reading has no tokenizer: its ``display`` is ``None``, and ``vocab_strings``
names only the ids the file records (every id the reading shows); :attr:`PromptReading.word_ids`
is the word mask of those ids.

A file of another format version, or one that lacks a field, raises :class:`ReadingFileError` with
one sentence.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._version import __version__
from .file_format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    SUFFIX,
    ReadingFileError,
    lens_identity,
    read_file,
    write_readings,
)
from .prompt_reading import PromptReading

if TYPE_CHECKING:
    from ..lenses.protocol import Lens
    from ..models.model import LensModel
    from .generation import Generation
    from .run_comparison import RunComparison

@dataclass
class ReadingFile:
    """What :func:`load_readings` returns.

    Attributes:
        readings: ``{name: PromptReading}`` in the saved order (a lens's name, e.g. ``"logit"``,
            ``"jacobian"``, or ``"jacobian (edited)"``).
        model: the model's identity: ``name``, ``fingerprint`` (``HFLensModel.fingerprint()``, or
            ``None`` when it was saved without the model), ``n_layers`` and ``vocab_size``.
        lenses: ``{name: identity}`` per reading: ``kind``, ``origin`` (what the lens was loaded from, when
            known) and the lens file's metadata (``settings``, ``model_name``, ``model_fingerprint``, ...)
            without its per-prompt diagnostics.
        generation: the continuation the readings read (None: a prompt alone).
        comparison: a clean and an edited run of the prompt (None: none was saved).
        version: the file's format version; jlens_version: the jlens that wrote it.
        path: where it was loaded from.
    """

    readings: dict[str, PromptReading]
    model: dict[str, Any]
    lenses: dict[str, dict[str, Any]] = field(default_factory=dict)
    generation: Generation | None = None
    comparison: RunComparison | None = None
    version: int = FORMAT_VERSION
    jlens_version: str = __version__
    path: Path | None = None


def save_readings(path: str | os.PathLike, readings: Mapping[str, PromptReading], *, model: LensModel | None = None,
                  lenses: Mapping[str, Lens] | None = None, origins: Mapping[str, str] | None = None,
                  generation: Generation | None = None, comparison: RunComparison | None = None) -> Path:
    """Write readings to one JSON reading file, atomically (docs/method.md §6.1); returns the path written.

    Args:
        path: the file (``reading.jlens.json`` by convention).
        readings: ``{name: PromptReading}``, e.g. what :func:`~jlens_core.reading.reader.read_prompts` returns.
        model: the model read (adds its fingerprint; default: the readings' model name alone).
        lenses: ``{name: lens}`` for the readings' names: their metadata goes in the file.
        origins: ``{name: where the lens came from}`` (a file, ``"default"``, ``"logit"``).
        generation: the :class:`~jlens_core.reading.generation.Generation` the readings read.
        comparison: a :class:`~jlens_core.reading.run_comparison.RunComparison` of the prompt.

    Raises:
        ValueError: no readings.
        TypeError: a value that is not a :class:`PromptReading`.
    """
    if not readings:
        raise ValueError("No readings to save: give at least one {name: PromptReading}.")
    for name, reading in readings.items():
        if not isinstance(reading, PromptReading):
            raise TypeError(f"readings[{name!r}] is a {type(reading).__name__}, not a PromptReading: save what "
                             "read_prompt or read_prompts returns.")
    return write_readings(path, readings, model=model, lenses=lenses, origins=origins, generation=generation,
                          comparison=comparison)


def load_readings(path: str | os.PathLike) -> ReadingFile:
    """Open a reading file written by :func:`save_readings` (docs/method.md §6.1); no model is needed.

    Raises:
        FileNotFoundError: no file at ``path``.
        ReadingFileError: not JSON, not a reading file, a format version this jlens does not read, a
            missing field, or arrays whose shapes do not fit the reading (one sentence each).
    """
    return ReadingFile(**read_file(path, PromptReading))


__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "SUFFIX", "ReadingFile", "ReadingFileError", "lens_identity",
           "load_readings", "save_readings"]
