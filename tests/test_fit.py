"""Fitting (docs/method.md §3): the mean, diagnostics, checkpoints, resume after a kill, sharding, errors."""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import LONG_TEXT
from helpers import tiny

from jlens_core import JacobianLens, fit
from jlens_core.fitting.estimator import jacobian_for_prompt
from jlens_core.fitting.fit import CHECKPOINT_SETTINGS, FitProgress, read_checkpoint

TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parent

SHORT = "Hi"  # 2 tokens: no valid position with skip_first=2
PROMPTS = [
    LONG_TEXT,
    "The capital of Italy is Rome. Water boils at one hundred degrees, and numbers like 12 appear.",
    SHORT,
    "def add(a, b):\n    return a + b\n# Once upon a time there was a small model that read every layer.",
    "Numbers like 12, 345 and 6789 appear in text; so do symbols: #, @, %, & and *. The end.",
    "Once upon a time there was a small model that read every layer of itself, one token at a time.",
]
SETTINGS = {"skip_first": 2, "max_seq_len": 16, "dim_batch": 16}


@functools.cache
def per_prompt(idx: int):
    return jacobian_for_prompt(tiny(), PROMPTS[idx], skip_first=2, max_seq_len=16, dim_batch=16)


@functools.cache
def uninterrupted() -> JacobianLens:
    return fit(tiny(), PROMPTS, **SETTINGS)


def assert_same_lens(a: JacobianLens, b: JacobianLens, rtol=1e-6, atol=1e-7) -> None:
    assert a.source_layers == b.source_layers and a.n_prompts == b.n_prompts
    for layer in a.source_layers:
        torch.testing.assert_close(a.jacobians[layer], b.jacobians[layer], rtol=rtol, atol=atol)


# -- the mean and the diagnostics ------------------------------------------------------------------
def test_fit_is_the_plain_mean_over_prompts_that_count():
    events: list[FitProgress] = []
    lens = fit(tiny(), PROMPTS, progress=events.append, **SETTINGS)
    counted = [i for i in range(len(PROMPTS)) if i != 2]
    assert lens.n_prompts == 5 and lens.record.n_skipped == 1
    assert lens.source_layers == [0, 1, 2] and lens.target_layer == 3 and lens.d_model == 32
    assert lens.model_name == "tiny-llama" and lens.model_fingerprint == tiny().fingerprint()
    for layer in lens.source_layers:
        expected = sum(per_prompt(i).jacobians[layer].double() for i in counted) / len(counted)
        torch.testing.assert_close(lens.jacobians[layer], expected.float(), rtol=1e-6, atol=1e-7)
    # progress: once per prompt, in order; the skipped one says so and why
    assert [e.prompt_index for e in events] == list(range(6))
    assert [e.n_done for e in events] == [1, 2, 2, 3, 4, 5]
    assert [e.next_idx for e in events] == [1, 2, 3, 4, 5, 6]
    assert all(e.n_total == 6 for e in events)
    skipped = events[2]
    assert skipped.skipped and "no valid position" in skipped.reason and skipped.records == []
    assert not any(e.skipped for e in events if e.prompt_index != 2)


def test_diagnostics_one_record_per_prompt_and_layer():
    streamed: list[dict] = []
    lens = fit(tiny(), PROMPTS, progress=lambda e: streamed.extend(e.records), **SETTINGS)
    records = lens.diagnostics
    assert records == streamed
    counted = [i for i in range(len(PROMPTS)) if i != 2]
    assert [(r["prompt_index"], r["layer"]) for r in records] == [(i, k) for i in counted for k in (0, 1, 2)]
    fields = {"prompt_index", "layer", "seq_len", "n_valid", "seconds", "jacobian_norm", "rel_change"}
    d = 32
    for layer in (0, 1, 2):
        sum_before = None
        for n, (idx, rec) in enumerate(zip(counted, [r for r in records if r["layer"] == layer])):
            assert fields <= set(rec)
            result = per_prompt(idx)
            jac = result.jacobians[layer].double()
            assert rec["seq_len"] == result.seq_len and rec["n_valid"] == result.seq_len - 1 - 2
            assert rec["seconds"] >= 0
            assert rec["jacobian_norm"] == pytest.approx(float(jac.norm()) / math.sqrt(d), rel=1e-5)
            if n == 0:
                assert rec["rel_change"] is None  # undefined for the first prompt
                sum_before = jac.clone()
                continue
            mean_before = sum_before / n
            expected = float((jac - mean_before).norm() / ((n + 1) * mean_before.norm()))
            assert rec["rel_change"] == pytest.approx(expected, rel=1e-4)
            assert rec["rel_change"] > 0
            sum_before += jac
    assert records[0]["seq_len"] == 16 and records[0]["n_valid"] == 13  # truncated to max_seq_len


