"""Split halves (issue #42 §1, docs/method.md §3.3): a fit keeps the even and odd prompts' sums apart; the halves
survive files, checkpoints, resume, merges of slices and torchrun exactly as one uninterrupted fit has them.

Every check is against an independent computation: the per-prompt Jacobians of test_fit (``per_prompt``) summed by
hand, or one uninterrupted fit of the whole list.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import cli_fit_cache, tiny
from safetensors import safe_open
from test_cli_fit import REPO, fit_args, make_texts, sub_env, torchrun_cmd, write_corpus
from test_fit import PROMPTS, SETTINGS, per_prompt, uninterrupted

from jlens_core import ExpertLens, FitPlan, JacobianLens, fit
from jlens_core.fitting.fit import checkpoint_from_lens, read_checkpoint

DATA = Path(__file__).resolve().parent / "data"
SKIPPED = 2  # PROMPTS[2] has no valid position
EVEN, ODD = [0, 4], [1, 3, 5]  # the counted prompts of each half (by their index in PROMPTS)
TIGHT = {"rtol": 1e-6, "atol": 1e-7}


def by_hand(indices: list[int], layer: int) -> torch.Tensor:
    return (sum(per_prompt(i).jacobians[layer].double() for i in indices) / len(indices)).float()


def assert_same_halves(a, b, **tol) -> None:
    ha, hb = a.halves(), b.halves()
    assert ha is not None and hb is not None
    for x, y in zip(ha, hb):
        assert type(x) is type(y) and x.n_prompts == y.n_prompts and x.source_layers == y.source_layers
        for layer in x.source_layers:
            if isinstance(x, ExpertLens):
                assert torch.equal(x.counts[layer], y.counts[layer])
                torch.testing.assert_close(x.experts[layer], y.experts[layer], **(tol or TIGHT))
                torch.testing.assert_close(x.pooled[layer], y.pooled[layer], **(tol or TIGHT))
            else:
                torch.testing.assert_close(x.jacobians[layer], y.jacobians[layer], **(tol or TIGHT))


@functools.cache
def expert_fit() -> ExpertLens:
    lens = fit(tiny(), PROMPTS, experts=2, cluster_prompts=3, **SETTINGS)
    assert isinstance(lens, ExpertLens)
    return lens


# -- what the halves are -----------------------------------------------------------------------------------
def test_halves_are_the_means_of_the_even_and_the_odd_prompts():
    lens = uninterrupted()
    halves = lens.halves()
    assert halves is not None
    even, odd = halves
    assert type(even) is type(odd) is JacobianLens and (even.n_prompts, odd.n_prompts) == (2, 3)
    assert lens.half_prompts == (2, 3) == lens.record.half_prompts and lens.fit_plan.halves
    assert even.source_layers == odd.source_layers == lens.source_layers and even.rules == lens.rules
    for layer in lens.source_layers:
        torch.testing.assert_close(even.jacobians[layer], by_hand(EVEN, layer), **TIGHT)
        torch.testing.assert_close(odd.jacobians[layer], by_hand(ODD, layer), **TIGHT)
    # the lens itself is unchanged by keeping them: the mean of all five
    for layer in lens.source_layers:
        torch.testing.assert_close(lens.jacobians[layer], by_hand(EVEN + ODD, layer), **TIGHT)


def test_half_diagnostics_per_layer_and_the_predicted_standard_error():
    lens = uninterrupted()
    table = lens.half_diagnostics()
    assert list(table["layer"]) == lens.source_layers
    for row in table.itertuples():
        e, o, m = by_hand(EVEN, row.layer).double(), by_hand(ODD, row.layer).double(), lens.jacobians[row.layer].double()
        rel = float((e - o).norm() / m.norm())
        assert row.half_rel_diff == pytest.approx(rel, rel=1e-5)
        # SE of the mean of n prompts from two independent halves: ||e - o|| sqrt(n_e n_o) / n (docs/method.md §3.3)
        assert row.predicted_rel_se == pytest.approx(rel * (2 * 3) ** 0.5 / 5, rel=1e-5)
        assert (row.n_even, row.n_odd) == (2, 3)
    # every prompt's diagnostics say its half and the running halves' difference
    records = [r for r in lens.diagnostics if r["layer"] == 0]
    assert [r["half"] for r in records] == [0, 1, 1, 0, 1]  # prompts 0, 1, 3, 4, 5
    assert records[0]["half_rel_diff"] is None  # the odd half is empty yet
    assert records[-1]["half_rel_diff"] == pytest.approx(float(table["half_rel_diff"].iloc[0]), rel=1e-5)


def test_equal_halves_predict_half_the_relative_difference():
    lens = fit(tiny(), [p for i, p in enumerate(PROMPTS) if i != SKIPPED][:4], **SETTINGS)
    table = lens.half_diagnostics()
    assert (table["predicted_rel_se"] * 2 == table["half_rel_diff"]).all()


def test_a_lens_without_halves_says_so_in_one_sentence(tmp_path):
    lens = fit(tiny(), PROMPTS, plan=FitPlan(dim_batch=16, halves=False), skip_first=2, max_seq_len=16)
    assert lens.halves() is None and lens.half_prompts is None and not lens.fit_plan.halves
    assert all("half" not in r for r in lens.diagnostics)
    with pytest.raises(ValueError, match=r"^This lens keeps no split halves .*docs/method.md §3.3\)\.$"):
        lens.half_diagnostics()
    for layer in lens.source_layers:  # the same lens
        assert torch.equal(lens.jacobians[layer], uninterrupted().jacobians[layer])
    one = fit(tiny(), PROMPTS[:1], **SETTINGS)  # one prompt: the odd half is empty, so no halves to read
    assert one.halves() is None and one.half_prompts == (1, 0)


def test_with_halves_adds_a_refits_halves_to_a_lens_kept_bit_for_bit():
    bare = fit(tiny(), PROMPTS, plan=FitPlan(dim_batch=16, halves=False), skip_first=2, max_seq_len=16)
    refit = uninterrupted()
    given = bare.with_halves(refit.raw_halves)
    assert given.half_prompts == refit.half_prompts and given.canary is bare.canary
    assert given.diagnostics == bare.diagnostics and given.n_prompts == bare.n_prompts
    for layer in bare.source_layers:
        assert torch.equal(given.jacobians[layer], bare.jacobians[layer])
        assert torch.equal(given.halves()[0].jacobians[layer], refit.halves()[0].jacobians[layer])
    assert bare.with_halves(None).halves() is None
    with pytest.raises(ValueError, match="halves must be two JacobianLens"):
        bare.with_halves((refit.halves()[0],))  # one lens is not a pair


def test_relevance_and_expert_lenses_have_halves_of_their_own_class():
    r_lens = fit(tiny(), PROMPTS, rules="relevance", **SETTINGS)
    r_halves = r_lens.halves()
    assert r_halves is not None and all(h.rules == "relevance" and h.kind == "relevance" for h in r_halves)
    lens = expert_fit()
    halves = lens.halves()
    assert halves is not None and all(type(h) is ExpertLens for h in halves)
    plain = uninterrupted().halves()
    assert plain is not None
    for h, p in zip(halves, plain):
        assert h.n_experts == lens.n_experts and h.n_prompts == p.n_prompts
        for layer in lens.source_layers:
            assert h.clustering[layer].same_as(lens.clustering[layer])
            torch.testing.assert_close(h.pooled[layer], p.jacobians[layer], **TIGHT)  # pooled half = J half
    for layer in lens.source_layers:  # each position lands in one half: the halves' counts add up, and so do sums
        assert torch.equal(halves[0].counts[layer] + halves[1].counts[layer], lens.counts[layer])
        sums = sum(h.experts[layer].double() * h.counts[layer].double()[:, None, None] for h in halves)
        torch.testing.assert_close(sums / lens.counts[layer].double().clamp_min(1)[:, None, None],
                                   lens.experts[layer].double(), rtol=1e-6, atol=1e-7)
    # the J lens made of an expert lens, and its pooled lens, keep halves too
    assert lens.to_jacobian_lens().halves() is not None and lens.pooled_lens().halves() is not None
    assert lens.with_weights({layer: torch.ones(2) for layer in lens.source_layers}).halves()[0].weights is not None


# -- files ---------------------------------------------------------------------------------------------
def test_lens_file_keeps_the_halves_as_extra_tensors(tmp_path):
    lens = uninterrupted()
    path = lens.save(tmp_path / "lens.safetensors")
    back = JacobianLens.load(path)
    assert back.half_prompts == (2, 3)
    assert_same_halves(back, lens, rtol=0, atol=0)  # fp32: exact
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["jlens"])
        keys = set(f.keys())
    assert meta["halves"] == {"prefix": "half.", "names": ["even", "odd"], "n_prompts": [2, 3]}
    from jlens_core.lenses.header import read_header

    assert read_header(path).half_prompts == (2, 3)  # said by the header alone, without the tensors
    assert {f"half.odd.J.{layer}" for layer in lens.source_layers} <= keys
    bare = lens.save(tmp_path / "bare.safetensors", halves=False)
    assert JacobianLens.load(bare).halves() is None and read_header(bare).half_prompts is None
    plain = lens.with_shrinkage(0.0)  # a copy (halves kept) without the fit's canary (docs/method.md §4.2), which on
    plain = plain.replace(canary=None)  # a tiny model weighs as much as its matrices: the ratio is of the matrices and header
    ratio = (plain.save(tmp_path / "plain.safetensors").stat().st_size
             / plain.save(tmp_path / "plain-bare.safetensors", halves=False).stat().st_size)
    assert 2.4 < ratio < 3.1, ratio  # "about 3x": the header (diagnostics, provenance) is the rest
    half16 = JacobianLens.load(lens.save(tmp_path / "fp16.safetensors", dtype="float16"))
    assert half16.halves()[0].jacobians[0].dtype == torch.float32  # stored fp16, read as fp32
    assert_same_halves(half16, lens, rtol=2e-3, atol=1e-4)


def test_expert_lens_file_keeps_its_halves(tmp_path):
    lens = expert_fit()
    back = ExpertLens.load(lens.save(tmp_path / "x.safetensors"))
    assert_same_halves(back, lens, rtol=0, atol=0)
    assert ExpertLens.load(lens.save(tmp_path / "bare.safetensors", halves=False)).halves() is None


def test_files_and_checkpoints_from_before_halves_read_without_them(tmp_path):
    ckpt = tmp_path / "fit.ckpt"
    shutil.copy(DATA / "fit-v1.ckpt", ckpt)
    resumed = fit(tiny(), PROMPTS, checkpoint_path=ckpt, **SETTINGS)
    assert resumed.halves() is None and resumed.half_prompts is None  # its first prompts' halves are unknown


def test_the_shipped_j_lens_carries_the_halves_of_its_own_prompts():
    """scripts/ship_halves.py refitted the shipped lens's 100 prompts with halves: their prompt-weighted mean is
    the shipped lens (to fp16 rounding: both are stored fp16), and the lens keeps its canary."""
    shipped = JacobianLens.load(Path(__file__).resolve().parents[1] / "assets" / "lenses" / "smollm2-135m.safetensors")
    assert shipped.half_prompts == (50, 50) and shipped.n_prompts == 100 and shipped.canary is not None
    even, odd = shipped.halves()
    for layer in shipped.source_layers:
        mean = (even.n_prompts * even.matrix(layer) + odd.n_prompts * odd.matrix(layer)) / shipped.n_prompts
        full = shipped.matrix(layer)
        assert float((mean - full).norm() / full.norm()) < 2e-3, layer
        assert float((even.matrix(layer) - odd.matrix(layer)).norm() / full.norm()) > 1e-3  # two different halves
    table = shipped.half_diagnostics()
    assert table["layer"].tolist() == list(shipped.source_layers) and (table["n_even"] == 50).all()


# -- checkpoints, resume, merge: the halves of one uninterrupted fit ----------------------------------------------
@pytest.mark.parametrize("stop_after", [1, 3, 4])
def test_resumed_fit_has_the_halves_of_one_fit(tmp_path, stop_after):
    ckpt = tmp_path / "fit.ckpt"
    fit(tiny(), PROMPTS[:stop_after], checkpoint_path=ckpt, **SETTINGS)
    payload = read_checkpoint(ckpt)
    assert payload["half_n"] == [sum(1 for i in EVEN if i < stop_after), sum(1 for i in ODD if i < stop_after)]
    lens = fit(tiny(), PROMPTS, checkpoint_path=ckpt, **SETTINGS)
    assert_same_halves(lens, uninterrupted())


def test_checkpoint_rebuilt_from_a_lens_keeps_its_halves(tmp_path):
    partial = JacobianLens.load(fit(tiny(), PROMPTS[:4], **SETTINGS).save(tmp_path / "partial.safetensors"))
    ckpt = tmp_path / "rebuilt.ckpt"
    assert checkpoint_from_lens(partial, PROMPTS, ckpt) == 4
    assert_same_halves(fit(tiny(), PROMPTS, checkpoint_path=ckpt, **SETTINGS), uninterrupted())


@pytest.mark.parametrize("cut", [1, 2, 3, 5])
def test_merged_slices_have_the_halves_of_one_fit(cut):
    """Slices fitted apart know where they start (``first_prompt``): a prompt's half is its parity in the whole list."""
    head = fit(tiny(), PROMPTS[:cut], **SETTINGS)
    tail = fit(tiny(), PROMPTS[cut:], first_prompt=cut, **SETTINGS)
    merged = JacobianLens.merge([head, tail])
    assert merged.half_prompts == (2, 3) and merged.record.provenance.get("first_prompt", 0) == 0
    assert_same_halves(merged, uninterrupted())
    # three slices, one of them a single prompt (one empty half), merge just as well
    parts = [fit(tiny(), PROMPTS[a:b], first_prompt=a, **SETTINGS) for a, b in ((0, 3), (3, 4), (4, 6))]
    assert_same_halves(JacobianLens.merge(parts), uninterrupted())


