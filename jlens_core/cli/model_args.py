"""The model options every model-loading command takes: ``--model``, ``--device``, ``--dtype``."""

from __future__ import annotations

import argparse

MODEL_HELP = "'smollm2-135m' (embedded default), a Hugging Face id, a local folder or a .gguf file"
DEVICE_HELP = "cuda, cuda:1, mps, cpu (default: best available)"
DTYPE_HELP = "float32, bfloat16, float16 (default fp32 on CPU, bf16 on GPU)"


def add_model_arguments(parser: argparse.ArgumentParser, *, device_help: str = DEVICE_HELP) -> None:
    """Add ``--model`` (default the embedded model), ``--device`` and ``--dtype`` to ``parser``."""
    parser.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    parser.add_argument("--device", default=None, help=device_help)
    parser.add_argument("--dtype", default=None, help=DTYPE_HELP)
