"""Arrays and values inside a JSON document: what a reading file (docs/method.md §6.1) is made of.

An array is ``{"dtype": "int32", "shape": [2, 3], "base64": "..."}``: its little-endian bytes in C
order, base64-encoded; any tool reads it with ``numpy.frombuffer(base64.b64decode(data), dtype="<i4")``.
Numbers are stored as they are (exact): integers that fit in 32 bits are narrowed to ``int32`` on
the way out, and :func:`decode_array` widens them back to the dtype the caller asks for.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

# the dtypes an array in the file may have (numpy names; stored little-endian)
STORED_DTYPES = ("bool", "int32", "int64", "float16", "float32", "float64")
_INT32 = np.iinfo(np.int32)


class ArrayFieldError(ValueError):
    """An array field that is not one :func:`encode_array` writes (the message names the field)."""


def encode_array(values: Any) -> dict[str, Any]:
    """``{"dtype", "shape", "base64"}`` of ``values`` (an ``int64`` array whose values fit is stored as ``int32``)."""
    array = np.ascontiguousarray(values)
    if array.dtype.kind in "iu":
        fits = not array.size or (int(array.min()) >= _INT32.min and int(array.max()) <= _INT32.max)
        array = array.astype(np.int32 if fits else np.int64)
    elif array.dtype.kind == "f" and array.dtype.name not in STORED_DTYPES:
        array = array.astype(np.float64)
    if array.dtype.name not in STORED_DTYPES:
        raise TypeError(f"Cannot store an array of dtype {array.dtype} in a reading file.")
    data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes(order="C")
    return {"dtype": array.dtype.name, "shape": list(array.shape), "base64": base64.b64encode(data).decode("ascii")}


def decode_array(field: Any, where: str, dtype: Any = None) -> np.ndarray:
    """The array :func:`encode_array` wrote (a fresh writable copy), cast to ``dtype`` when given.

    Args:
        field: the JSON object.
        where: the field's path in the document, for the message.
        dtype: the dtype to return (default: the stored one).

    Raises:
        ArrayFieldError: not such an object, an unknown dtype, or bytes that do not fill the shape.
    """
    if not isinstance(field, Mapping) or not {"dtype", "shape", "base64"} <= set(field):
        raise ArrayFieldError(f"{where!r} is not an array (an object with dtype, shape and base64)")
    stored = field["dtype"]
    if stored not in STORED_DTYPES:
        raise ArrayFieldError(f"{where!r} has the dtype {stored!r}, not one of {', '.join(STORED_DTYPES)}")
    shape = field["shape"]
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ArrayFieldError(f"{where!r} has the shape {shape!r}, not a list of sizes")
    try:
        data = base64.b64decode(str(field["base64"]), validate=True)
    except ValueError:
        raise ArrayFieldError(f"{where!r} holds bytes that are not base64") from None
    little = np.dtype(stored).newbyteorder("<")
    if len(data) != little.itemsize * math.prod(shape):
        raise ArrayFieldError(f"{where!r} holds {len(data)} bytes, not the {little.itemsize * math.prod(shape)} "
                              f"its shape {shape} and dtype {stored} take")
    array = np.frombuffer(data, dtype=little).reshape(shape).astype(np.dtype(stored))  # native order, a copy
    return array if dtype is None else array.astype(dtype)


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON values: numpy scalars and arrays to numbers and lists, paths to strings,
    tuples to lists, non-finite floats to ``None`` (strict JSON has no NaN), anything else to its ``str``."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(float(value)) else None
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [jsonable(v) for v in (value.tolist() if isinstance(value, np.ndarray) else value)]
    if isinstance(value, Path):
        return str(value)
    return str(value)


__all__ = ["STORED_DTYPES", "ArrayFieldError", "decode_array", "encode_array", "jsonable"]
