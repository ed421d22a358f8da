"""The table of lens kinds (jlens_core/lenses/kinds.py): every kind has every field, its own colour, tag and
shipped suffix, and what names or draws a kind (shipped variants, figure labels, fit rules, expert kinds, the
app's tags) reads the table."""

from __future__ import annotations

import re
from dataclasses import fields
from types import SimpleNamespace

import pandas as pd
import pytest

from jlens_core.lenses.kinds import BY_KIND, FIELDS, KINDS, RULES, LensKind, expert_kind, lens_kind

PLOTLY_DASHES = {"solid", "dot", "dash", "longdash", "dashdot", "longdashdot"}


def test_every_kind_has_every_field():
    assert FIELDS == tuple(f.name for f in fields(LensKind))
    for k in KINDS:
        for name in ("kind", "name", "label", "short", "abbr", "tag", "colour", "dash"):
            value = getattr(k, name)
            assert isinstance(value, str) and value.strip(), f"{k.kind}: {name} is empty"
        assert re.fullmatch(r"#[0-9a-f]{6}", k.colour), f"{k.kind}: colour {k.colour!r} is not #rrggbb"
        assert k.dash in PLOTLY_DASHES, k.kind
        assert k.label[0].isupper(), f"{k.kind}: a label is a title"
        assert (k.rules is None) == (k.kind in ("logit", "tuned")), f"{k.kind}: rules {k.rules!r}"
        assert k.rules is None or k.rules in RULES
        assert not k.weighted or k.experts, f"{k.kind}: weights belong to experts"


def test_kinds_are_told_apart():
    for name in ("kind", "name", "label", "tag", "colour"):
        values = [getattr(k, name) for k in KINDS]
        assert len(set(values)) == len(values), f"two kinds share a {name}: {values}"
    variants = [k.variant for k in KINDS if k.variant]
    assert len(set(variants)) == len(variants) and set(variants) == {"relevance", "jpp", "rpp"}
    assert len(KINDS) == len(BY_KIND) == 8


def test_what_names_or_draws_a_kind_reads_the_table():
    from jlens_core.figures.labels import LENS_COLORS, LENS_DASHES, LENS_NAMES, LENS_SHORT
    from jlens_core.fitting import methods
    from jlens_core.lenses import fit_settings, lens
    from jlens_core.lenses.shipped import KIND_NAMES, VARIANTS

    assert VARIANTS == {"relevance": "R-lens", "jpp": "J++ lens", "rpp": "R++ lens"}
    assert KIND_NAMES == {k.kind: k.name for k in KINDS}
    assert RULES == ("jacobian", "relevance")  # one name: the fit settings and lens files read the table's
    assert fit_settings.RULES is RULES and not hasattr(lens, "LENS_RULES") and not hasattr(methods, "RULES")
    assert "RULES" not in fit_settings.__all__
    for k in KINDS:
        assert (LENS_NAMES[k.kind], LENS_SHORT[k.kind], LENS_COLORS[k.kind], LENS_DASHES[k.kind]) == (
            k.label, k.short, k.colour, k.dash)
        assert LENS_COLORS[k.tag] == k.colour  # the app's "J++" is drawn in the J++ kind's colour
    # the four kinds the figures drew before the table: unchanged
    assert [LENS_COLORS[n] for n in ("logit", "jacobian", "relevance", "tuned")] == [
        "#6c8ebf", "#d6762b", "#8e5bb5", "#4c9a5a"]


def test_expert_kinds_and_lens_kind():
    from helpers import random_lens

    assert [expert_kind(r, w) for r in RULES for w in (True, False)] == [
        "jacobian++", "jacobian-experts", "relevance++", "relevance-experts"]
    with pytest.raises(StopIteration):
        expert_kind("gradient", True)
    lens = random_lens(d=4)
    assert lens_kind(lens) == "jacobian"
    combined = lens.replace(combined_from={"kind": "relevance++"})  # a combined one-matrix file of an R++ lens
    assert lens_kind(combined) == "relevance++" and lens_kind(lens) == "jacobian"

    origin = SimpleNamespace(combined_from=SimpleNamespace(kind="jacobian++"))
    tuned = SimpleNamespace(kind="tuned", record=origin)  # only a J or R lens is combined
    assert lens_kind(tuned) == "tuned"


