"""The reading file's format: readings as one JSON document and back (docs/method.md §6.1).

What :mod:`~jlens_core.reading.reading_file` (``save_readings``, ``load_readings``) and
:meth:`PromptReading.save <jlens_core.reading.prompt_reading.PromptReading.save>` /
:meth:`~jlens_core.reading.prompt_reading.PromptReading.load` share: the format's name and version, the
arrays stored, the encoding of a reading, a generation and a comparison, and the checked decoding of a
file into a reading's fields. It never imports :mod:`~jlens_core.reading.prompt_reading` (which imports
it): a reading is read through its attributes and rebuilt by the class the caller names.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from .._atomic import atomic_write_text
from .._version import __version__
from ..lenses.protocol import recorded_skip_first
from .json_arrays import ArrayFieldError, decode_array, encode_array, jsonable
from .stability import Stability
from .tokens import id_label

if TYPE_CHECKING:
    from ..lenses.protocol import Lens
    from ..models.model import LensModel
    from .generation import Generation
    from .run_comparison import RunComparison

R = TypeVar("R")

FORMAT_NAME = "jlens-reading"
FORMAT_VERSION = 2  # 2: stability marks (docs/method.md §6.2); version 1 files still load
READABLE_VERSIONS = (1, 2)
SUFFIX = ".jlens.json"  # the suggested file name ending

# PromptReading's arrays as stored, and the dtype each has in memory
READING_ARRAYS = {"input_ids": np.int64, "positions": np.int64, "next_ids": np.int64, "final_top1_ids": np.int64,
                  "top_ids": np.int64, "top_probs": np.float32, "entropy_bits": np.float64, "kl_bits": np.float64,
                  "ce_bits": np.float64, "next_token_rank": np.float64, "final_top1_rank": np.int64}
GRID_ARRAYS = ("entropy_bits", "kl_bits", "ce_bits", "next_token_rank", "final_top1_rank")  # [n_layers, n_positions]
TOP_ARRAYS = ("top_ids", "top_probs")  # [n_layers, n_positions, top_k]
STABILITY_ARRAYS = {"half_rank_even": np.int64, "half_rank_odd": np.int64, "half_top1_agree": bool}
COMPARISON_FIGURES = ("readout_kl_bits", "downstream_kl_bits", "downstream_kl_max_bits")  # RunComparison's, bits
GENERATION_ARRAYS = {"prompt_ids": np.int64, "generated_ids": np.int64, "top_ids": np.int64, "top_probs": np.float32}
# lens metadata left out of the file: per-prompt fit records, as long as the fit
LEFT_OUT_LENS_METADATA = ("diagnostics",)


class ReadingFileError(ValueError):
    """A file that cannot be read as a reading file: not one, another format version, or missing a field."""


# -- writing ----------------------------------------------------------------------------------------------
def lens_identity(lens: Lens | None, *, kind: str, origin: str | None = None) -> dict[str, Any]:
    """What a reading file says about a lens: ``kind``, ``origin`` and its metadata (no diagnostics)."""
    identity: dict[str, Any] = {"kind": kind, "origin": origin}
    if lens is not None:
        identity["kind"] = str(lens.kind)
        metadata = lens.metadata() if callable(getattr(lens, "metadata", None)) else {}  # type: ignore[attr-defined]
        identity.update({k: v for k, v in metadata.items() if k not in LEFT_OUT_LENS_METADATA and k not in identity})
        skip_first = recorded_skip_first(lens)
        identity.setdefault("settings", {} if skip_first is None else {"skip_first": skip_first})
        identity.setdefault("layers", list(lens.layers))
    return jsonable(identity)


def write_readings(path: str | os.PathLike, readings: Mapping[str, Any], *, model: LensModel | None = None,
                   lenses: Mapping[str, Lens] | None = None, origins: Mapping[str, str] | None = None,
                   generation: Generation | None = None, comparison: RunComparison | None = None) -> Path:
    """Write ``{name: PromptReading}`` (checked by the caller: non-empty, every value a reading) to one JSON
    reading file, atomically; returns the path. The arguments are
    :func:`~jlens_core.reading.reading_file.save_readings`'s."""
    first = next(iter(readings.values()))
    lens_map, origin_map = dict(lenses or {}), dict(origins or {})
    document = {
        "format": FORMAT_NAME, "version": FORMAT_VERSION, "jlens_version": __version__,
        "model": _model_identity(model, first),
        "readings": {str(name): _encode_reading(reading, lens_identity(lens_map.get(name), kind=reading.lens_kind,
                                                                       origin=origin_map.get(name)))
                     for name, reading in readings.items()},
        "generation": None if generation is None else _encode_generation(generation),
        "comparison": None if comparison is None else _encode_comparison(comparison),
    }
    text = json.dumps(document, allow_nan=False, separators=(",", ":"))
    return atomic_write_text(path, text, shared=True)


