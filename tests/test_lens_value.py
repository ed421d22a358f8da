"""The lens as one typed value (issue #48 §1, §4): a fitted lens holds its matrices, a FitSettings and a FitRecord;
derived lenses are copies (replace); the old settings dict is a read-only view that warns; one merge and one home
for the halves' formulas."""

from __future__ import annotations

import functools
import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from helpers import random_lens, tiny

from jlens_core import ExpertLens, JacobianLens, LogitLens, fit
from jlens_core._version import __version__
from jlens_core.fitting.diagnostics import half_agreement_frame
from jlens_core.lenses.fit_settings import (
    ExpertOrigin,
    FitRecord,
    FitSettings,
    settings_view,
    split_lens_settings,
)
from jlens_core.lenses.lens import SETTINGS_REMOVED_IN, half_rel_diff, predicted_rel_se
from jlens_core.lenses.protocol import FitRecordLens

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The capital of Italy is Rome. Water boils at one hundred degrees, and numbers like 12 appear.",
           "Numbers like 12, 345 and 6789 appear in text; so do symbols: #, @, %, & and *. The end.",
           "A third prompt about rivers, mountains and the sea, long enough to be read.",
           "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n"]


@functools.cache
def fitted(**kwargs) -> JacobianLens | ExpertLens:
    return fit(tiny(), PROMPTS, skip_first=2, max_seq_len=16, dim_batch=16, **kwargs)


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:3] if part.isdigit())


def test_a_fitted_lens_is_its_types():
    lens = fitted()
    assert isinstance(lens, FitRecordLens)
    assert isinstance(lens.fit_settings, FitSettings) and isinstance(lens.record, FitRecord)
    # the fit resolves dtype "auto" to what it computed in (fp32 on this CPU: fitting.precision)
    assert lens.fit_settings == FitSettings(source_layers=(0, 1, 2), target_layer=3, skip_first=2, max_seq_len=16,
                                            dtype="float32")
    record = lens.record
    assert (record.n_prompts, record.model_name, record.canary) == (lens.n_prompts, "tiny-llama", lens.canary)
    recorded = dict(record.provenance)
    where = recorded.pop("provenance")  # where the lens came from (docs/sharing.md): written into every file
    assert recorded == {"dim_batch": 16, "method": "auto"} and record.settings_recorded
    assert (where["capture_point"], where["model_name"]) == ("block_output", "tiny-llama")
    assert (record.corpus, record.weighting, record.merged_from, record.combined_from) == (None, None, None, None)
    assert lens.skip_first == 2 and lens.target_layer == 3 and lens.rules == "jacobian"
    # the file's settings dict, made from the types, is the one a fit recorded before the types
    settings = lens.settings_dict()
    assert settings.pop("provenance") == where
    assert settings == {"skip_first": 2, "max_seq_len": 16, "target_layer": 3, "dim_batch": 16, "method": "auto",
                        "n_skipped": 0, "dtype": "float32"}


def test_a_lens_is_immutable_and_copies_with_replace():
    lens = fitted()
    for name, value in (("canary", None), ("n_prompts", 3), ("settings", {}), ("jacobians", {}), ("shrinkage", 0.5)):
        with pytest.raises(AttributeError, match=rf"immutable value: derive a copy with lens.replace\({name}=\.\.\.\)"):
            setattr(lens, name, value)
    copy = lens.replace(canary=None, corpus="wiki")
    assert copy.canary is None and copy.record.corpus == "wiki" and lens.canary is not None and lens.record.corpus is None
    assert copy.jacobians == lens.jacobians and copy.fit_settings == lens.fit_settings
    assert copy.settings_dict() == {**lens.settings_dict(), "corpus": "wiki"}
    assert lens.with_shrinkage(0.25).canary is lens.canary  # derived copies keep the record (one model: one canary)
    with pytest.raises(TypeError, match=r"replace has no field 'colour': the known ones are jacobians"):
        lens.replace(colour="red")
    with pytest.raises(ValueError, match=r"layer 0 has shape \(4, 4\)"):
        lens.replace(jacobians={0: torch.eye(4)})


