"""The package's front door (issue #29 §5): what the README and docs/ import comes from ``jlens_core``
itself, and the deep module paths that older code imports from still give the same objects.

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
    ("jlens_core.layerspec", "resolve_layers"),
    ("jlens_core.fitting.tuning", "train_tuned_lens"),
    ("jlens_core.lenses.tuned", "TunedLens"),
    ("jlens_core.interventions", "Steer"),
    ("jlens_core.interventions", "Ablate"),
    ("jlens_core.interventions", "Swap"),
    ("jlens_core.interventions", "swap_success"),
    ("jlens_core.interventions", "token_direction"),
    ("jlens_core.interventions", "load_swap_set"),
    ("jlens_core.interventions.compare", "compare_runs"),
    ("jlens_core.debugging.dump", "dump_hidden_states"),
    ("jlens_core.debugging.diff", "diff_dumps"),
]


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readme_and_docs_import_only_from_the_front_door():
    deep, names = [], set()
    for page in doc_pages():
        for module, listed in IMPORT.findall(page.read_text(encoding="utf-8")):
            if module != "jlens_core":
                deep.append(f"{page.relative_to(ROOT)}: from {module} import {listed.strip()}")
            names |= {n.strip() for n in listed.split(",") if n.strip()}
    assert deep == []
    assert names - set(jlens_core.__all__) == set()
    # the pages do show the interventions, tuned lens, generation and debugging names
    assert {"generate", "TunedLens", "train_tuned_lens", "Swap", "swap_success", "dump_hidden_states"} <= names


@pytest.mark.parametrize(("module", "name"), DEEP_PATHS)
def test_deep_paths_give_the_front_doors_object(module, name):
    assert name in jlens_core.__all__
    assert getattr(importlib.import_module(module), name) is getattr(jlens_core, name)
