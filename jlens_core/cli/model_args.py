"""The model options every model-loading command takes: ``--model``, ``--device``, ``--dtype`` and the
placement of a model larger than one device, ``--device-map``, ``--max-memory``, ``--offload-folder``
(docs/models.md, "Sharded and offloaded models"), read by :func:`model_loading_options`; and ``--save-dtype``,
which every command that writes a lens takes; and the corpus options of the commands that read a corpus
(``--corpus``, ``--split``, ``--n-texts``, ``--min-chars``: :func:`add_corpus_arguments`). :func:`add_model_command`
registers a model-loading subcommand with the model options added."""

from __future__ import annotations

import argparse

MODEL_HELP = "'smollm2-135m' (embedded default), a Hugging Face id, a local folder or a .gguf file"
DEVICE_HELP = "cuda, cuda:1, mps, cpu (default: best available)"
DTYPE_HELP = "float32, bfloat16, float16 (default fp32 on CPU, bf16 on GPU)"
DEVICE_MAP_HELP = ("spread a large model over devices: auto (or balanced, balanced_low_0, sequential), or a JSON "
                   "object of module names to devices, e.g. '{\"model.layers.0\": \"cuda:0\", \"lm_head\": \"disk\"}'")
MAX_MEMORY_HELP = "memory per device for --device-map auto, e.g. 0:20GiB,cpu:64GiB (implies --device-map auto)"
# the forms every --lens of eval, inspect and intervene takes (jlens_core.lenses.shipped.load_lens and the
# 'default' / 'tuned' / 'logit' names)
LENS_HELP = ("'default' (the model's shipped Jacobian lens), 'tuned' (its shipped tuned lens), 'logit', a shipped "
             "variant as <model>:<variant> (e.g. smollm2-135m:relevance, smollm2-135m:jpp, smollm2-135m:rpp), a lens "
             "file (Jacobian, expert, combined J++/R++ or tuned), a tuned-lens folder, or "
             "hf://owner/repo[@revision]/path from the Hugging Face Hub")
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


def add_model_command(subparsers, name: str, *, help: str, description: str,
                      device_help: str = DEVICE_HELP) -> argparse.ArgumentParser:
    """Register the subcommand ``name`` of a command that loads a model: its parser (``help`` in the list of
    commands, ``description`` on top of its ``--help``) with the model options of :func:`add_model_arguments`
    (``--device`` explained by ``device_help``) already added. Returns the parser, for the command's own options."""
    parser = subparsers.add_parser(name, help=help, description=description)
    add_model_arguments(parser, device_help=device_help)
    return parser


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


def add_edit_layers_argument(parser: argparse.ArgumentParser, *, verb: str, example: str) -> None:
    """Add ``--layers`` of a command that edits along a lens's read directions (``intervene``, ``say``): a Python
    slice of the layers to ``verb`` (e.g. ``example``), by default ``n_layers//3`` .. the lens's last source."""
    parser.add_argument("--layers", default=None,
                        help=f"layers to {verb}, e.g. '{example}' (Python slice); default n_layers//3 .. the lens's "
                             "last source")


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