def test_max_rel_change_is_reported_per_prompt():
    events: list[FitProgress] = []
    fit(tiny(), PROMPTS[:3], progress=events.append, **SETTINGS)
    assert events[0].max_rel_change is None
    assert events[1].max_rel_change == pytest.approx(max(r["rel_change"] for r in events[1].records))


def test_zero_usable_prompts_is_an_error():
    with pytest.raises(ValueError, match=r"No prompt counted: all 2 prompts were skipped .*at least 4 tokens"):
        fit(tiny(), [SHORT, "Hey"], **SETTINGS)
    with pytest.raises(ValueError, match="No prompt counted"):
        fit(tiny(), [], **SETTINGS)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"source_layers": [7]}, r"source layer 7 is out of range"),
    ({"source_layers": []}, r"source_layers is empty"),
    ({"source_layers": [0, 2], "target_layer": 2}, r"source layer 2 .*not below the target layer 2"),
    ({"target_layer": -9}, r"target_layer=-9 is out of range"),
    ({"checkpoint_every": 0}, r"checkpoint_every=0"),
    # settings errors are not mistaken for too-short prompts
    ({"dim_batch": 0}, r"dim_batch=0 must be an integer >= 1"),
    ({"method": "naive"}, r"method='naive' is not one of"),
    ({"skip_first": -1}, r"skip_first=-1 must be >= 0"),
    ({"max_seq_len": 1}, r"max_seq_len=1 must be at least 2"),
])
def test_bad_settings_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fit(tiny(), PROMPTS[:1], **{**SETTINGS, **kwargs})


def test_negative_layer_indices_resolve():
    lens = fit(tiny(), PROMPTS[:2], source_layers=[-3, -2, -3], target_layer=-1, **SETTINGS)
    assert lens.source_layers == [1, 2] and lens.target_layer == 3
    whole = fit(tiny(), PROMPTS[:2], **SETTINGS)
    for layer in (1, 2):
        torch.testing.assert_close(lens.jacobians[layer], whole.jacobians[layer], rtol=1e-6, atol=1e-7)


def test_should_stop_ends_the_fit_early_and_is_recorded():
    lens = fit(tiny(), PROMPTS, should_stop=lambda state: "enough" if state.n_done >= 2 else None, **SETTINGS)
    assert lens.n_prompts == 2 and lens.stop_reason == "enough"


# -- sharding -------------------------------------------------------------------------------------
def test_merge_of_shards_equals_one_fit(tmp_path):
    shards = [fit(tiny(), PROMPTS[:2], **SETTINGS), fit(tiny(), PROMPTS[2:5], **SETTINGS),
              fit(tiny(), PROMPTS[5:], **SETTINGS)]
    assert [s.n_prompts for s in shards] == [2, 2, 1]
    paths = [s.save(tmp_path / f"shard{i}.safetensors") for i, s in enumerate(shards)]
    merged = JacobianLens.merge([JacobianLens.load(p) for p in paths])
    assert_same_lens(merged, uninterrupted())
    assert len(merged.diagnostics) == len(uninterrupted().diagnostics) == 5 * 3
    assert merged.target_layer == 3 and merged.model_fingerprint == tiny().fingerprint()
    assert merged.record.n_skipped == uninterrupted().record.n_skipped == 1  # the short one, shard 2


