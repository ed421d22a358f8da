"""The package's front door (issue #29 §5, #48 §6): a name the top level lists is imported from ``jlens_core``
itself in the README and docs/ (the rest from its subpackage), the deep module paths that older code imports from
still give the same objects, and the names the top level no longer lists still resolve there, with one warning
each, until their removal version.

The lazy table itself (every ``__all__`` name resolves through ``_SOURCES`` to its defining module,
without torch for ``jlens --help``) is checked in test_layout.py.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import jlens_core

ROOT = Path(__file__).resolve().parents[1]
IMPORT = re.compile(r"^from (jlens_core[\w.]*) import \(?([\w, ]+)", re.MULTILINE)

# (deep module, name): paths code and notebooks written before the split import from
DEEP_PATHS = [
    ("jlens_core.reading.reader", "read_prompt"),
    ("jlens_core.reading.reader", "read_prompts"),
    ("jlens_core.reading.prompt_reading", "PromptReading"),
    ("jlens_core.reading.summaries", "most_common_tokens"),
    ("jlens_core.reading.summaries", "compare_readings"),
    ("jlens_core.reading.summaries", "difference"),
    ("jlens_core.reading.generation", "generate"),
    ("jlens_core.fitting.tuning", "train_tuned_lens"),
    ("jlens_core.lenses.tuned", "TunedLens"),
    ("jlens_core.interventions", "Steer"),
    ("jlens_core.interventions", "Ablate"),
    ("jlens_core.interventions", "Swap"),
    ("jlens_core.interventions", "swap_success"),
    ("jlens_core.interventions", "load_swap_set"),
    ("jlens_core.interventions.compare", "compare_runs"),
    ("jlens_core.debugging.dump", "dump_hidden_states"),
    ("jlens_core.debugging.diff", "diff_dumps"),
]


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readme_and_docs_import_front_door_names_from_the_front_door():
    deep, names = [], set()
    for page in doc_pages():
        for module, listed in IMPORT.findall(page.read_text(encoding="utf-8")):
            shown = {n.strip() for n in listed.split(",") if n.strip()}
            if module != "jlens_core":
                deep += [f"{page.relative_to(ROOT)}: from {module} import {n}" for n in shown
                         if n in jlens_core.__all__ or not hasattr(importlib.import_module(module), n)]
            else:
                names |= shown
    assert deep == [], "a top-level name imported from a subpackage, or a name its module lacks"
    assert names - set(jlens_core.__all__) == set()
    # the pages do show the interventions, tuned lens, generation and debugging names
    assert {"generate", "TunedLens", "train_tuned_lens", "Swap", "swap_success", "dump_hidden_states"} <= names


@pytest.mark.parametrize(("module", "name"), DEEP_PATHS)
def test_deep_paths_give_the_front_doors_object(module, name):
    assert name in jlens_core.__all__
    assert getattr(importlib.import_module(module), name) is getattr(jlens_core, name)


def test_moved_names_warn_once_and_go_when_their_version_comes():
    """Every name the top level dropped (``jlens_core._MOVED``) is its module's object, with one
    DeprecationWarning naming the module and the removal version; at that version the table must go."""
    import warnings

    from test_layout import version_tuple

    assert version_tuple(jlens_core.__version__) < version_tuple(jlens_core.MOVED_REMOVED_IN), (
        f"jlens is {jlens_core.__version__}: delete jlens_core._MOVED (due in {jlens_core.MOVED_REMOVED_IN})")
    assert len(jlens_core.__all__) < 50 and not set(jlens_core._MOVED) & set(jlens_core.__all__)
    for name, module in jlens_core._MOVED.items():
        jlens_core._warned.discard(name)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            first = getattr(jlens_core, name)
            second = getattr(jlens_core, name)
        assert first is second is getattr(importlib.import_module("jlens_core" + module), name)
        deprecations = [w for w in seen if issubclass(w.category, DeprecationWarning)]
        assert len(deprecations) == 1, (name, [str(w.message) for w in seen])
        message = str(deprecations[0].message)
        assert f"jlens_core{module}" in message and jlens_core.MOVED_REMOVED_IN in message, message
    with pytest.raises(AttributeError):
        jlens_core.no_such_name  # noqa: B018