def _model_identity(model: LensModel | None, reading: Any) -> dict[str, Any]:
    if model is None:
        return {"name": reading.model_name, "fingerprint": None, "n_layers": reading.output_layer + 1,
                "vocab_size": len(reading.vocab_strings) or None}
    fingerprint = model.fingerprint() if callable(getattr(model, "fingerprint", None)) else None
    return jsonable({"name": str(model.name), "fingerprint": fingerprint, "n_layers": int(model.n_layers),
                     "vocab_size": int(model.vocab_size)})


def _shown_ids(reading: Any) -> np.ndarray:
    """The sorted ids a reading names: its input, top-k lists, final top-1s and pinned tokens."""
    ids = np.concatenate([reading.input_ids.reshape(-1), reading.top_ids.reshape(-1),
                          reading.final_top1_ids.reshape(-1), np.asarray(list(reading.pinned.values()), np.int64)])
    return np.unique(ids[ids >= 0])


def _encode_reading(reading: Any, lens: dict[str, Any]) -> dict[str, Any]:
    ids = _shown_ids(reading)
    words = reading.word_ids
    return {
        "lens": lens, "model_name": reading.model_name, "lens_kind": reading.lens_kind, "text": reading.text,
        "tokens": list(reading.tokens), "segments": reading.segments, "n_prompt": reading._prompt_length,
        "layers": [int(x) for x in reading.layers], "output_layer": int(reading.output_layer),
        "top_k": int(reading.top_k), "show_whitespace": bool(reading.show_whitespace),
        "word_like": bool(reading.word_like), "vocab": reading.vocab, "skip_first": int(reading.skip_first),
        "edits": list(reading.edits), "pinned": {str(k): int(v) for k, v in reading.pinned.items()},
        "vocab_size": len(reading.vocab_strings),
        "token_strings": {"ids": encode_array(ids), "strings": reading._names(ids.tolist()),
                          "word": None if words is None else encode_array(words[np.minimum(ids, len(words) - 1)]
                                                                           & (ids < len(words)))},
        "arrays": {name: encode_array(getattr(reading, name)) for name in READING_ARRAYS},
        "pinned_ranks": {str(k): encode_array(v) for k, v in reading.pinned_ranks.items()},
        "stability": _encode_stability(reading),
    }


def _encode_stability(reading: Any) -> dict[str, Any] | None:
    """The reading's stability marks and note (version 2), or None when it has neither."""
    marks = getattr(reading, "stability", None)
    note = str(getattr(reading, "stability_note", ""))
    if marks is None and not note:
        return None
    return {"stability_k": None if marks is None else int(marks.stability_k), "note": note,
            "arrays": None if marks is None else {name: encode_array(getattr(marks, name)) for name in STABILITY_ARRAYS}}


def _encode_generation(generation: Generation) -> dict[str, Any]:
    return {"prompt": generation.prompt, "prompt_text": generation.prompt_text,
            "stop_reason": generation.stop_reason, "temperature": float(generation.temperature),
            "seed": None if generation.seed is None else int(generation.seed), "chat": bool(generation.chat),
            "model_name": generation.model_name, "edits": list(generation.edits),
            "continuation": generation.continuation,
            "arrays": {name: encode_array(getattr(generation, name)) for name in GENERATION_ARRAYS}}


def _encode_comparison(comparison: RunComparison) -> dict[str, Any]:
    return {"clean": _encode_generation(comparison.clean), "edited": _encode_generation(comparison.edited),
            "next_tokens": jsonable(comparison.next_tokens.to_dict(orient="records")),
            "first_difference": None if comparison.first_difference is None else int(comparison.first_difference),
            **{name: _finite_or_none(getattr(comparison, name)) for name in COMPARISON_FIGURES},
            "readout_excluded": list(comparison.readout_excluded)}