def test_merge_with_a_lens_without_halves_has_none():
    bare = fit(tiny(), PROMPTS[3:], first_prompt=3, halves=False, **SETTINGS)
    assert JacobianLens.merge([fit(tiny(), PROMPTS[:3], **SETTINGS), bare]).halves() is None


def test_expert_fit_resumed_has_the_halves_of_one_fit(tmp_path):
    ckpt = tmp_path / "x.ckpt"
    fit(tiny(), PROMPTS[:3], experts=2, cluster_prompts=3, checkpoint_path=ckpt, **SETTINGS)
    resumed = fit(tiny(), PROMPTS, experts=2, cluster_prompts=3, checkpoint_path=ckpt, **SETTINGS)
    assert_same_halves(resumed, expert_fit())
    doubled = ExpertLens.merge([expert_fit(), expert_fit()])  # sums and counts of each half add
    assert doubled.half_prompts == (4, 6)
    for h, one in zip(doubled.halves(), expert_fit().halves()):
        assert torch.equal(h.counts[0], 2 * one.counts[0])
        torch.testing.assert_close(h.experts[1], one.experts[1], **TIGHT)


def test_halves_agreement_from_the_records_and_its_figure():
    from jlens_core.figures.fitting import half_agreement_figure
    from jlens_core.fitting.diagnostics import half_agreement_frame

    lens = uninterrupted()
    table = lens.half_diagnostics()
    live = half_agreement_frame(lens.diagnostics)  # what the Fit page reads while the fit runs
    assert list(live["layer"]) == list(table["layer"]) and list(live["n_even"]) == [2] * 3
    for column in ("half_rel_diff", "predicted_rel_se"):
        assert live[column].tolist() == pytest.approx(table[column].tolist(), rel=1e-6)
    fig = half_agreement_figure(table)
    bars, marks = fig.data
    assert list(bars.x) == ["L0", "L1", "L2"] and list(bars.y) == pytest.approx(list(100 * table["half_rel_diff"]))
    assert list(marks.y) == pytest.approx(list(100 * table["predicted_rel_se"]))
    assert "2 + 3 prompts" in fig.layout.title.text
    assert half_agreement_frame([r for r in lens.diagnostics if r["prompt_index"] == 0]).empty  # one half only


