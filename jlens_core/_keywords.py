"""Typed ``**options``: a call's rarer keywords as one ``TypedDict`` (``**options: Unpack[...]``), checked at run time
the way Python checks a named parameter, so that a signature stays short and an old keyword call keeps working."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


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


__all__ = ["checked_options"]