# -- checkpoints and resume --------------------------------------------------------------------------
def test_checkpoint_records_the_settings_and_is_written_atomically(tmp_path):
    ckpt = tmp_path / "run" / "fit.ckpt"
    lens = fit(tiny(), PROMPTS, checkpoint_path=ckpt, checkpoint_every=2, **SETTINGS)
    assert_same_lens(lens, uninterrupted(), rtol=0, atol=0)
    assert os.listdir(ckpt.parent) == ["fit.ckpt"]  # no temp file left behind
    payload = read_checkpoint(ckpt)
    assert payload["next_idx"] == 6 and payload["n_done"] == 5 and payload["n_skipped"] == 1
    settings = payload["settings"]
    assert set(CHECKPOINT_SETTINGS) <= set(settings)
    assert settings["source_layers"] == [0, 1, 2] and settings["target_layer"] == 3
    assert settings["skip_first"] == 2 and settings["max_seq_len"] == 16
    assert settings["model_fingerprint"] == tiny().fingerprint()
    # a finished checkpoint resumes to the same lens without redoing any prompt
    calls = []
    again = fit(tiny(), PROMPTS, checkpoint_path=ckpt, progress=calls.append, **SETTINGS)
    assert calls == [] and again.diagnostics == lens.diagnostics
    assert_same_lens(again, lens, rtol=0, atol=0)


class Interrupt(Exception):
    pass


def test_skipped_prompt_is_not_redone_on_resume(tmp_path):
    ckpt = tmp_path / "fit.ckpt"
    first: list[FitProgress] = []

    def crash_at_3(event):
        if event.prompt_index == 3:
            raise Interrupt
        first.append(event)

    with pytest.raises(Interrupt):
        fit(tiny(), PROMPTS, checkpoint_path=ckpt, progress=crash_at_3, **SETTINGS)
    assert [(e.prompt_index, e.skipped) for e in first] == [(0, False), (1, False), (2, True)]
    payload = read_checkpoint(ckpt)
    # progress is reported once the checkpoint holds the prompt: the crash in prompt 3's report lost nothing
    assert (payload["next_idx"], payload["n_done"], payload["n_skipped"]) == (4, 3, 1)

    second: list[FitProgress] = []
    lens = fit(tiny(), PROMPTS, checkpoint_path=ckpt, progress=second.append, **SETTINGS)
    assert [e.prompt_index for e in second] == [4, 5]  # neither the skipped prompt 2 nor the ones before
    assert [e.n_done for e in second] == [4, 5]
    assert lens.record.n_skipped == 1
    assert [r["prompt_index"] for r in lens.diagnostics] == [r["prompt_index"] for r in uninterrupted().diagnostics]
    assert_same_lens(lens, uninterrupted())


@pytest.mark.parametrize(("base", "change", "message"), [
    ({}, {"skip_first": 3}, "made with skip_first=2, this fit asks for skip_first=3"),
    ({}, {"max_seq_len": 20}, "made with max_seq_len=16, this fit asks for max_seq_len=20"),
    ({}, {"source_layers": [0, 1]}, r"made with source_layers=\[0, 1, 2\], this fit asks for source_layers=\[0, 1\]"),
    ({"source_layers": [0, 1]}, {"target_layer": 2}, "made with target_layer=3, this fit asks for target_layer=2"),
])
def test_resume_with_other_settings_names_the_setting(tmp_path, base, change, message):
    ckpt = tmp_path / "fit.ckpt"
    fit(tiny(), PROMPTS[:2], checkpoint_path=ckpt, **SETTINGS, **base)
    with pytest.raises(ValueError, match=message + ".*resume=False"):
        fit(tiny(), PROMPTS[:2], checkpoint_path=ckpt, **{**SETTINGS, **base, **change})
    # starting over is possible
    lens = fit(tiny(), PROMPTS[:2], checkpoint_path=ckpt, resume=False, **{**SETTINGS, **base, **change})
    saved = read_checkpoint(ckpt)["settings"]
    assert saved["source_layers"] == lens.source_layers and saved["target_layer"] == lens.target_layer
    assert all(saved[key] == value for key, value in change.items())