def test_the_settings_view_warns_is_read_only_and_goes_in_its_version():
    assert version_tuple(__version__) < version_tuple(SETTINGS_REMOVED_IN), (
        f"jlens is {__version__}: remove the deprecated lens.settings views, due in {SETTINGS_REMOVED_IN}")
    assert SETTINGS_REMOVED_IN == "0.3.0"
    lens = fitted()
    for obj in (lens, LogitLens(4, 8)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            view = obj.settings
        assert [w.category for w in seen] == [DeprecationWarning]
        message = str(seen[0].message)
        assert "0.3.0" in message and "skip_first" in message and type(obj).__name__ in message
        with pytest.raises(TypeError, match="read-only view"):
            view["corpus"] = "x"
        with pytest.raises(TypeError, match="read-only view"):
            view.update(corpus="x")
    with pytest.warns(DeprecationWarning, match="lens.fit_settings"):
        assert lens.settings == lens.settings_dict() and json.loads(json.dumps(lens.settings)) == lens.settings_dict()
    assert LogitLens(4, 8).skip_first is None


@pytest.mark.parametrize("settings", [
    {"skip_first": 2, "max_seq_len": 16, "target_layer": 3, "dim_batch": 16, "n_skipped": 1, "method": "auto",
     "first_prompt": 4, "memory": {"budget_bytes": 10}, "corpus": "c", "merged_from": 2,
     "weighting": {"seed": 3}, "note": "an entry no field names"},
    {"skip_first": 16, "max_seq_len": 128, "target_layer": 3, "dim_batch": 8, "n_skipped": 0, "method": "auto",
     "experts": 8, "cluster_prompts": 64, "expert_kind": "jacobian++", "expert_weights": {"0": [1.0]},
     "weight_items": ["a"], "min_positions": 50, "expert_counts": {"0": [3]}},
    {"source": "reference jlens file", "target_layer": 3},  # an import: no fit settings recorded
    {"max_seq_len": 16, "target_layer": 3},  # built by hand
])
def test_a_settings_dict_reads_into_the_types_and_back(settings):
    fit_settings, parts = split_lens_settings(settings, source_layers=[0, 1, 2], target_layer=3, rules="jacobian")
    record = FitRecord(**parts)
    assert settings_view(fit_settings, record) == settings
    assert record.settings_recorded == ("skip_first" in settings)
    assert isinstance(record.combined_from, ExpertOrigin) == ("expert_kind" in settings)
    assert FitRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record


def test_a_lens_built_by_hand_reads_every_position_and_round_trips(tmp_path):
    lens = random_lens(d=4)
    assert lens.skip_first is None and not lens.record.settings_recorded
    assert lens.settings_dict() == {"target_layer": 3}
    back = JacobianLens.load(lens.save(tmp_path / "hand.safetensors"))
    assert back.skip_first is None and back.settings_dict() == lens.settings_dict() and back.record == lens.record
    assert random_lens(d=4, settings={"skip_first": 5}).skip_first == 5


def test_one_merge_for_every_fitted_lens_and_its_record():
    assert JacobianLens.merge.__func__ is ExpertLens.merge.__func__  # type: ignore[attr-defined]
    head = fit(tiny(), PROMPTS[:2], skip_first=2, max_seq_len=16, dim_batch=16)
    tail = fit(tiny(), PROMPTS[2:], skip_first=2, max_seq_len=16, dim_batch=16, first_prompt=2)
    merged = JacobianLens.merge([head, tail])
    record = merged.record
    assert record.merged_from == 2 and record.n_prompts == head.n_prompts + tail.n_prompts
    assert record.diagnostics == head.record.diagnostics + tail.record.diagnostics and record.stop_reason is None
    assert record.provenance["first_prompt"] == 0 and merged.canary is head.canary
    assert merged.half_prompts == tuple(a + b for a, b in zip(head.half_prompts, tail.half_prompts))
    for layer in merged.source_layers:  # the prompt-weighted mean, computed here
        want = (head.jacobians[layer].double() * head.n_prompts + tail.jacobians[layer].double() * tail.n_prompts)
        torch.testing.assert_close(merged.jacobians[layer], (want / record.n_prompts).float())
    for half in merged.raw_halves:
        assert half.record.diagnostics == () and half.canary is None and half.record.merged_from == 2


def test_the_halves_formulas_have_one_home():
    lens = fitted()
    even, odd = lens.halves()
    frame = lens.half_diagnostics()
    for row in frame.itertuples():
        full, e, o = (x.matrix(row.layer).double() for x in (lens, even, odd))
        rel = float(torch.linalg.matrix_norm(e - o) / torch.linalg.matrix_norm(full))
        assert row.half_rel_diff == pytest.approx(rel, rel=1e-12)
        n_even, n_odd = even.n_prompts, odd.n_prompts
        assert row.predicted_rel_se == pytest.approx(rel * (n_even * n_odd) ** 0.5 / (n_even + n_odd), rel=1e-12)
    assert predicted_rel_se(0.5, 2, 2) == 0.25 and half_rel_diff(torch.eye(2), torch.eye(2), torch.eye(2)) == 0.0
    # the fit's records say the same, through the same formula
    by_records = half_agreement_frame(lens.diagnostics)
    assert list(by_records["predicted_rel_se"]) == [predicted_rel_se(r, n_e, n_o) for r, n_e, n_o in zip(
        by_records["half_rel_diff"], by_records["n_even"], by_records["n_odd"])]


def test_expert_lenses_are_values_too():
    lens = fitted(experts=2, cluster_prompts=2)
    assert isinstance(lens, ExpertLens) and lens.fit_settings.experts == 2 and lens.skip_first == 2
    with pytest.raises(AttributeError, match="immutable"):
        lens.weights = None
    weights = {layer: torch.tensor([1.0, -1.0]) for layer in lens.source_layers}
    weighted = lens.with_weights(weights, ["x"]).replace(weighting={"seed": 3})
    combined = weighted.to_jacobian_lens()
    origin = combined.record.combined_from
    assert origin.kind == "jacobian++" and origin.weight_items == ("x",) and combined.record.weighting == {"seed": 3}
    assert combined.fit_settings.experts == 2 and combined.canary is lens.canary
    pooled = lens.pooled_lens()
    assert pooled.fit_settings.experts == 0 and "experts" not in pooled.settings_dict()
    assert pooled.record == lens.record


def test_the_constructor_is_spelled_once_per_class():
    """Inside the library a fitted lens is made by its typed factory (from_fit) or copied (replace); the loose
    constructor is the documented path for importers (one call: the reference library's files)."""
    calls = re.compile(r"\b(JacobianLens|ExpertLens)\(")
    found = []
    for path in (ROOT / "jlens_core").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if calls.search(code) and "class " not in code and 'f"' not in code and "isinstance" not in code:
                found.append(f"{path.relative_to(ROOT)}:{n}")
    assert found == []
    source = (ROOT / "jlens_core" / "lenses" / "foreign.py").read_text()
    assert source.count("return cls(matrices,") == 1  # _lens: other libraries' files, by the loose fields


def test_every_lens_kind_is_immutable_and_its_dicts_survive_a_copy():
    import copy
    import pickle

    from helpers import identity_lens

    from jlens_core import TunedLens

    tuned = TunedLens.zeros(tiny(), settings={"skip_first": 3, "steps": 2})
    for lens, name in ((tuned, "settings"), (LogitLens.for_model(tiny()), "n_layers")):
        with pytest.raises(AttributeError, match="immutable value"):
            setattr(lens, name, None)
    with pytest.raises(TypeError, match="read-only"):
        tuned.settings["corpus"] = "x"
    more = tuned.replace(settings={**tuned.settings, "corpus": "x"}, metrics={"heldout_kl_bits": {"0": 1.0}})
    assert more.settings == {"skip_first": 3, "steps": 2, "corpus": "x"} and tuned.settings == {"skip_first": 3, "steps": 2}
    assert more.skip_first == 3 and more.metrics == {"heldout_kl_bits": {"0": 1.0}}
    with pytest.raises(TypeError, match="no field 'colour'"):
        tuned.replace(colour="red")
    for lens in (more, fitted(), identity_lens(tiny())):  # a lens copies and pickles whole
        again = pickle.loads(pickle.dumps(lens))
        assert copy.deepcopy(lens).layers == again.layers == lens.layers
    assert pickle.loads(pickle.dumps(more)).settings == more.settings


def test_a_new_fit_setting_is_recorded_and_read_back_from_its_field(monkeypatch):
    """The lens file's settings are made from FitSettings' fields (FILE_SETTINGS), not a list of their names."""
    from jlens_core.lenses import fit_settings

    assert fit_settings.FILE_SETTINGS == ("target_layer", "skip_first", "max_seq_len", "experts", "cluster_prompts",
                                          "dtype")
    settings = FitSettings(source_layers=(0, 1), target_layer=2, skip_first=3, experts=2, cluster_prompts=5)
    view = settings_view(settings, FitRecord())
    assert "dtype" not in view  # "auto" (not yet resolved) is not written: older files read back unchanged
    assert settings_view(settings.replace(dtype="bfloat16"), FitRecord())["dtype"] == "bfloat16"
    assert {k: view[k] for k in fit_settings.FILE_SETTINGS if k != "dtype"} == {"target_layer": 2, "skip_first": 3, "max_seq_len": 128,
                                                                 "experts": 2, "cluster_prompts": 5}
    back, _ = split_lens_settings(view, source_layers=[0, 1], target_layer=2, rules="jacobian")
    assert back == settings
    monkeypatch.setattr(fit_settings, "FILE_SETTINGS", (*fit_settings.FILE_SETTINGS, "rules"))  # as if a new field
    assert settings_view(settings, FitRecord())["rules"] == "jacobian"


def test_a_lens_of_the_old_protocol_still_says_where_it_was_fitted():
    """A lens written to the protocol before skip_first (a settings dict only) reads as before."""
    from types import SimpleNamespace

    from jlens_core.lenses.protocol import recorded_skip_first

    assert recorded_skip_first(SimpleNamespace(settings={"skip_first": 4})) == 4
    assert recorded_skip_first(SimpleNamespace(settings={})) is None
    assert recorded_skip_first(fitted()) == 2 and recorded_skip_first(LogitLens(4, 8)) is None


def test_a_lens_describes_itself_from_its_types():
    """lens.describe(): the one line the app shows, read from the types (no settings dict)."""
    from jlens_core import TunedLens

    lens = fitted().replace(corpus="wiki")
    line = lens.describe()
    assert line.startswith(f"{lens.n_prompts} prompts · layers 0..2 → 3") and "corpus wiki" in line
    assert "skip_first 2" in line and "max_seq_len 16" in line and "stopped early" not in line
    tuned = TunedLens.zeros(tiny())
    assert tuned.describe().startswith(f"layers {tuned.source_layers[0]}..{tuned.source_layers[-1]} → ")