def test_a_figure_of_every_kind_gives_each_its_own_colour():
    pytest.importorskip("plotly")
    from jlens_core.figures.evaluation import eval_curves_figure

    names = [k.kind for k in KINDS] + ["J++", "R++"]  # kinds, and the app's names of loaded expert lenses
    frame = pd.DataFrame([{"lens": n, "layer": layer, "kl_bits": 1.0 + layer, "ce_bits": 2.0, "kl_se": 0.1,
                           "ce_se": 0.1} for n in names for layer in range(3)])
    fig = eval_curves_figure(frame)
    colours = {trace.name: trace.line.color for trace in fig.data}
    assert None not in colours.values()
    by_kind = [colours[BY_KIND[k].label] for k in BY_KIND]
    assert len(set(by_kind)) == len(KINDS)
    assert colours["J++"] == BY_KIND["jacobian++"].colour and colours["R++"] == BY_KIND["relevance++"].colour


def test_capabilities_are_the_tables_and_every_list_derives_from_it():
    from jlens_core.interventions.say import CONTROLS, LOGIT
    from jlens_core.lenses import kinds
    from jlens_core.lenses.shipped import SOURCE_ONLY_VARIANTS

    assert kinds.BASELINE == "logit" and kinds.PLAIN == "jacobian" and kinds.PLAIN_RULES == "jacobian"
    assert [k.kind for k in KINDS if k.baseline] == ["logit"] and [k.kind for k in KINDS if k.trained] == ["tuned"]
    assert [k.kind for k in KINDS if k.fitted] == [k.kind for k in KINDS if k.has_halves] == [
        "jacobian", "relevance", "jacobian++", "relevance++", "jacobian-experts", "relevance-experts"]
    assert kinds.SINGLE_KINDS == ("logit", "jacobian", "relevance", "tuned")
    assert SOURCE_ONLY_VARIANTS == kinds.SOURCE_ONLY_VARIANTS == ("jpp", "rpp")
    assert LOGIT == kinds.BASELINE and LOGIT in CONTROLS
    assert [kinds.relevance_backward(r) for r in RULES] == [False, True] and not kinds.relevance_backward("x")
    assert [kinds.plain_kind(r) for r in RULES] == ["jacobian", "relevance"]
    with pytest.raises(KeyError, match="rules='gradient'"):
        kinds.plain_kind("gradient")
    from helpers import random_lens

    lens = random_lens(d=4)
    assert kinds.capabilities(lens) is BY_KIND["jacobian"] and kinds.capabilities("nope") is None
    assert not kinds.is_baseline(lens) and kinds.is_baseline("logit") and kinds.is_trained("tuned")
    assert not kinds.is_baseline(SimpleNamespace(kind="other"))


def test_no_kind_name_is_compared_outside_the_table():
    """A decision by kind asks the table's capabilities (kinds.py), never compares a kind's name."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    names = "|".join(re.escape(k.kind) for k in KINDS)
    compared = re.compile(rf"""(==|!=|\bin)\s*\(?["'](?:{names})["']|["'](?:{names})["']\s*(==|!=|\bin\b|\bnot in\b)""")
    found = [f"{path.relative_to(root)}:{n}" for folder in ("jlens_core", "app") for path in (root / folder).rglob("*.py")
             if path.name != "kinds.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if compared.search(line.split("#")[0])]
    assert found == []
    assert compared.search('if lens.kind == "logit":') and compared.search('x = "tuned" in names')  # it finds them