def _finite_or_none(value: float) -> float | None:
    return None if math.isnan(value) else float(value)


# -- reading ------------------------------------------------------------------------------------------------
class _Document:
    """Field look-ups in a parsed file that fail with one sentence naming the file and the field."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, problem: str) -> ReadingFileError:
        return ReadingFileError(f"{str(self.path)!r} is not a reading file jlens can open: {problem}; save the "
                                "reading again with read_prompt(...).save(path) or `jlens inspect --save`.")

    def need(self, obj: Any, key: str, where: str, kind: type | tuple[type, ...] | None = None) -> Any:
        """``obj[key]``, which must exist (and be a ``kind``)."""
        if not isinstance(obj, Mapping) or key not in obj:
            raise self.fail(f"it lacks the field {where!r}")
        value = obj[key]
        if kind is not None and not isinstance(value, kind):
            raise self.fail(f"its field {where!r} is a {type(value).__name__}, not a {_kind_name(kind)}")
        return value

    def array(self, obj: Any, key: str, where: str, dtype: Any = None) -> np.ndarray:
        try:
            return decode_array(self.need(obj, key, where), where, dtype)
        except ArrayFieldError as exc:
            raise self.fail(str(exc)) from None


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {"str": "string", "int": "whole number", "float": "number", "bool": "true/false", "list": "list",
             "dict": "object", "NoneType": "null"}
    return " or ".join(names.get(k.__name__, k.__name__) for k in kinds)


def read_file(path: str | os.PathLike, reading_class: Callable[..., R]) -> dict[str, Any]:
    """The parts of a reading file (docs/method.md §6.1) as :class:`~jlens_core.reading.reading_file.ReadingFile`'s
    fields, each reading built by ``reading_class(**fields)``; no model is needed.

    Raises:
        FileNotFoundError: no file at ``path``.
        ReadingFileError: not JSON, not a reading file, a format version this jlens does not read, a
            missing field, or arrays whose shapes do not fit the reading (one sentence each).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No reading file at {str(path)!r}.")
    doc = _Document(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise doc.fail(f"it is not JSON ({exc.__class__.__name__} at byte {getattr(exc, 'pos', 0)})") from None
    if not isinstance(data, Mapping) or data.get("format") != FORMAT_NAME:
        found = data.get("format") if isinstance(data, Mapping) else type(data).__name__
        raise doc.fail(f"its format is {found!r}, not {FORMAT_NAME!r}")
    version = data.get("version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise ReadingFileError(f"{str(path)!r} is a reading file of format version {version!r}, which this jlens "
                               f"({__version__}) cannot read (it reads versions {READABLE_VERSIONS[0]} to "
                               f"{FORMAT_VERSION}): open it with the jlens that wrote it, or update jlens.")
    model = dict(doc.need(data, "model", "model", dict))
    doc.need(model, "name", "model.name", str)
    entries = doc.need(data, "readings", "readings", dict)
    if not entries:
        raise doc.fail("its field 'readings' is empty")
    readings = {name: reading_class(**_decode_reading(doc, entry, f"readings.{name}")) for name, entry in entries.items()}
    lenses = {name: dict(doc.need(entry, "lens", f"readings.{name}.lens", dict)) for name, entry in entries.items()}
    generation = data.get("generation")
    comparison = data.get("comparison")
    return {
        "readings": readings, "model": model, "lenses": lenses,
        "generation": None if generation is None else _decode_generation(doc, generation, "generation"),
        "comparison": None if comparison is None else _decode_comparison(doc, comparison, "comparison"),
        "version": int(version), "jlens_version": str(data.get("jlens_version", "")), "path": path}


def _decode_reading(doc: _Document, entry: Any, where: str) -> dict[str, Any]:
    """The keyword arguments of the ``PromptReading`` a file's entry holds, checked."""
    def need(key: str, kind: type | tuple[type, ...] | None = None) -> Any:
        return doc.need(entry, key, f"{where}.{key}", kind)

    arrays_field = need("arrays", dict)
    arrays = {name: doc.array(arrays_field, name, f"{where}.arrays.{name}", dtype)
              for name, dtype in READING_ARRAYS.items()}
    pinned = {str(k): int(v) for k, v in need("pinned", dict).items()}
    pinned_ranks = {name: doc.array(need("pinned_ranks", dict), name, f"{where}.pinned_ranks.{name}", np.int64)
                    for name in pinned}
    layers = [int(x) for x in need("layers", list)]
    tokens = [str(t) for t in need("tokens", list)]
    top_k = int(need("top_k", int))
    _check_shapes(doc, where, arrays, pinned_ranks, n_layers=len(layers), n_tokens=len(tokens), top_k=top_k)
    vocab_strings, word_ids = _decode_token_strings(doc, need("token_strings", dict), f"{where}.token_strings",
                                                    vocab_size=int(need("vocab_size", int)))
    stability, note = _decode_stability(doc, entry.get("stability"), f"{where}.stability",
                                        (len(layers), len(arrays["positions"])))
    return dict(
        text=need("text", str), model_name=need("model_name", str), lens_kind=need("lens_kind", str),
        tokens=tokens, layers=layers, output_layer=int(need("output_layer", int)), top_k=top_k,
        show_whitespace=bool(need("show_whitespace", bool)), word_like=bool(need("word_like", bool)),
        pinned=pinned, pinned_ranks=pinned_ranks, vocab_strings=vocab_strings, n_prompt=int(need("n_prompt", int)),
        edits=[str(e) for e in need("edits", list)], vocab=need("vocab", str),
        skip_first=int(need("skip_first", int)), display=None, saved_word_ids=word_ids, stability=stability,
        stability_note=note, **arrays)


def _decode_stability(doc: _Document, entry: Any, where: str, shape: tuple[int, int]) -> tuple[Stability | None, str]:
    """``(marks, note)`` of a reading's ``stability`` field (absent in version 1 files: no marks)."""
    if entry is None:
        return None, ""
    note = str(doc.need(entry, "note", f"{where}.note", str))
    arrays_field = doc.need(entry, "arrays", f"{where}.arrays", (dict, type(None)))
    if arrays_field is None:
        return None, note
    arrays = {name: doc.array(arrays_field, name, f"{where}.arrays.{name}", dtype)
              for name, dtype in STABILITY_ARRAYS.items()}
    for name, array in arrays.items():
        if tuple(array.shape) != shape:
            raise doc.fail(f"{where}.arrays.{name} has the shape {list(array.shape)}, not the reading's {list(shape)}")
    k = doc.need(entry, "stability_k", f"{where}.stability_k", int)
    return Stability(stability_k=int(k), **arrays), note


def _check_shapes(doc: _Document, where: str, arrays: dict[str, np.ndarray], pinned_ranks: dict[str, np.ndarray], *,
                  n_layers: int, n_tokens: int, top_k: int) -> None:
    """Raise unless the arrays fit ``layers`` x ``positions`` (and ``top_k``, and the prompt's tokens)."""
    n_positions = len(arrays["positions"])
    expected: dict[str, tuple[int, ...]] = {"input_ids": (n_tokens,), "positions": (n_positions,),
                                            "next_ids": (n_positions,), "final_top1_ids": (n_positions,)}
    expected.update({name: (n_layers, n_positions) for name in GRID_ARRAYS})
    expected.update({name: (n_layers, n_positions, top_k) for name in TOP_ARRAYS})
    shapes = {f"arrays.{name}": arrays[name].shape for name in expected}
    shapes.update({f"pinned_ranks.{name}": ranks.shape for name, ranks in pinned_ranks.items()})
    expected.update({f"pinned_ranks.{name}": (n_layers, n_positions) for name in pinned_ranks})
    for key, shape in shapes.items():
        want = expected[key.split(".", 1)[1]] if key.startswith("arrays.") else expected[key]
        if tuple(shape) != want:
            raise doc.fail(f"{where}.{key} has the shape {list(shape)}, not the {list(want)} its {n_layers} layers, "
                           f"{n_positions} positions, top_k={top_k} and {n_tokens} tokens take")
    if n_positions and (arrays["positions"].min() < 0 or arrays["positions"].max() >= n_tokens):
        raise doc.fail(f"{where}.arrays.positions holds a position outside its {n_tokens} tokens")


def _decode_token_strings(doc: _Document, table: Mapping[str, Any], where: str, *,
                          vocab_size: int) -> tuple[list[str], np.ndarray | None]:
    """``(vocab_strings, word_ids)``: the recorded ids' strings at their ids (``<id:N>`` elsewhere) and
    their word flags (False elsewhere; None when the reading had no tokenizer to tell)."""
    ids = doc.array(table, "ids", f"{where}.ids", np.int64)
    strings = doc.need(table, "strings", f"{where}.strings", list)
    if len(strings) != len(ids):
        raise doc.fail(f"{where}.strings has {len(strings)} entries for {len(ids)} ids")
    size = max(int(vocab_size), int(ids.max()) + 1 if len(ids) else 0)
    vocab_strings = [id_label(i) for i in range(size)]
    for i, s in zip(ids.tolist(), strings):
        vocab_strings[i] = str(s)
    if table.get("word") is None:
        return vocab_strings, None
    flags = doc.array(table, "word", f"{where}.word", bool)
    if flags.shape != ids.shape:
        raise doc.fail(f"{where}.word has {len(flags)} flags for {len(ids)} ids")
    word_ids = np.zeros(size, dtype=bool)
    word_ids[ids] = flags
    word_ids.flags.writeable = False
    return vocab_strings, word_ids


def _decode_generation(doc: _Document, entry: Any, where: str) -> Generation:
    from .generation import Generation  # imports torch: only for a file that holds a generation

    def need(key: str, kind: type | tuple[type, ...] | None = None) -> Any:
        return doc.need(entry, key, f"{where}.{key}", kind)

    arrays = {name: doc.array(need("arrays", dict), name, f"{where}.arrays.{name}", dtype)
              for name, dtype in GENERATION_ARRAYS.items()}
    seed = need("seed", (int, type(None)))
    return Generation(prompt=need("prompt", str), prompt_text=need("prompt_text", str),
                      stop_reason=need("stop_reason", str), temperature=float(need("temperature", (int, float))),
                      seed=None if seed is None else int(seed), chat=bool(need("chat", bool)),
                      model_name=need("model_name", str), edits=[str(e) for e in need("edits", list)],
                      continuation=need("continuation", str), **arrays)


def _decode_comparison(doc: _Document, entry: Any, where: str) -> RunComparison:
    import pandas as pd

    from .run_comparison import NEXT_TOKEN_COLUMNS, RunComparison

    rows = doc.need(entry, "next_tokens", f"{where}.next_tokens", list)
    first = doc.need(entry, "first_difference", f"{where}.first_difference", (int, type(None)))
    # the side-effect figures are newer than the format: a file without them opens with NaN
    figures = {name: math.nan if entry.get(name) is None else float(entry[name]) for name in COMPARISON_FIGURES}
    return RunComparison(clean=_decode_generation(doc, doc.need(entry, "clean", f"{where}.clean"), f"{where}.clean"),
                         edited=_decode_generation(doc, doc.need(entry, "edited", f"{where}.edited"),
                                                   f"{where}.edited"),
                         next_tokens=pd.DataFrame(rows, columns=list(NEXT_TOKEN_COLUMNS) if not rows else None),
                         first_difference=first, **figures,
                         readout_excluded=[str(t) for t in entry.get("readout_excluded") or []])


def pick_reading(path: str | os.PathLike, readings: Mapping[str, R], name: str | None) -> R:
    """``readings[name]``, or the file's only reading when ``name`` is None.

    Raises:
        ReadingFileError: no reading ``name``, or several and no ``name``.
    """
    if name is None:
        if len(readings) > 1:
            raise ReadingFileError(f"{str(path)!r} holds {len(readings)} readings ({', '.join(readings)}): name one, "
                                   "or open them all with load_readings.")
        return next(iter(readings.values()))
    if name not in readings:
        raise ReadingFileError(f"{str(path)!r} holds no reading {name!r}: it holds {', '.join(readings)}.")
    return readings[name]


__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "GENERATION_ARRAYS", "READING_ARRAYS", "SUFFIX", "ReadingFileError",
           "lens_identity", "pick_reading", "read_file", "write_readings"]
