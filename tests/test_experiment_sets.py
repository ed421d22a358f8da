"""The shipped experiment sets: the reference-size sets of experiments 1-3 have the reference's sizes (and, on the
default model, single-token words), and the formats of experiment 7 are read by field name (not run)."""

from __future__ import annotations

import json

import pytest

from jlens_core.experiments.formats import (
    ASSETS_DIR,
    FORMATS,
    READ_ONLY,
    built_in_sets,
    detect_format,
    load_experiment_items,
    reference_size_sets,
)
from jlens_core.experiments.run import RUNNERS

SETS = ASSETS_DIR / "experiments"


def reference_size() -> dict[str, dict]:
    return {name: json.loads((SETS / f"{name}-reference-size.json").read_text())
            for name in ("probe-swap", "verbal-report", "flexible-generalization")}


def test_reference_size_sets_have_the_references_sizes():
    sets = reference_size()
    assert set(reference_size_sets()) == set(sets)
    for name, data in sets.items():
        assert load_experiment_items(data, name)[0] == name
        assert load_experiment_items(f"{name}-reference-size", name)[1] == data  # by name, as --items takes it
    items = sets["probe-swap"]["items"]
    assert len(items) == 90 and len({i["name"] for i in items}) == 90
    assert all(i["answer"] != i["swap_answer"] and i["intermediate"] != i["swap_to"] for i in items)
    candidates = sets["verbal-report"]["candidates"]
    assert len(candidates) == 14 and all(len(set(words)) == 10 for words in candidates.values())
    categories = sets["flexible-generalization"]["categories"]
    assert len(categories) == 4 and all(len(c["args"]) == 4 and len(c["funcs"]) == 4 for c in categories)
    assert all(set(f["answers"]) == set(c["args"]) for c in categories for f in c["funcs"])


@pytest.mark.slow
def test_reference_size_words_are_single_tokens_on_the_default_model():
    from jlens_core import load_model
    from jlens_core.experiments.core import word_ids

    model = load_model()
    sets = reference_size()
    words = {w for i in sets["probe-swap"]["items"] for w in (i["intermediate"], i["answer"], i["swap_to"],
                                                               i["swap_answer"])}
    words |= {w for ws in sets["verbal-report"]["candidates"].values() for w in ws}
    words |= {w for c in sets["flexible-generalization"]["categories"] for f in c["funcs"]
              for w in [*c["args"], *f["answers"].values()]}
    assert sorted(w for w in words if not word_ids(model, w)) == []


@pytest.mark.parametrize("name", READ_ONLY)
def test_experiment_7_formats_are_read_by_field_name(name, tmp_path):
    path = built_in_sets()[name]
    data = json.loads(path.read_text())
    assert detect_format(data) == name and load_experiment_items(path)[0] == name
    assert name not in RUNNERS
    # each top-level field is needed: without it, the file names this experiment and the field
    for field in [f for f in data if f != "description"]:
        less = {k: v for k, v in data.items() if k != field}
        if any(all(f in less for f in FORMATS[other][0]) for other in FORMATS if other != name):
            continue  # what is left is another experiment's format (top-down-summoning less q1: probe-swap)
        with pytest.raises(ValueError, match=f"closest to '{name}', whose fields {field} it lacks"):
            load_experiment_items(less)


def test_experiment_7_entries_and_conditions_are_checked():
    data = json.loads(built_in_sets()["top-down-summoning"].read_text())
    data["items"][1] = {k: v for k, v in data["items"][1].items() if k != "foil"}
    with pytest.raises(ValueError, match="entry 1 .* of 'items' lacks the top-down-summoning fields foil"):
        load_experiment_items(data)
    lines = json.loads(built_in_sets()["selectivity-linecount"].read_text())
    lines["conditions"]["automatic"] = {"question": "Go on."}
    with pytest.raises(ValueError, match="condition 'automatic' of selectivity-linecount lacks the fields prefill"):
        load_experiment_items(lines)


def test_experiment_7_does_not_run_and_says_so():
    from jlens_core.experiments.run import run_experiment

    with pytest.raises(ValueError, match="The capacity experiment reads its format but does not run in this version"):
        run_experiment(None, None, "capacity", "capacity")
