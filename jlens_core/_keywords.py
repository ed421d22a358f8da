"""Typed ``**options``: a call's rarer keywords as one ``TypedDict`` (``**options: Unpack[...]``), checked at run time
the way Python checks a named parameter, so that a signature stays short and an old keyword call keeps working."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def checked_options(function: str, options: Mapping[str, Any], allowed: type) -> dict[str, Any]:
    """``options`` as a dict, after checking every key is one of the ``TypedDict`` ``allowed``'s keys.

    Raises:
        TypeError: a key ``allowed`` does not name (Python's own message for an unexpected keyword argument).
    """
    names = set(getattr(allowed, "__required_keys__", ())) | set(getattr(allowed, "__optional_keys__", ()))
    unknown = [key for key in options if key not in names]
    if unknown:
        raise TypeError(f"{function}() got an unexpected keyword argument {unknown[0]!r}")
    return dict(options)


def options_value(function: str, value: T | None, default: type[T], keywords: Mapping[str, Any], allowed: type) -> T:
    """``value`` (a frozen dataclass of options; ``default()`` when ``None``) with the fields ``keywords`` names
    replaced: the old keyword-by-keyword spelling of the same options wins over the value's fields.

    Raises:
        TypeError: a key ``allowed`` (a ``TypedDict`` of the dataclass's fields) does not name, or a ``value`` that is
            not a ``default``.
    """
    if value is not None and not isinstance(value, default):
        raise TypeError(f"{function}() takes a {default.__name__} as its options, not {type(value).__name__}: build "
                        f"one with {default.__name__}(...) or give its fields as keywords.")
    chosen = default() if value is None else value
    changes = checked_options(function, keywords, allowed)
    return dataclasses.replace(chosen, **changes) if changes else chosen  # type: ignore[type-var]


__all__ = ["checked_options", "options_value"]
