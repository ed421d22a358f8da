"""The model options every model-loading command takes: ``--model``, ``--device``, ``--dtype`` and the
placement of a model larger than one device, ``--device-map``, ``--max-memory``, ``--offload-folder``
(docs/models.md, "Sharded and offloaded models"), read by :func:`model_loading_options`; and ``--save-dtype``,
which every command that writes a lens takes; and the corpus options of the commands that read a corpus
(``--corpus``, ``--split``, ``--n-texts``, ``--min-chars``: :func:`add_corpus_arguments`)."""

from __future__ import annotations

import argparse

MODEL_HELP = "'smollm2-135m' (embedded default), a Hugging Face id, a local folder or a .gguf file"
DEVICE_HELP = "cuda, cuda:1, mps, cpu (default: best available)"
DTYPE_HELP = "float32, bfloat16, float16 (default fp32 on CPU, bf16 on GPU)"
DEVICE_MAP_HELP = ("spread a large model over devices: auto (or balanced, balanced_low_0, sequential), or a JSON "
                   "object of module names to devices, e.g. '{\"model.layers.0\": \"cuda:0\", \"lm_head\": \"disk\"}'")
MAX_MEMORY_HELP = "memory per device for --device-map auto, e.g. 0:20GiB,cpu:64GiB (implies --device-map auto)"
OFFLOAD_FOLDER_HELP = "folder for weights offloaded to disk (implies --device-map auto unless one is given)"
CORPUS_HELP = "'stdlib-docs' (built-in), a .txt (paragraphs) or .jsonl (text field) file, or a HF dataset"
SPLITS = ("all", "fit", "eval")


def add_model_arguments(parser: argparse.ArgumentParser, *, device_help: str = DEVICE_HELP,
                        model_help: str = MODEL_HELP, model_default: str | None = "smollm2-135m") -> None:
    """Add ``--model`` (default the embedded model), ``--device``, ``--dtype``, ``--device-map``,
    ``--max-memory`` and ``--offload-folder`` to ``parser``."""
    parser.add_argument("--model", default=model_default, help=model_help)
    parser.add_argument("--device", default=None, help=device_help)
    parser.add_argument("--dtype", default=None, help=DTYPE_HELP)
    add_placement_arguments(parser)


def add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--device-map``, ``--max-memory`` and ``--offload-folder`` to ``parser``."""
    parser.add_argument("--device-map", default=None, metavar="auto|JSON", help=DEVICE_MAP_HELP)
    parser.add_argument("--max-memory", default=None, metavar="DEV:SIZE,...", help=MAX_MEMORY_HELP)
    parser.add_argument("--offload-folder", default=None, metavar="DIR", help=OFFLOAD_FOLDER_HELP)


def add_save_dtype_argument(parser: argparse.ArgumentParser, help: str) -> None:
    """Add ``--save-dtype`` (``float32``, the default, or ``float16``): the storage of the lens files written."""
    parser.add_argument("--save-dtype", choices=["float32", "float16"], default="float32", help=help)


def add_corpus_arguments(parser: argparse.ArgumentParser, *, split: str, split_help: str, n_texts: int | None = None,
                         n_texts_help: str = "", min_chars: int = 400) -> None:
    """Add ``--corpus`` (default ``stdlib-docs``), ``--split`` (default ``split``), ``--min-chars`` and, when
    ``n_texts`` is given, ``--n-texts`` (its default; ``n_texts_help`` says what they are for)."""
    parser.add_argument("--corpus", default="stdlib-docs", help=CORPUS_HELP)
    parser.add_argument("--split", choices=list(SPLITS), default=split, help=split_help)
    if n_texts is not None:
        parser.add_argument("--n-texts", type=int, default=n_texts, help=n_texts_help)
    parser.add_argument("--min-chars", type=int, default=min_chars,
                        help=f"skip corpus texts shorter than this (default {min_chars})")


def placement_requested(args: argparse.Namespace) -> bool:
    """Whether the command line spreads the model (``--device-map``, ``--max-memory``, ``--offload-folder``)."""
    return any(getattr(args, name, None) for name in ("device_map", "max_memory", "offload_folder"))


def model_loading_options(args: argparse.Namespace) -> dict:
    """The keyword arguments of :func:`~jlens_core.models.loading.load_model` from the model options: the
    device, the dtype and the placement, parsed and checked (a bad one is a one-sentence ``ValueError``).
    """
    from ..models.loading import placement_settings

    options = {"device": getattr(args, "device", None), "dtype": getattr(args, "dtype", None),
               "device_map": getattr(args, "device_map", None), "max_memory": getattr(args, "max_memory", None),
               "offload_folder": getattr(args, "offload_folder", None)}
    placement_settings(device=options["device"], device_map=options["device_map"], max_memory=options["max_memory"],
                       offload_folder=options["offload_folder"])  # raises on a bad setting, before any loading
    return options