# -- the command line: jlens fit --first-prompt / --no-halves, jlens merge, torchrun ---------------------------
@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from conftest import save_tiny

    root = tmp_path_factory.mktemp("cli-halves")
    save_tiny(root / "tiny-llama")
    return {"root": root, "model": str(root / "tiny-llama"), "corpus": str(write_corpus(root / "c.txt", make_texts(12)))}


@pytest.fixture(scope="module")
def reference(work):
    """One uninterrupted in-process CLI fit per prompt count: ``reference(n) -> JacobianLens``."""
    return cli_fit_cache(work, fit_args)


def test_cli_slices_merged_have_the_halves_of_one_cli_fit(work, reference, tmp_path, capsys):
    from jlens_core.cli.main import main

    n, cut = 7, 3
    one = reference(n)
    assert one.half_prompts == (4, 3)
    head, tail, merged = (tmp_path / f"{name}.safetensors" for name in ("head", "tail", "merged"))
    assert main(fit_args(work, head, "--n-prompts", str(cut))) == 0
    assert main(fit_args(work, tail, "--first-prompt", str(cut), "--n-prompts", str(n - cut))) == 0
    assert "kB with its split halves (about 3x" in capsys.readouterr().err
    assert main(["merge", str(head), str(tail), "--out", str(merged)]) == 0
    assert_same_halves(JacobianLens.load(merged), one)
    bare = tmp_path / "bare.safetensors"
    assert main(["merge", str(head), str(tail), "--out", str(bare), "--no-halves"]) == 0
    assert JacobianLens.load(bare).halves() is None
    plain = JacobianLens.load(bare).replace(canary=None)  # both files carry the fits' canary (docs/method.md §4.2): leave its bytes out of the ratio
    canary_bytes = bare.stat().st_size - plain.save(tmp_path / "plain.safetensors", halves=False).stat().st_size
    assert canary_bytes > 0
    # the header (diagnostics) weighs in on a tiny model
    assert bare.stat().st_size - canary_bytes < (merged.stat().st_size - canary_bytes) / 2


