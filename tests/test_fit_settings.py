"""Fit settings as types (issue #41 §1): FitSettings, FitPlan, FitRecord, the CLI flags made from them, and old
checkpoints and lens files that keep loading.

``tests/data/fit-v1.ckpt`` and ``fit-experts-v1.ckpt`` were written by the code before the settings became types
(commit f07ae8e: ``fit(tiny(), PROMPTS[:3], checkpoint_path=...)`` and ``fit(tiny(), PROMPTS[:4], experts=2,
cluster_prompts=3, ...)`` with test_fit's prompts and settings); ``fit-flags-v1.json`` is that code's
``jlens fit`` flags (name -> dest, default, help, choices, type, metavar).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny
from test_fit import PROMPTS, SETTINGS, uninterrupted

from jlens_core import ExpertLens, JacobianLens, fit
from jlens_core.fitting.fit import read_checkpoint
from jlens_core.lenses.fit_settings import FitPlan, FitRecord, FitSettings, add_fit_arguments

DATA = Path(__file__).resolve().parent / "data"
REPO = DATA.parents[1]


def fit_parser() -> argparse.ArgumentParser:
    from jlens_core.cli.main import build_parser

    return build_parser()._subparsers._group_actions[0].choices["fit"]  # type: ignore[union-attr]


# -- the dataclasses ---------------------------------------------------------------------------------
def test_defaults_are_the_old_keyword_defaults():
    settings, plan = FitSettings(), FitPlan()
    assert (settings.source_layers, settings.target_layer, settings.skip_first, settings.max_seq_len,
            settings.rules, settings.experts) == (None, None, 16, 128, "jacobian", 0)
    assert (plan.dim_batch, plan.method, plan.max_memory, plan.checkpoint_every) == (8, "auto", None, 1)
    assert FitSettings(experts=2).cluster_prompts == 64


@pytest.mark.parametrize(("cls", "kwargs", "match"), [
    (FitSettings, {"skip_first": -1}, r"^skip_first=-1 must be >= 0\.$"),
    (FitSettings, {"max_seq_len": 1}, r"^max_seq_len=1 must be at least 2\.$"),
    (FitSettings, {"rules": "lrp"}, r"^rules='lrp' is not one of"),
    (FitSettings, {"experts": -1}, r"^experts=-1 must be an integer >= 0"),
    (FitSettings, {"experts": 2, "cluster_prompts": 0}, r"^cluster_prompts=0 must be an integer >= 1"),
    (FitSettings, {"source_layers": "0,1"}, r"^source_layers='0,1' must be integer layer indices"),
    (FitPlan, {"dim_batch": 0}, r"^dim_batch=0 must be an integer >= 1 or 'auto'\.$"),
    (FitPlan, {"method": "magic"}, r"^method='magic' is not one of"),
    (FitPlan, {"checkpoint_every": 0}, r"^checkpoint_every=0 must be >= 1\.$"),
    (FitRecord, {"n_prompts": -1}, r"^n_prompts=-1 must be an integer >= 0\.$"),
])
def test_bad_values_are_one_sentence(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)
    with pytest.raises(ValueError, match=match):  # replace checks like a new object
        cls().replace(**kwargs)


def test_to_dict_from_dict_round_trip_and_unknown_keys_are_refused():
    settings = FitSettings(source_layers=[2, 0], target_layer=3, skip_first=2, max_seq_len=16, rules="relevance",
                           experts=2, cluster_prompts=3)
    data = settings.to_dict()
    assert data["source_layers"] == [2, 0] and json.loads(json.dumps(data)) == data  # JSON-ready
    assert FitSettings.from_dict(data) == settings
    assert FitSettings.from_dict({"skip_first": 3}) == FitSettings(skip_first=3)
    with pytest.raises(ValueError, match=r"^FitSettings has no setting 'max_len': the known ones are source_layers, "
                                         r"target_layer, skip_first, max_seq_len, rules, experts, cluster_prompts\.$"):
        FitSettings.from_dict({"max_len": 3})
    with pytest.raises(ValueError, match=r"^FitPlan has no plan entry 'skip_first': the known ones are dim_batch"):
        FitPlan.from_dict({"skip_first": 3})
    with pytest.raises(ValueError, match="FitSettings has no setting 'dim_batch'"):
        settings.replace(dim_batch=3)
    plan = FitPlan(dim_batch="auto", max_memory="6GiB", method="fused", checkpoint_every=4)
    assert FitPlan.from_dict(plan.to_dict()) == plan
    record = FitRecord(model_name="m", n_prompts=3, n_skipped=1, diagnostics=[{"layer": 0}], half_prompts=[2, 1])
    assert FitRecord.from_dict(json.loads(json.dumps(record.to_dict()))) == record
    # frozen: a changed setting is a new object
    with pytest.raises(AttributeError):
        settings.skip_first = 3  # type: ignore[misc]
    assert settings.replace(skip_first=3).skip_first == 3 and settings.skip_first == 2


def test_cluster_prompts_shape_nothing_without_experts():
    assert FitSettings(cluster_prompts=5).cluster_prompts == 0 == FitSettings().cluster_prompts
    assert FitSettings(cluster_prompts=5) == FitSettings()


def test_resolved_settings_are_concrete_layers():
    assert FitSettings().resolved(4) == FitSettings(source_layers=(0, 1, 2), target_layer=3)
    assert FitSettings(source_layers=[-2, 0], target_layer=-1).resolved(4).source_layers == (0, 2)
    with pytest.raises(ValueError, match="source layer 3"):
        FitSettings(source_layers=[3], target_layer=3).resolved(4)


# -- fit takes them, and its old keywords -----------------------------------------------------------------
def test_fit_with_settings_objects_equals_fit_with_the_old_keywords():
    by_keywords = uninterrupted()
    settings = FitSettings(skip_first=2, max_seq_len=16)
    by_types = fit(tiny(), PROMPTS, settings, FitPlan(dim_batch=16))
    for layer in by_keywords.source_layers:
        assert torch.equal(by_keywords.jacobians[layer], by_types.jacobians[layer])
    assert by_types.settings_dict() == by_keywords.settings_dict()  # the file's settings dict, as before
    # a keyword replaces that field of the object given
    mixed = fit(tiny(), PROMPTS[:2], settings.replace(max_seq_len=99), dim_batch=16, max_seq_len=16)
    assert mixed.fit_settings.max_seq_len == 16 and mixed.fit_plan.dim_batch == 16
    # the lens says what shaped it and what its fit recorded
    assert by_types.fit_settings == settings.resolved(tiny().n_layers)
    assert by_types.fit_plan == FitPlan(dim_batch=16)
    record = by_types.record
    assert (record.model_name, record.n_prompts, record.n_skipped, record.stop_reason) == ("tiny-llama", 5, 1, None)
    assert record.model_fingerprint == tiny().fingerprint() and list(record.diagnostics) == by_types.diagnostics
    with pytest.raises(TypeError, match=r"^fit\(\) has no setting 'max_len': the known ones are source_layers"):
        fit(tiny(), PROMPTS, max_len=16)
    with pytest.raises(TypeError, match=r"^fit\(\)'s settings must be a FitSettings, not a FitPlan"):
        fit(tiny(), PROMPTS, FitPlan())


def test_saved_lens_reads_back_the_same_settings(tmp_path):
    lens = uninterrupted()
    again = JacobianLens.load(lens.save(tmp_path / "lens.safetensors"))
    assert again.fit_settings == lens.fit_settings and again.fit_plan == lens.fit_plan
    assert again.record == lens.record


@pytest.mark.parametrize("name", ["smollm2-135m", "smollm2-135m.relevance", "smollm2-135m.jpp", "smollm2-135m.rpp"])
def test_every_shipped_lens_reads_into_the_types(name):
    path = REPO / "assets" / "lenses" / f"{name}.safetensors"
    if not path.is_file():
        pytest.skip(f"{path.name} is not in this checkout")
    lens = JacobianLens.load(path)
    settings = lens.fit_settings
    assert settings.source_layers == tuple(range(29)) and settings.target_layer == 29
    assert (settings.skip_first, settings.max_seq_len) == (16, 128)
    assert settings.rules == ("relevance" if "relevance" in name or "rpp" in name else "jacobian")
    assert settings.experts == (8 if "pp" in name else 0)
    # fitted before halves existed; the J lens got its halves from a refit of its prompts (scripts/ship_halves.py)
    with_halves = name == "smollm2-135m"
    assert lens.fit_plan == FitPlan(dim_batch=8, method="auto", halves=with_halves)
    assert (lens.halves() is not None) == with_halves
    assert lens.record.half_prompts == ((50, 50) if with_halves else None)
    assert lens.record.n_prompts == lens.n_prompts and lens.record.n_skipped == 0
    assert FitSettings.from_dict(settings.to_dict()) == settings
    # the file's settings dict, read into the types and made back from them (issue #48): unchanged
    from jlens_core.lenses.header import read_header

    assert lens.settings_dict() == lens.metadata()["settings"] == read_header(path).fresh_info()["settings"]
    assert (lens.record.combined_from is not None) == ("pp" in name)


# -- old checkpoints resume exactly ----------------------------------------------------------------------
def test_a_checkpoint_written_before_the_types_resumes_to_the_uninterrupted_lens(tmp_path):
    ckpt = tmp_path / "fit.ckpt"
    shutil.copy(DATA / "fit-v1.ckpt", ckpt)
    assert read_checkpoint(ckpt)["next_idx"] == 3  # prompts 0-2 read (2 skipped) by the old code
    events = []
    lens = fit(tiny(), PROMPTS, checkpoint_path=ckpt, progress=events.append, **SETTINGS)
    assert [e.prompt_index for e in events] == [3, 4, 5]  # only the prompts it had not read
    whole = uninterrupted()
    assert lens.n_prompts == whole.n_prompts and lens.record.n_skipped == 1
    assert len(lens.diagnostics) == len(whole.diagnostics)
    for layer in whole.source_layers:
        torch.testing.assert_close(lens.jacobians[layer], whole.jacobians[layer], rtol=1e-6, atol=1e-7)
    # it still refuses other settings by name
    shutil.copy(DATA / "fit-v1.ckpt", ckpt)
    with pytest.raises(ValueError, match="was made with skip_first=2, this fit asks for skip_first=3"):
        fit(tiny(), PROMPTS, checkpoint_path=ckpt, **{**SETTINGS, "skip_first": 3})


def test_an_expert_checkpoint_written_before_the_types_resumes_to_the_uninterrupted_lens(tmp_path):
    ckpt = tmp_path / "fit.ckpt"
    shutil.copy(DATA / "fit-experts-v1.ckpt", ckpt)
    lens = fit(tiny(), PROMPTS, checkpoint_path=ckpt, experts=2, cluster_prompts=3, **SETTINGS)
    whole = fit(tiny(), PROMPTS, experts=2, cluster_prompts=3, **SETTINGS)
    assert isinstance(lens, ExpertLens) and isinstance(whole, ExpertLens) and lens.n_prompts == whole.n_prompts
    for layer in whole.source_layers:
        # the stored clustering came from the old code's run; today's libraries may round the tiny model's
        # forward differently in the last bits, and PCA components of (near-)zero variance are then arbitrary:
        # the mean matches to float precision, and the experts below show the assignment is the same
        torch.testing.assert_close(lens.clustering[layer].mean, whole.clustering[layer].mean, rtol=1e-5, atol=1e-6)
        assert torch.equal(lens.counts[layer], whole.counts[layer])
        torch.testing.assert_close(lens.experts[layer], whole.experts[layer], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(lens.pooled[layer], whole.pooled[layer], rtol=1e-6, atol=1e-7)
    assert lens.fit_settings == whole.fit_settings == FitSettings(
        source_layers=(0, 1, 2), target_layer=3, skip_first=2, max_seq_len=16, experts=2, cluster_prompts=3)


# -- the command line --------------------------------------------------------------------------------------
def test_jlens_fit_flags_are_those_of_before():
    """Names, dests, defaults, help, choices, types and metavars of every `jlens fit` flag, as before the types."""
    want = json.loads((DATA / "fit-flags-v1.json").read_text())
    got = {}
    for action in fit_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        got[action.option_strings[0]] = {
            "dest": action.dest, "default": action.default, "help": action.help,
            "choices": list(action.choices) if action.choices else None, "metavar": action.metavar,
            "type": getattr(action.type, "__name__", None), "nargs": action.nargs, "const": action.const,
            "action": type(action).__name__}
    assert set(got) >= set(want)
    for flag, spec in want.items():
        assert got[flag] == spec, flag
    # and the fields' flags are made from the fields: one per field, in their order
    parser = argparse.ArgumentParser()
    add_fit_arguments(parser)
    flags = [a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"]
    assert flags == ["--layers", "--target-layer", "--skip-first", "--max-seq-len", "--rules", "--experts",
                     "--cluster-prompts", "--dim-batch", "--fit-memory", "--method", "--checkpoint-every",
                     "--first-prompt", "--no-halves"]


def test_flags_read_back_into_the_types():
    args = fit_parser().parse_args(["--out", "x.safetensors", "--skip-first", "3", "--rules", "relevance",
                                    "--experts", "2", "--cluster-prompts", "5", "--fit-memory", "6GiB",
                                    "--checkpoint-every", "4"])
    assert FitSettings.from_args(args, source_layers=[0, 1]) == FitSettings(
        source_layers=(0, 1), target_layer=-1, skip_first=3, rules="relevance", experts=2, cluster_prompts=5)
    # --dim-batch left out: "auto" with --fit-memory, else 8 (as before)
    assert FitPlan.from_args(args) == FitPlan(dim_batch="auto", max_memory="6GiB", checkpoint_every=4)
    assert FitPlan.from_args(fit_parser().parse_args(["--out", "x"])) == FitPlan(dim_batch=8)
    with pytest.raises(ValueError, match="skip_first=-2 must be >= 0"):
        FitSettings.from_args(fit_parser().parse_args(["--out", "x", "--skip-first", "-2"]))


def test_app_fit_arguments_round_trip_through_the_cli_parser():
    sys.path.insert(0, str(REPO))
    from jlens_core.fitting import runs

    settings = FitSettings(source_layers=(0, 2), target_layer=3, max_seq_len=32, rules="relevance", experts=2,
                           cluster_prompts=3)
    plan = FitPlan(dim_batch=4)
    argv = runs.fit_arguments(model="m", corpus="c.txt", out=Path("lens.safetensors"), settings=settings, plan=plan,
                              n_prompts=5)
    assert argv[argv.index("--experts"):][:4] == ["--experts", "2", "--cluster-prompts", "3"]
    args = fit_parser().parse_args(argv)
    assert (args.n_prompts, args.corpus, args.no_progress) == (5, "c.txt", True)
    assert FitSettings.from_args(args, source_layers=[int(x) for x in args.layers.split(",")]) == settings
    assert FitPlan.from_args(args) == plan
    # defaults give no flag of their own; negative layers still parse
    plain = runs.fit_arguments(model="m", corpus="c", out=Path("o"))
    assert not {"--skip-first", "--rules", "--experts", "--layers"} & set(plain)
    negative = runs.fit_arguments(model="m", corpus="c", out=Path("o"), settings=FitSettings(source_layers=(-3, -2)))
    assert fit_parser().parse_args(negative).layers == "-3,-2"
