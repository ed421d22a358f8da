"""Reading a prompt through a lens (docs/method.md §6): the names of the reading modules, in one place.

The code lives in the modules named after what they hold; this module re-exports their public
names so ``from jlens_core.reading.readings import read_prompt`` (and the rest) keeps working:

* :mod:`~jlens_core.reading.inputs`: lenses, readable layers, positions, prompt ids, residuals;
* :mod:`~jlens_core.reading.logit_stats`: entropy, KL, CE and rank kernels over logits;
* :mod:`~jlens_core.reading.prompt_reading`: :class:`PromptReading`, the result;
* :mod:`~jlens_core.reading.openmp_workers`: the per-thread OpenMP pool;
* :mod:`~jlens_core.reading.reader`: :func:`read_prompt` and :func:`read_prompts`;
* :mod:`~jlens_core.reading.summaries`: most common tokens, comparing two readings.

The size settings are not re-exported: ``CHUNK_ELEMENTS`` and ``STATS_BLOCK_ELEMENTS`` live in
:mod:`~jlens_core.reading.logit_stats` and ``MAX_READING_WORKERS`` in
:mod:`~jlens_core.reading.openmp_workers`, read there at call time, so a copy here could be changed
without effect.
"""

from __future__ import annotations

import importlib
from typing import Any

# defining module -> the public names this module re-exports from it (imported on first use)
_SOURCES = {
    "inputs": ("as_lens_dict", "check_lens", "encode_prompt", "model_vocab_size", "readable_layers",
               "record_residuals", "resolve_positions"),
    "logit_stats": ("LN2", "centred_logit_stats", "chunk_size", "final_distribution", "rank_of", "row_sums"),
    "openmp_workers": ("reading_workers", "run_in_workers"),
    "prompt_reading": ("FRAME_COLUMNS", "GRID_STATS", "PromptReading"),
    "reader": ("read_prompt", "read_prompts"),
    "summaries": ("COMPARE_STATS", "MOST_COMMON_COLUMNS", "band_layers", "compare_readings", "difference",
                  "most_common_tokens"),
}
_MODULE_OF = {name: module for module, names in _SOURCES.items() for name in names}

__all__ = sorted(_MODULE_OF)  # noqa: PLE0605 - one list of names, in _SOURCES


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __package__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))