def test_cli_fit_no_halves(work, reference, tmp_path):
    from jlens_core.cli.main import main

    out = tmp_path / "bare.safetensors"
    assert main(fit_args(work, out, "--n-prompts", "3", "--no-halves")) == 0
    lens = JacobianLens.load(out)
    assert lens.halves() is None and not lens.fit_plan.halves
    assert max(float((lens.jacobians[k] - reference(3).jacobians[k]).abs().max()) for k in lens.source_layers) == 0


@pytest.mark.slow  # torchrun subprocesses
def test_torchrun_three_ranks_have_the_halves_of_one_fit(work, reference, tmp_path):
    """3 ranks: each reads prompts of both parities (rank r: r, r + 3, ...), synced every 2 steps."""
    n = 8
    out = tmp_path / "sharded.safetensors"
    proc = run_torchrun_n(3, "-m", "jlens_core", *fit_args(work, out, "--n-prompts", str(n), "--checkpoint-every", "2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lens = JacobianLens.load(out)
    assert lens.half_prompts == (4, 4)
    assert_same_halves(lens, reference(n), rtol=1e-6, atol=1e-6)


def run_torchrun_n(nproc: int, *args):
    import subprocess

    return subprocess.run(torchrun_cmd(*args, nproc=nproc), check=False, cwd=REPO, env=sub_env(), capture_output=True,
                          text=True, timeout=300)
