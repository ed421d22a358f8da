"""The placement settings of a model too large for one device: ``device_map``, ``max_memory`` and the
offload folder, parsed from text (the command line, the app) and checked before any weight is read.

Each bad setting is one sentence naming the value, why it cannot work and what to give instead
(docs/models.md, "Sharded and offloaded models"). The model is placed by transformers and accelerate
(``from_pretrained(device_map=..., max_memory=..., offload_folder=...)``); what runs where afterwards
is :mod:`jlens_core.models.placement`'s business.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

# accelerate's placement strategies (``device_map="auto"`` and its variants)
STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")

DeviceMap = str | dict[str, str | int]
MaxMemory = dict[str | int, int | str]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class PlacementError(ValueError):
    """A ``device_map``, ``max_memory`` or offload folder that cannot work here; one sentence."""


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it at least 1 (``1.5 GiB``)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def parse_size(text: str | int, *, what: str) -> int:
    """Bytes from ``20GiB``, ``500MB``, ``1.5GiB`` or a plain number of bytes.

    Raises:
        PlacementError: not a size (``what`` names the setting in the sentence).
    """
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = _SIZE.match(str(text))
    if match is None:
        raise PlacementError(f"{what} {text!r} is not a memory size: write it as a number of bytes or with a "
                             "unit, such as 20GiB, 500MiB or 64GB.")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").lower()])


def _device_reason(device: torch.device) -> str | None:
    """Why ``device`` does not exist on this machine (``None`` when it does)."""
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            return "this machine has no CUDA device"
        index = 0 if device.index is None else device.index
        if index >= count:
            return f"this machine has {count} CUDA device{'s' if count > 1 else ''} (cuda:0..cuda:{count - 1})"
        return None
    if device.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        return None if mps is not None and mps.is_available() else "MPS (Apple silicon) is not available here"
    module = getattr(torch, device.type, None)
    is_available = getattr(module, "is_available", None)
    if callable(is_available) and is_available():
        return None
    return f"torch has no {device.type} device available here"


def check_device(device: str | int, *, what: str = "Device", where: str = "") -> str | int:
    """``device`` unchanged when it exists here (``disk`` counts, for a device map's offloaded modules).
    ``what`` and ``where`` name the setting in the sentence (``device_map's device``, `` for 'lm_head'``).

    Raises:
        PlacementError: a device that does not exist or is not a device name.
    """
    if device == "disk":
        return device
    name = f"cuda:{device}" if isinstance(device, int) else device  # a bare index is a CUDA device
    try:
        parsed = torch.device(name)
    except (RuntimeError, TypeError):
        raise PlacementError(f"{what} {name!r}{where} is not a device: use cpu, cuda, cuda:N, mps or disk.") from None
    reason = _device_reason(parsed)
    if reason is not None:
        raise PlacementError(f"{what} {name!r}{where} does not exist: {reason}; use cpu, disk or a "
                             "device that exists here.")
    return device


def parse_device_map(value: str | Mapping[str, Any] | None) -> DeviceMap | None:
    """A ``device_map`` from a strategy name (``auto``, ``balanced``, ``balanced_low_0``, ``sequential``), a
    JSON object of module names to devices (``'{"model.layers.0": "cuda:0", "lm_head": "cpu"}'``), or such
    a mapping; ``None`` for none. Every device must exist here (:func:`check_device`).

    Raises:
        PlacementError: neither a strategy nor a mapping, or a device that does not exist.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        text = value.strip()
        if text in STRATEGIES:
            return text
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, dict) or not value:
            raise PlacementError(f"device_map {text!r} is neither a strategy ({', '.join(STRATEGIES)}) nor a JSON "
                                 "object of module names to devices, such as "
                                 "'{\"model.layers.0\": \"cpu\", \"model.layers.1\": \"disk\"}'.")
    mapping: dict[str, str | int] = {}
    for module, device in value.items():
        if not isinstance(device, (str, int)) or isinstance(device, bool):
            raise PlacementError(f"device_map gives {module!r} the device {device!r}: use a name such as "
                                 "cpu, cuda:0, mps or disk, or a GPU index.")
        mapping[str(module)] = check_device(device, what="device_map's device", where=f" for {module!r}")
    return mapping


def parse_max_memory(value: str | Mapping[Any, Any] | None) -> MaxMemory | None:
    """A ``max_memory`` from ``0:20GiB,cpu:64GiB`` (GPU index or device name, a colon, a size) or a mapping;
    ``None`` for none. ``cuda:N`` keys become the index ``N`` accelerate expects.

    Raises:
        PlacementError: an entry without a device and a size, a size that is not one, or a device that
            does not exist here.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        entries: list[tuple[Any, Any]] = []
        for part in value.split(","):
            device, sep, size = part.strip().rpartition(":")
            if not sep or not device or not size:
                raise PlacementError(f"max_memory entry {part.strip()!r} is not DEVICE:SIZE: write entries such as "
                                     "0:20GiB,cpu:64GiB (a GPU index or cpu / mps, a colon, a size).")
            entries.append((device, size))
    else:
        entries = list(value.items())
    budget: MaxMemory = {}
    for device, size in entries:
        key: str | int = device
        if isinstance(device, str):
            name = device.strip()
            key = int(name) if name.isdigit() else (int(name[5:]) if re.fullmatch(r"cuda:\d+", name) else name)
        check_device(key, what="max_memory's device")
        budget[key] = parse_size(size, what=f"max_memory's size for {key}")
    return budget


def check_offload_folder(folder: str | Path) -> str:
    """``folder`` as a string, created if missing, once a file can be written in it.

    Raises:
        PlacementError: the folder cannot be created or written.
    """
    path = Path(folder).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".jlens-write-test-"):
            pass
    except OSError as exc:
        raise PlacementError(f"The offload folder {str(folder)!r} cannot be written ({exc.strerror or exc}): "
                             "choose a folder you can write to, with room for the offloaded weights.") from None
    return str(path)


def largest_layer_bytes(hf_model: torch.nn.Module, dtype: torch.dtype) -> int:
    """The bytes of the largest decoder layer of ``hf_model`` (weights may be meta tensors) in ``dtype``."""
    from .layouts import find_layout, get_path

    layers = get_path(hf_model, find_layout(hf_model).layers) or []
    itemsize = torch.tensor([], dtype=dtype).element_size()
    return max((sum(p.numel() for p in layer.parameters()) * itemsize for layer in layers), default=0)


def check_budget(max_memory: MaxMemory, layer_bytes: int, *, model: str, dtype: torch.dtype) -> None:
    """Every device given a (non-zero) budget must hold at least one decoder layer: accelerate never splits
    a layer, so a smaller budget leaves that device unused.

    Raises:
        PlacementError: the first device whose budget is below one layer, with what a layer needs.
    """
    for device, size in max_memory.items():
        budget = parse_size(size, what="max_memory's size")
        if device != "disk" and 0 < budget < layer_bytes:
            name = f"cuda:{device}" if isinstance(device, int) else device
            raise PlacementError(f"max_memory gives {name} {format_bytes(budget)}, less than one decoder layer of "
                                 f"{model!r} needs ({format_bytes(layer_bytes)} in {str(dtype).removeprefix('torch.')}): "
                                 "give it at least that, or leave it out.")
