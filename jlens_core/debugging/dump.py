"""Dump every hidden state of one forward pass to disk, to find where two runs part ways.

A dump is a folder:

* one raw little-endian float32 file per recorded tensor, named ``{step:04d}_L{layer:03d}_{op}.f32``
  (``0000_embed.f32`` and ``{step:04d}_final_norm.f32`` for the two ends), C order, no header;
* ``manifest.jsonl``: one JSON line per file, in step order: ``step``, ``layer``, ``op``, ``shape``,
  ``dtype`` (always ``"float32"``, little-endian), ``source_dtype`` (the dtype the model computed
  it in), ``bytes``, ``file``, ``sha256``;
* ``run.json``: the settings of the run (model name, layout and fingerprint, dtype, device, torch /
  transformers / numpy / jlens versions, token ids, text, ops, layers, file count), written last.

Ops, in the order a forward pass produces them (``step`` counts in that order, from 0):

* ``embed``: output of the token-embedding module, ``[seq, width]`` (before any scaling or
  position embedding a family adds after it); ``layer = -1``;
* per selected decoder layer ``l``: ``attn`` (output of the attention sublayer) and ``mlp``
  (output of the MLP sublayer), where the layout names them (first tensor of a tuple output),
  then ``residual`` (output of the decoder layer, pre-final-norm, docs/method.md §1); ``layer = l``;
* ``final_norm``: output of the final norm, ``[seq, width]``; ``layer = n_layers``.

Arrays are stored without the batch axis: ``[seq, width]`` with position on axis 0.

Recording is off by default and costs nothing when off: the forward hooks exist only inside
:func:`dump_hidden_states` and are removed on exit, on error as well.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from jaxtyping import Int

from .._atomic import atomic_write_text
from ..layerspec import normalise_layers
from ..models.model import LensModel
from ..models.recorder import block_output, register_own_thread_hook

log = logging.getLogger(__name__)

FORMAT = "jlens-dump"
FORMAT_VERSION = 1
MANIFEST = "manifest.jsonl"
RUN_FILE = "run.json"
SUFFIX = ".f32"

LAYER_OPS = ("attn", "mlp", "residual")
END_OPS = ("embed", "final_norm")
ALL_OPS = ("embed", "attn", "mlp", "residual", "final_norm")
_MANIFEST_KEYS = ("step", "layer", "op", "shape", "dtype", "bytes", "file", "sha256")


# -- naming ------------------------------------------------------------------------------------

def file_name(step: int, layer: int, op: str) -> str:
    """The file name of one tensor: ``0003_L001_attn.f32``, ``0000_embed.f32``, ``0013_final_norm.f32``."""
    if op in END_OPS:
        return f"{step:04d}_{op}{SUFFIX}"
    return f"{step:04d}_L{layer:03d}_{op}{SUFFIX}"


def parse_ops(ops: str | Iterable[str]) -> tuple[str, ...]:
    """Normalise an op selection: ``"residual,attn"``, ``["mlp"]`` or ``"all"`` (all three layer ops).

    Returns:
        The selected per-layer ops in forward order (a subset of ``("attn", "mlp", "residual")``).

    Raises:
        ValueError: an unknown op name, or nothing selected.
    """
    names = [s.strip() for s in ops.split(",")] if isinstance(ops, str) else [str(s).strip() for s in ops]
    names = [n for n in names if n]
    if not names:
        raise ValueError("No op selected: give some of 'residual', 'attn', 'mlp' (or 'all').")
    chosen: set[str] = set()
    for name in names:
        if name == "all":
            chosen.update(LAYER_OPS)
        elif name in LAYER_OPS:
            chosen.add(name)
        elif name in END_OPS:
            raise ValueError(f"Op {name!r} is not a per-layer op: the embedding and final-norm outputs are "
                             "recorded with ends=True (the default; CLI: drop --no-ends).")
        else:
            raise ValueError(f"Unknown op {name!r}: choose from 'residual', 'attn', 'mlp' or 'all'.")
    return tuple(op for op in LAYER_OPS if op in chosen)


# -- writing -----------------------------------------------------------------------------------

def _token_ids(model: LensModel, text_or_ids: str | Sequence[int] | torch.Tensor, max_length: int | None
               ) -> tuple[torch.Tensor, str | None]:
    if isinstance(text_or_ids, str):
        return model.encode(text_or_ids, max_length=max_length), text_or_ids
    if isinstance(text_or_ids, torch.Tensor):
        ids = text_or_ids.detach().to(torch.long)
    else:
        try:
            ids = torch.tensor(list(text_or_ids), dtype=torch.long)
        except (TypeError, ValueError) as exc:
            raise ValueError("text_or_ids must be a string, a list of token ids or a LongTensor "
                             f"[seq] / [1, seq]; got {type(text_or_ids).__name__}.") from exc
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise ValueError(f"Token ids must have shape [seq] or [1, seq], not {list(ids.shape)}: "
                         "a dump is of one prompt.")
    if ids.shape[1] == 0:
        raise ValueError("The token id list is empty: give at least one token.")
    if max_length is not None:
        ids = ids[:, :max_length]
    return ids.to(model.device), None


def _versions() -> dict[str, str]:
    import transformers

    from .._version import __version__

    return {"jlens": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "numpy": np.__version__, "python": platform.python_version()}


def _prepare_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"The dump folder {str(out_dir)!r} exists and is a file: give a folder path.")
    if out_dir.is_dir():
        contents = list(out_dir.iterdir())
        is_dump = any(p.name in (MANIFEST, RUN_FILE) for p in contents)
        if contents and not overwrite:
            what = "holds a dump" if is_dump else "is not empty"
            raise ValueError(f"The dump folder {str(out_dir)!r} {what}: choose a new folder, or pass "
                             "overwrite=True (CLI: --force) to replace it.")
        if contents:
            if not is_dump:
                raise ValueError(f"The folder {str(out_dir)!r} is not empty and holds no dump: refusing to write "
                                 "into it even with overwrite; choose an empty or new folder.")
            for p in contents:
                if p.is_file() and (p.suffix == SUFFIX or p.name in (MANIFEST, RUN_FILE)):
                    p.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)


class _DumpWriter:
    """Forward hooks that write each recorded tensor as it is produced (one tensor in memory at a time)."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.entries: list[dict] = []
        self.seen: set[tuple[int, str]] = set()
        self.handles: list = []

    def write(self, layer: int, op: str, tensor: torch.Tensor) -> None:
        key = (layer, op)
        if key in self.seen:
            log.warning("Module for layer %d op %r ran more than once in one forward; keeping the first output.",
                        layer, op)
            return
        self.seen.add(key)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"Layer {layer} op {op!r} produced a {type(tensor).__name__}, not a tensor: "
                             "this layout's sublayer output cannot be dumped.")
        source_dtype = str(tensor.dtype).replace("torch.", "")
        t = tensor.detach()
        if t.ndim >= 3 and t.shape[0] == 1:
            t = t[0]
        array = t.to(dtype=torch.float32).cpu().contiguous().numpy().astype("<f4", copy=False)
        data = array.tobytes(order="C")
        step = len(self.entries)
        name = file_name(step, layer, op)
        (self.out_dir / name).write_bytes(data)
        self.entries.append({"step": step, "layer": layer, "op": op, "shape": list(array.shape),
                             "dtype": "float32", "source_dtype": source_dtype, "bytes": len(data),
                             "file": name, "sha256": hashlib.sha256(data).hexdigest()})

    def hook(self, layer: int, op: str):
        def fn(module, args, output):
            self.write(layer, op, block_output(output))

        return fn

    def attach(self, module: torch.nn.Module, layer: int, op: str) -> None:
        self.handles.append(register_own_thread_hook(module, self.hook(layer, op)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


@dataclass
class _Selection:
    """What a dump records: per-layer ops, decoder layers, the two ends, and the ops the model cannot give."""

    ops: tuple[str, ...]
    layers: list[int]
    ends: bool
    not_dumped: list[str]


def _check_extra_settings(extra_settings: dict[str, Any] | None) -> None:
    """Raise ValueError when ``extra_settings`` cannot be written as JSON."""
    if extra_settings is None:
        return
    try:
        json.dumps(extra_settings)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"extra_settings cannot be written as JSON ({exc}); keep to str, numbers, "
                         "lists and dicts.") from exc


def _not_dumped(model: LensModel, ops: tuple[str, ...], layers: list[int], ends: bool) -> list[str]:
    """The selected ops the model does not expose (a sublayer the layout does not name, a missing final norm)."""
    from ..models.layouts import get_path

    layout = model.layout
    missing: list[str] = []
    for op, path in (("attn", layout.attn), ("mlp", layout.mlp)):
        if op in ops and (path is None or get_path(model.layers[layers[0]], path) is None):
            missing.append(op)
            log.info("Layout %r does not expose the %s sublayer: op %r is not dumped.", layout.name, op, op)
    if ends and model.final_norm is None:
        missing.append("final_norm")
        log.info("Model %s has no final norm: op 'final_norm' is not dumped.", model.name)
    return missing


def _attach_hooks(writer: _DumpWriter, model: LensModel, selection: _Selection) -> None:
    """Hook every selected module, in forward order.

    Raises:
        ValueError: a layer has no sublayer where the layout names one.
    """
    from ..models.layouts import get_path

    layout = model.layout
    if selection.ends:
        writer.attach(model.embed, -1, "embed")
    for i in selection.layers:
        block = model.layers[i]
        for op, path in (("attn", layout.attn), ("mlp", layout.mlp)):
            if op in selection.ops and op not in selection.not_dumped:
                sub = get_path(block, path)
                if sub is None:
                    raise ValueError(f"Layer {i} has no {op} sublayer at {path!r} (layout {layout.name!r}).")
                writer.attach(sub, i, op)
        if "residual" in selection.ops:
            writer.attach(block, i, "residual")
    if selection.ends and model.final_norm is not None:
        writer.attach(model.final_norm, int(model.n_layers), "final_norm")


def _record(model: LensModel, ids: torch.Tensor, out_dir: Path, selection: _Selection) -> list[dict]:
    """Run the forward pass with the hooks on; the manifest entries of the files written.

    On error the hooks are removed and the files written so far deleted.
    """
    writer = _DumpWriter(out_dir)
    try:
        _attach_hooks(writer, model, selection)
        with torch.no_grad():
            model.forward(ids)
    except BaseException:
        writer.remove()
        for entry in writer.entries:
            (out_dir / entry["file"]).unlink(missing_ok=True)
        raise
    finally:
        writer.remove()
    # A parallel-residual block may run its MLP before its attention: steps are in the order run.
    return writer.entries


def _run_settings(model: LensModel, ids: torch.Tensor, text: str | None, selection: _Selection, n_files: int,
                  extra_settings: dict[str, Any] | None) -> dict[str, Any]:
    """The contents of ``run.json``."""
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": {"name": model.name, "layout": model.layout.name, "class": type(model.hf_model).__name__,
                  "n_layers": int(model.n_layers), "d_model": int(model.d_model), "fingerprint": model.fingerprint()},
        "dtype": str(model.dtype).replace("torch.", ""),
        "device": str(model.device),
        "versions": _versions(),
        "platform": {"system": platform.system(), "machine": platform.machine(), "byteorder": sys.byteorder},
        "token_ids": [int(x) for x in ids[0].tolist()],
        "n_tokens": int(ids.shape[1]),
        "text": text,
        "ops": list(selection.ops), "ends": bool(selection.ends), "layers": selection.layers,
        "not_dumped": selection.not_dumped,
        "n_files": n_files,
        "extra": extra_settings or {},
    }


