"""Item sets of the intervention experiments (swap, say): a shipped name or a ``.jsonl`` / ``.json`` file of items,
each a JSON object with the fields the experiment needs."""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from pathlib import Path

from .._paths import ASSETS_DIR


def load_item_set(spec: str | Path, *, shipped: Collection[str], fields: Sequence[str], what: str) -> list[dict]:
    """The items of ``spec``: a name in ``shipped`` (``assets/evaluations/<name>.jsonl``) or a ``.jsonl`` file (one
    item a line) or ``.json`` file (a list, or ``{"items": [...]}``); ``what`` names the set in errors ("swap set").

    Raises:
        FileNotFoundError: no such set or file.
        ValueError: a file with no items, or an item without one of ``fields`` (names the item).
    """
    path = Path(spec)
    if str(spec) in shipped:
        path = ASSETS_DIR / "evaluations" / f"{spec}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"No {what} {str(spec)!r}: give a shipped set ({', '.join(shipped)}) or a .jsonl / "
                                ".json file of items with " + ", ".join(fields) + ".")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        data = json.loads(text)
        items = data.get("items") if isinstance(data, dict) else data
    else:
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not items:
        raise ValueError(f"{str(path)!r} holds no items.")
    for i, item in enumerate(items):
        missing = [k for k in fields if not isinstance(item, dict) or not str(item.get(k) or "").strip()]
        if missing:
            name = item.get("name", f"#{i}") if isinstance(item, dict) else f"#{i}"
            raise ValueError(f"Item {name} of {str(path)!r} has no {', '.join(missing)}: every item needs "
                             + ", ".join(fields) + ".")
    return items


__all__ = ["load_item_set"]
