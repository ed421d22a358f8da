"""The prompt-set formats of the workspace experiments: one JSON file per experiment, read by field name.

The field names are those of the reference jlens's ``data/experiments/*.json`` files, so its own files
load by path (docs/experiments.md lists each format). :func:`detect_format` names the experiment a file
is for from its top-level fields; :func:`load_experiment_items` reads and checks it (every item's fields).
No torch here: the CLI checks a file before the model loads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._paths import ASSETS_DIR

# experiment -> (top-level fields, {list field: the fields each of its entries needs})
FORMATS: dict[str, tuple[tuple[str, ...], dict[str, tuple[str, ...]]]] = {
    "probe-swap": (("items",), {"items": ("name", "category", "prompt", "intermediate", "answer", "swap_to",
                                          "swap_answer")}),
    "verbal-report": (("candidates",), {}),
    "flexible-generalization": (("categories",), {"categories": ("name", "args", "funcs")}),
    "verbal-introspection": (("intro_prompt", "prefills", "concepts"), {"concepts": ("name", "surface")}),
    "directed-modulation": (("phrasings", "group_kind", "carrier_sentences", "math_problems", "topic_categories"),
                            {"phrasings": ("name", "group", "text"), "math_problems": ("expr", "answer", "tier"),
                             "topic_categories": ("name", "members")}),
    "selectivity-language": (("task", "passages", "intermediates", "authors"),
                             {"passages": ("category", "key", "text")}),
    # experiment 7: read and checked, not run in this version (docs/experiments.md)
    "top-down-summoning": (("q1", "items"), {"items": ("key", "stimulus", "q2", "expected", "foil", "q1_expect",
                                                       "swaps")}),
    "selectivity-linecount": (("explicit_q", "conditions", "passages"), {"passages": ("tag", "width", "text")}),
    "capacity": (("block_families", "targets_per_family", "candidate_pools"),
                 {"candidate_pools": ("name", "pool", "proto")}),
    "ignition": (("countries_12", "alt_words", "ctx_templates", "noun_ctx_templates", "idiom_pairs",
                  "scrambled_pairs"), {}),
    "dual-task": (("carrier_sentence", "concept_math_conditions", "concept_concept_conditions", "concept_pairs",
                   "pairs"), {"pairs": ("key", "concept", "concept_words", "base", "exp", "sub")}),
}
# the formats of experiment 7 that load but do not run yet
READ_ONLY = ("top-down-summoning", "selectivity-linecount", "capacity", "ignition", "dual-task")
# the ablation battery scores two-hop items: it reads the probe-swap format
ALIASES = {"ablation-battery": "probe-swap"}
EXPERIMENTS = (*FORMATS, *ALIASES)
BUILT_IN_DIR = ASSETS_DIR / "experiments"


def built_in_sets() -> dict[str, Path]:
    """``{experiment: path}`` of the small example sets shipped in ``assets/experiments/`` (written for jlens)."""
    paths = {name: BUILT_IN_DIR / f"{ALIASES.get(name, name)}.json" for name in EXPERIMENTS}
    return {name: path for name, path in paths.items() if path.exists()}


def reference_size_sets() -> dict[str, Path]:
    """``{experiment: path}`` of the sets shipped at the reference's sizes (``{experiment}-reference-size.json``:
    probe-swap 90 items, verbal-report 14 x 10, flexible-generalization 4 x 4 x 4), loadable by that stem too."""
    paths = {name: BUILT_IN_DIR / f"{name}-reference-size.json" for name in EXPERIMENTS}
    return {name: path for name, path in paths.items() if path.exists()}


def _missing(data: Mapping[str, Any], name: str) -> list[str]:
    return [f for f in FORMATS[name][0] if f not in data]


def detect_format(data: Any, *, source: str = "the data") -> str:
    """The experiment whose top-level fields ``data`` has (``probe-swap``, ``verbal-report``, ...).

    Raises:
        ValueError: ``data`` is not a JSON object, or has the fields of no experiment (names the closest
            experiment and the fields it lacks).
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{source} is not a JSON object: an experiment file is one object "  # noqa: TRY004
                         'such as {"items": [...]} (docs/experiments.md).')
    found = [name for name in FORMATS if not _missing(data, name)]
    if found:  # the most specific: top-down-summoning's {"q1", "items"} is also probe-swap's {"items"}
        return max(found, key=lambda name: len(FORMATS[name][0]))
    # the closest: the most of its fields present, then the fewest missing
    closest = min(FORMATS, key=lambda name: (len(_missing(data, name)) - len(FORMATS[name][0]),
                                             len(_missing(data, name)), list(FORMATS).index(name)))
    raise ValueError(f"{source} is in no known experiment format: it looks closest to {closest!r}, whose fields "
                     f"{', '.join(_missing(data, closest))} it lacks (docs/experiments.md lists the formats).")