def dump_hidden_states(model: LensModel, text_or_ids: str | Sequence[int] | Int[torch.Tensor, "*shape"],
                       out_dir: str | Path, *,
                       ops: str | Iterable[str] = ("residual",), layers: Iterable[int] | None = None,
                       ends: bool = True, max_length: int | None = None,
                       extra_settings: dict[str, Any] | None = None, overwrite: bool = False) -> Path:
    """Run one forward pass and write the selected hidden states to ``out_dir`` (format: module docstring).

    Args:
        model: an :class:`~jlens_core.models.model.HFLensModel` (needs ``layers``, ``layout``, ``encode``,
            ``forward``, ``name``, ``fingerprint()``, ``device``, ``dtype``, ``n_layers``, ``d_model``).
        text_or_ids: the prompt text (tokenized with ``model.encode``) or token ids ``[seq]`` /
            ``[1, seq]``.
        out_dir: the dump folder; created if missing. It must be new or empty, or hold an earlier
            dump and ``overwrite=True`` (then only that dump's files are replaced).
        ops: per-layer ops among ``"residual"``, ``"attn"``, ``"mlp"`` (or ``"all"``); ``attn`` /
            ``mlp`` are skipped, with a log message, where the layout does not name them.
        layers: decoder-layer indices (negatives count from the end); ``None`` = every layer.
        ends: also record ``embed`` (first step) and ``final_norm`` (last step, if the model has one).
        max_length: truncate the prompt to this many tokens.
        extra_settings: JSON-serialisable settings to keep in ``run.json`` under ``"extra"`` (e.g.
            the model spec and CLI options used).
        overwrite: replace an earlier dump in ``out_dir``.

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: an unknown op, a layer out of range, empty or bad token ids, a non-empty
            ``out_dir`` without ``overwrite``, or ``extra_settings`` that JSON cannot hold.
    """
    out_dir = Path(out_dir)
    op_list = parse_ops(ops)
    layer_list = normalise_layers(layers, int(model.n_layers))
    _check_extra_settings(extra_settings)
    ids, text = _token_ids(model, text_or_ids, max_length)
    selection = _Selection(ops=op_list, layers=layer_list, ends=ends,
                           not_dumped=_not_dumped(model, op_list, layer_list, ends))
    _prepare_out_dir(out_dir, overwrite)
    entries = _record(model, ids, out_dir, selection)
    atomic_write_text(out_dir / MANIFEST, "".join(json.dumps(entry) + "\n" for entry in entries), shared=True)
    run = _run_settings(model, ids, text, selection, len(entries), extra_settings)
    atomic_write_text(out_dir / RUN_FILE, json.dumps(run, indent=1), shared=True)
    log.info("Dumped %d tensors of %d tokens to %s.", len(entries), run["n_tokens"], out_dir)
    return out_dir


