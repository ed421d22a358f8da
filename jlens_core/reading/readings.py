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

from .inputs import (
    as_lens_dict,
    check_lens,
    encode_prompt,
    model_vocab_size,
    readable_layers,
    record_residuals,
    resolve_positions,
)
from .logit_stats import (
    LN2,
    centred_logit_stats,
    chunk_size,
    final_distribution,
    rank_of,
    row_sums,
)
from .openmp_workers import reading_workers, run_in_workers
from .prompt_reading import FRAME_COLUMNS, GRID_STATS, PromptReading
from .reader import read_prompt, read_prompts
from .summaries import (
    COMPARE_STATS,
    MOST_COMMON_COLUMNS,
    band_layers,
    compare_readings,
    difference,
    most_common_tokens,
)

__all__ = [
    "COMPARE_STATS",
    "FRAME_COLUMNS",
    "GRID_STATS",
    "LN2",
    "MOST_COMMON_COLUMNS",
    "PromptReading",
    "as_lens_dict",
    "band_layers",
    "centred_logit_stats",
    "check_lens",
    "chunk_size",
    "compare_readings",
    "difference",
    "encode_prompt",
    "final_distribution",
    "model_vocab_size",
    "most_common_tokens",
    "rank_of",
    "read_prompt",
    "read_prompts",
    "readable_layers",
    "reading_workers",
    "record_residuals",
    "resolve_positions",
    "row_sums",
    "run_in_workers",
]