def _check_entries(data: Mapping[str, Any], name: str, source: str) -> None:
    for field, needed in FORMATS[name][1].items():
        entries = data[field]
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"{source}: {field!r} of {name} must be a non-empty list.")
        for i, entry in enumerate(entries):
            if not isinstance(entry, Mapping):
                raise ValueError(f"{source}: entry {i} of {field!r} is not an object with fields "  # noqa: TRY004
                                 f"{', '.join(needed)}.")
            lacking = [f for f in needed if f not in entry]
            if lacking:
                label = entry.get("name", entry.get("key", f"#{i}"))
                raise ValueError(f"{source}: entry {i} ({label!r}) of {field!r} lacks the {name} fields "
                                 f"{', '.join(lacking)}.")
    if name == "verbal-report":
        candidates = data["candidates"]
        if not isinstance(candidates, Mapping) or not candidates or not all(
                isinstance(words, list) and words for words in candidates.values()):
            raise ValueError(f"{source}: 'candidates' of verbal-report must map each category to a non-empty list "
                             "of words.")
    if name == "flexible-generalization":
        for category in data["categories"]:
            for func in category["funcs"]:
                lacking = [f for f in ("name", "template", "answers") if f not in func]
                if lacking:
                    raise ValueError(f"{source}: a function of category {category['name']!r} lacks the fields "
                                     f"{', '.join(lacking)}.")
                if "{arg}" not in str(func["template"]):
                    raise ValueError(f"{source}: the template of function {func['name']!r} has no '{{arg}}' to fill.")
    if name == "selectivity-linecount":
        conditions = data["conditions"]
        if not isinstance(conditions, Mapping) or not conditions:
            raise ValueError(f"{source}: 'conditions' of selectivity-linecount must map each condition's name to "
                             '{"question", "prefill"}.')
        for key, condition in conditions.items():
            lacking = [f for f in ("question", "prefill") if not isinstance(condition, Mapping) or f not in condition]
            if lacking:
                raise ValueError(f"{source}: condition {key!r} of selectivity-linecount lacks the fields "
                                 f"{', '.join(lacking)}.")


def load_experiment_items(source: str | Path | Mapping[str, Any], name: str | None = None) -> tuple[str, dict]:
    """``(experiment, data)`` from a file path, a built-in set's experiment name, or an already parsed object.

    Args:
        source: a ``.json`` file in one of :data:`FORMATS`, a built-in set (``"probe-swap"``: the example set
            shipped for that experiment; ``"probe-swap-reference-size"``: the one at the reference's size) or the
            parsed object.
        name: the experiment the data is for (checked); ``None`` detects it from the fields.

    Raises:
        FileNotFoundError: no such file or built-in set.
        ValueError: not JSON, no known format, the fields of another experiment than ``name``, or an entry
            that lacks its fields (names the entry).
    """
    if name is not None and name not in EXPERIMENTS:
        raise ValueError(f"{name!r} is not an experiment: choose one of {', '.join(EXPERIMENTS)}.")
    if isinstance(source, Mapping):
        data, label = source, "the data"
    else:
        builtin = built_in_sets()
        builtin.update({path.stem: path for path in reference_size_sets().values()})
        path = builtin[str(source)] if str(source) in builtin else Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"No experiment file {str(source)!r}: give a .json file or a built-in set "
                                    f"({', '.join(builtin)}).")
        label = str(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{label} is not JSON ({exc}): an experiment file is one JSON object.") from None
    wanted = ALIASES.get(name, name) if name is not None else None
    if wanted is not None:
        if not isinstance(data, Mapping):
            detect_format(data, source=label)
        lacking = _missing(data, wanted)
        if lacking:
            raise ValueError(f"{label} is not a {name} file: it lacks the fields {', '.join(lacking)}.")
        found = wanted
    else:
        found = detect_format(data, source=label)
    _check_entries(data, found, label)
    return (name or found), dict(data)


__all__ = ["ALIASES", "EXPERIMENTS", "FORMATS", "READ_ONLY", "built_in_sets", "detect_format", "load_experiment_items", "reference_size_sets"]
