"""A reading's grid as data for other tools: one record per lens x layer x position (docs/method.md §6).

The records are the readings' :attr:`~jlens_core.reading.prompt_reading.PromptReading.frame` rows with
a ``lens`` column first. :func:`grid_json` writes them as a JSON array of objects (strict JSON: a
missing rank or a NaN cross-entropy is ``null``; numbers are Python's shortest exact repr);
:func:`grid_csv` as CSV, the list columns (``top_ids``, ``top_tokens``, ``top_probs``) as JSON text in
their cell and a missing value as an empty cell. ``jlens inspect --format json|csv`` prints them.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Mapping
from typing import Any

import pandas as pd

from .json_arrays import jsonable
from .prompt_reading import PromptReading

LIST_COLUMNS = ("top_ids", "top_tokens", "top_probs")


def grid_table(readings: Mapping[str, PromptReading]) -> pd.DataFrame:
    """The readings' frames stacked, a ``lens`` column (the readings' names) first."""
    frames = [reading.frame.assign(lens=name)[["lens", *reading.frame.columns]] for name, reading in readings.items()]
    return pd.concat(frames, ignore_index=True)


def _plain(value: Any) -> Any:
    """A frame cell as a JSON value: ``<NA>`` and NaN to ``None``, numpy numbers to Python ones."""
    if value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return None
    return jsonable(value)


def grid_records(readings: Mapping[str, PromptReading]) -> list[dict[str, Any]]:
    """One JSON-ready dict per lens x layer x position (the columns of :func:`grid_table`)."""
    table = grid_table(readings)
    return [{column: _plain(value) for column, value in row.items()} for row in table.to_dict(orient="records")]


def grid_json(readings: Mapping[str, PromptReading]) -> str:
    """:func:`grid_records` as a JSON array, one record per line."""
    lines = [json.dumps(record, allow_nan=False) for record in grid_records(readings)]
    return "[\n" + ",\n".join(lines) + "\n]\n"


def grid_csv(readings: Mapping[str, PromptReading]) -> str:
    """:func:`grid_table` as CSV text: list cells as JSON arrays, missing values empty, text fields quoted."""
    table = grid_table(readings)
    for column in LIST_COLUMNS:
        table[column] = [json.dumps(jsonable(cell)) for cell in table[column]]
    buffer = io.StringIO()
    table.to_csv(buffer, index=False, quoting=csv.QUOTE_NONNUMERIC, lineterminator="\n")
    return buffer.getvalue()


__all__ = ["LIST_COLUMNS", "grid_csv", "grid_json", "grid_records", "grid_table"]