def test_resume_with_another_model_or_prompt_list_fails(tmp_path):
    ckpt = tmp_path / "fit.ckpt"
    fit(tiny(), PROMPTS[:2], checkpoint_path=ckpt, **SETTINGS)
    with pytest.raises(ValueError, match=r"made with model_fingerprint=another model"):
        fit(tiny("llama", seed=1), PROMPTS[:2], checkpoint_path=ckpt, **SETTINGS)
    with pytest.raises(ValueError, match=r"made on another prompt list"):
        fit(tiny(), PROMPTS[1:3], checkpoint_path=ckpt, **SETTINGS)
    (tmp_path / "junk.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"(?s)Cannot read the checkpoint .*resume=False"):
        fit(tiny(), PROMPTS[:2], checkpoint_path=tmp_path / "junk.ckpt", **SETTINGS)


CHILD = textwrap.dedent("""
    import json, sys, time
    sys.path[:0] = [{tests!r}, {repo!r}]
    import torch
    torch.set_num_threads(1)
    from conftest import make_tiny
    from jlens_core import fit

    args = json.load(open(sys.argv[1]))

    def slow(event):  # give the parent time to kill us; never reach the end on our own
        time.sleep(0.1 if event.prompt_index < 3 else 600)

    fit(make_tiny("llama", seed=0), args["prompts"], checkpoint_path=args["checkpoint"], progress=slow,
        **args["settings"])
    print("FINISHED", flush=True)
""")


def test_fit_killed_mid_run_and_resumed_equals_uninterrupted(tmp_path):
    ckpt = tmp_path / "fit.ckpt"
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=str(TESTS_DIR), repo=str(REPO)))
    (tmp_path / "args.json").write_text(json.dumps({"prompts": PROMPTS, "checkpoint": str(ckpt),
                                                    "settings": SETTINGS}))
    child = subprocess.Popen([sys.executable, str(script), str(tmp_path / "args.json")],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            if child.poll() is not None:
                pytest.fail(f"the child ended on its own: {child.stdout.read().decode()[-2000:]}")
            if ckpt.exists() and read_checkpoint(ckpt)["next_idx"] >= 2:
                break
            if time.monotonic() > deadline:
                pytest.fail("the child made no checkpoint in time")
            time.sleep(0.02)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    out = child.stdout.read().decode()
    assert child.returncode == -signal.SIGKILL and "FINISHED" not in out
    payload = read_checkpoint(ckpt)
    assert 2 <= payload["next_idx"] < len(PROMPTS)

    resumed_events: list[FitProgress] = []
    lens = fit(tiny(), PROMPTS, checkpoint_path=ckpt, progress=resumed_events.append, **SETTINGS)
    assert [e.prompt_index for e in resumed_events] == list(range(payload["next_idx"], len(PROMPTS)))
    assert_same_lens(lens, uninterrupted())  # bitwise equal here; allow fp32 noise
    assert lens.record.n_skipped == 1
    assert [(r["prompt_index"], r["layer"]) for r in lens.diagnostics] == [
        (r["prompt_index"], r["layer"]) for r in uninterrupted().diagnostics]
    for got, want in zip(lens.diagnostics, uninterrupted().diagnostics):
        assert got["jacobian_norm"] == pytest.approx(want["jacobian_norm"], rel=1e-6)
        assert (got["rel_change"] is None) == (want["rel_change"] is None)


def test_checkpoint_rebuilt_from_a_saved_lens_resumes_the_fit(tmp_path):
    from jlens_core.fitting.fit import checkpoint_from_lens

    partial = fit(tiny(), PROMPTS[:3], **SETTINGS)  # prompt 2 is skipped: the rebuilt fit goes on at 3
    partial.save(tmp_path / "partial.safetensors")
    ckpt = tmp_path / "rebuilt.ckpt"
    assert checkpoint_from_lens(JacobianLens.load(tmp_path / "partial.safetensors"), PROMPTS, ckpt) == 3
    events: list[FitProgress] = []
    lens = fit(tiny(), PROMPTS, checkpoint_path=ckpt, progress=events.append, **SETTINGS)
    assert [e.prompt_index for e in events] == [3, 4, 5]
    assert lens.record.n_skipped == 1
    assert_same_lens(lens, uninterrupted(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"counted 3 prompts .* only 2 were given"):
        checkpoint_from_lens(partial, PROMPTS[:2], tmp_path / "other.ckpt")
    with pytest.raises(ValueError, match=r"made on another prompt list"):
        fit(tiny(), PROMPTS[1:], checkpoint_path=ckpt, **SETTINGS)