# -- reading -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class DumpEntry:
    """One tensor of a dump (a manifest line)."""

    step: int
    layer: int
    op: str
    shape: tuple[int, ...]
    bytes: int
    file: str
    sha256: str
    source_dtype: str = "float32"

    @property
    def key(self) -> tuple[int, str]:
        return (self.layer, self.op)


@dataclass
class Dump:
    """A dump read back by :func:`load_dump`.

    Attributes:
        path: the dump folder.
        run: the contents of ``run.json`` (settings of the run).
        entries: the manifest, in step order.
    """

    path: Path
    run: dict
    entries: list[DumpEntry] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return list(self.run.get("token_ids", []))

    @property
    def keys(self) -> list[tuple[int, str]]:
        """``(layer, op)`` of every tensor, in step order."""
        return [e.key for e in self.entries]

    def entry(self, layer: int, op: str) -> DumpEntry:
        """The manifest entry of ``(layer, op)``.

        Raises:
            KeyError: the dump has no such tensor (the message lists what it has).
        """
        for e in self.entries:
            if e.layer == layer and e.op == op:
                return e
        ops = sorted({e.op for e in self.entries})
        layers = sorted({e.layer for e in self.entries})
        raise KeyError(f"Dump {str(self.path)!r} has no tensor for layer {layer} op {op!r} "
                       f"(it has ops {ops} at layers {layers}).")

    def array(self, layer: int, op: str) -> np.ndarray:
        """The tensor of ``(layer, op)`` as a float32 array ``[seq, width]`` (read from disk)."""
        e = self.entry(layer, op)
        return np.fromfile(self.path / e.file, dtype="<f4").reshape(e.shape)

    def table(self):
        """The manifest as a pandas DataFrame (step, layer, op, shape, bytes, file, sha256)."""
        import pandas as pd

        return pd.DataFrame([{"step": e.step, "layer": e.layer, "op": e.op, "shape": list(e.shape),
                              "source_dtype": e.source_dtype, "bytes": e.bytes, "file": e.file,
                              "sha256": e.sha256} for e in self.entries])

    def describe(self) -> str:
        """One line: model, dtype, device, token count."""
        model = self.run.get("model", {})
        return (f"{model.get('name', '?')} {self.run.get('dtype', '?')} on {self.run.get('device', '?')}, "
                f"{self.run.get('n_tokens', '?')} tokens, {len(self.entries)} tensors")


def _read_run(path: Path) -> dict:
    """The dump folder's ``run.json``, checked to be a jlens dump this version reads.

    Raises:
        FileNotFoundError: the folder does not exist.
        ValueError: ``run.json`` or the manifest missing, ``run.json`` unreadable, not a dump, too new.
    """
    if not path.is_dir():
        raise FileNotFoundError(f"Dump folder {str(path)!r} does not exist (make one with `jlens dump`).")
    run_path, manifest_path = path / RUN_FILE, path / MANIFEST
    if not run_path.is_file() or not manifest_path.is_file():
        lacking = " and ".join(p.name for p in (run_path, manifest_path) if not p.is_file())
        raise ValueError(f"{str(path)!r} is not a complete jlens dump: {lacking} is missing "
                         "(the dump was interrupted, or this is another folder).")
    try:
        run = json.loads(run_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{str(run_path)!r} is not valid JSON ({exc}): the dump is damaged; make it again.") from exc
    if not isinstance(run, dict) or run.get("format") != FORMAT:
        raise ValueError(f"{str(run_path)!r} is not the settings file of a jlens dump (no format {FORMAT!r}).")
    if int(run.get("format_version", 0)) > FORMAT_VERSION:
        raise ValueError(f"Dump {str(path)!r} has format version {run.get('format_version')}, newer than this "
                         f"jlens reads ({FORMAT_VERSION}): upgrade jlens.")
    return run


def _parse_manifest_line(line: str, lineno: int, manifest_path: Path) -> DumpEntry:
    """One manifest line as a :class:`DumpEntry`.

    Raises:
        ValueError: not JSON, a key missing, a bad value, a dtype other than float32, a file name with a folder.
    """
    try:
        raw = json.loads(line)
        missing_keys = [k for k in _MANIFEST_KEYS if k not in raw]
        if missing_keys:
            raise ValueError(f"missing {missing_keys}")
        entry = DumpEntry(step=int(raw["step"]), layer=int(raw["layer"]), op=str(raw["op"]),
                          shape=tuple(int(s) for s in raw["shape"]), bytes=int(raw["bytes"]),
                          file=str(raw["file"]), sha256=str(raw["sha256"]),
                          source_dtype=str(raw.get("source_dtype", "float32")))
    except (json.JSONDecodeError, ValueError, TypeError) as exc:
        raise ValueError(f"{str(manifest_path)!r} line {lineno} is not a valid manifest entry ({exc}): "
                         "the manifest is truncated or damaged; make the dump again.") from exc
    if raw["dtype"] != "float32":
        raise ValueError(f"{str(manifest_path)!r} line {lineno}: dtype {raw['dtype']!r} is not float32.")
    if Path(entry.file).name != entry.file:
        raise ValueError(f"{str(manifest_path)!r} line {lineno}: file {entry.file!r} is not a plain file name.")
    return entry


def _read_manifest(manifest_path: Path) -> list[DumpEntry]:
    """The entries of ``manifest.jsonl``, blank lines skipped."""
    with open(manifest_path, encoding="utf-8") as fh:
        return [_parse_manifest_line(line, lineno, manifest_path)
                for lineno, line in enumerate(fh, start=1) if line.strip()]


def _check_manifest(entries: list[DumpEntry], run: dict, path: Path, manifest_path: Path) -> None:
    """Raise ValueError when the manifest disagrees with ``run.json``'s file count, is empty, has steps out
    of order or lists a ``(layer, op)`` twice."""
    expected = run.get("n_files")
    if expected is not None and int(expected) != len(entries):
        raise ValueError(f"{str(manifest_path)!r} lists {len(entries)} files but run.json says {expected}: "
                         "the manifest is truncated; make the dump again.")
    if not entries:
        raise ValueError(f"Dump {str(path)!r} holds no tensors.")
    steps = [e.step for e in entries]
    if steps != sorted(steps) or len(set(steps)) != len(steps):
        raise ValueError(f"{str(manifest_path)!r}: steps are not strictly increasing; the manifest is damaged.")
    if len({e.key for e in entries}) != len(entries):
        raise ValueError(f"{str(manifest_path)!r} lists a (layer, op) twice; the manifest is damaged.")


def _file_sha256(fpath: Path) -> str:
    """The hex sha256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(fpath, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _check_data_file(path: Path, e: DumpEntry, check_hashes: bool) -> None:
    """Raise ValueError when an entry's file is missing, or its size (or sha256) differs from the manifest."""
    fpath = path / e.file
    if not fpath.is_file():
        raise ValueError(f"Dump file {str(fpath)!r} (layer {e.layer} op {e.op!r}) is missing.")
    size = fpath.stat().st_size
    want = 4 * int(np.prod(e.shape, dtype=np.int64))
    if e.bytes != want:
        raise ValueError(f"Manifest entry for {e.file!r} says {e.bytes} bytes, but shape {list(e.shape)} "
                         f"of float32 is {want}: the manifest is damaged.")
    if size != e.bytes:
        what = "truncated" if size < e.bytes else "longer than recorded"
        raise ValueError(f"Dump file {str(fpath)!r} is {size} bytes, the manifest says {e.bytes}: "
                         f"the file is {what}; make the dump again.")
    if check_hashes and _file_sha256(fpath) != e.sha256:
        raise ValueError(f"Dump file {str(fpath)!r} does not match its sha256 in the manifest: "
                         "it was altered or damaged after the dump; make the dump again.")


def load_dump(path: str | Path, *, check_hashes: bool = True) -> Dump:
    """Read a dump's ``run.json`` and ``manifest.jsonl`` and check every file against the manifest.

    Args:
        path: the dump folder written by :func:`dump_hidden_states`.
        check_hashes: also recompute each file's sha256 (reads every byte once).

    Returns:
        A :class:`Dump`; arrays are read on demand with :meth:`Dump.array`.

    Raises:
        FileNotFoundError: the folder does not exist.
        ValueError: not a dump, an unreadable or truncated manifest, a missing data file, a file
            whose size or sha256 differs from the manifest; the message names the file.
    """
    path = Path(path)
    run = _read_run(path)
    manifest_path = path / MANIFEST
    entries = _read_manifest(manifest_path)
    _check_manifest(entries, run, path, manifest_path)
    for e in entries:
        _check_data_file(path, e, check_hashes)
    return Dump(path=path, run=run, entries=entries)
