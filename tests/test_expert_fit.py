"""Expert Jacobians fitted in the same backward passes (issue #32 §2, docs/method.md §9.1 experts).

The per-expert sums are checked against an independent per-position computation
(``torch.autograd.functional.jacobian`` of the whole prompt, routed by hand), on every estimator method;
a fit's experts against its own per-prompt Jacobians; resume, settings and errors.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import LONG_TEXT
from helpers import tiny
from test_estimator import full_jacobian

from jlens_core import ExpertLens, JacobianLens, fit
from jlens_core.fitting import fit as fit_module
from jlens_core.fitting.estimator import jacobian_for_prompt
from jlens_core.fitting.expert_clusters import collect_residuals, fit_clustering
from jlens_core.fitting.fused import fused_backward, prepare_layers
from jlens_core.fitting.routing import one_hot_routes

SEQ, SKIP, E = 14, 3, 3
PROMPTS = [
    LONG_TEXT,
    "The capital of Italy is Rome. Water boils at one hundred degrees, and numbers like 12 appear.",
    "Hi",  # no valid position with skip_first=2: skipped, in the clustering pass too
    "def add(a, b):\n    return a + b\n# Once upon a time there was a small model that read every layer.",
    "Numbers like 12, 345 and 6789 appear in text; so do symbols: #, @, %, & and *. The end.",
]
SETTINGS = {"skip_first": 2, "max_seq_len": 16, "dim_batch": 16}


@functools.cache
def _ids() -> torch.Tensor:
    return tiny().encode(LONG_TEXT, max_length=SEQ)


@functools.cache
def _clustering() -> dict:
    """Clusters of this prompt's own kept positions (E = 3), per layer."""
    model = tiny()
    sources = list(range(model.n_layers - 1))
    residuals = collect_residuals(model, [_ids()[0].tolist()], sources, skip_first=SKIP, max_seq_len=SEQ)
    return {layer: fit_clustering(residuals[layer], experts=E, components=8, layer=layer) for layer in sources}


@functools.cache
def _reference(source: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sums [E, d, d], counts [E])`` by hand: every position's row block from the full Jacobian, routed."""
    model = tiny()
    ids = _ids()
    target = model.n_layers - 1
    full = full_jacobian(model.hf_model, model.layers, ids, source, target).double()  # [S, d, S, d]
    valid = list(range(SKIP, ids.shape[1] - 1))
    residuals = collect_residuals(model, [ids[0].tolist()], [source], skip_first=SKIP, max_seq_len=SEQ)[source]
    route = _clustering()[source].assign(residuals)
    d = model.d_model
    sums = torch.zeros(E, d, d, dtype=torch.float64)
    for k, p in enumerate(valid):
        block = sum(full[p_t, :, p, :] for p_t in valid)  # G_p: [d rows, d]
        sums[int(route[k])] += block
    return sums, torch.bincount(route, minlength=E)


def _check_against_reference(sums: dict, counts: dict | None) -> None:
    for layer in range(tiny().n_layers - 1):
        want, want_counts = _reference(layer)
        assert want_counts.min() > 0  # every expert has positions: the comparison tests the routing
        rel = float((sums[layer].double() - want).norm() / want.norm())
        assert rel < 1e-5, (layer, rel)
        if counts is not None:
            assert counts[layer].tolist() == want_counts.tolist()


@pytest.mark.parametrize("method", ["batched", "replicated", "fused"])
def test_routed_sums_match_an_independent_per_position_computation(method):
    result = jacobian_for_prompt(tiny(), _ids(), skip_first=SKIP, max_seq_len=SEQ, dim_batch=5, method=method,
                                 clustering=_clustering())
    assert result.expert_sums is not None and result.expert_counts is not None
    _check_against_reference(result.expert_sums, result.expert_counts)
    # the pooled matrices are unchanged by routing
    plain = jacobian_for_prompt(tiny(), _ids(), skip_first=SKIP, max_seq_len=SEQ, dim_batch=5, method=method)
    for layer, mat in plain.jacobians.items():
        assert torch.equal(result.jacobians[layer], mat)
    assert plain.expert_sums is None


@pytest.mark.parametrize("layer_major", [True, False])
def test_both_fused_orders_route_alike(layer_major):
    model = tiny()
    sources, target = list(range(model.n_layers - 1)), model.n_layers - 1
    prep = prepare_layers(model, _ids(), sources[0], target, SKIP)
    like = prep.like
    routes = {layer: one_hot_routes(_clustering()[layer].assign(prep.residuals[layer]), E, like) for layer in sources}
    sums = {layer: torch.zeros(E, model.d_model, model.d_model) for layer in sources}
    fused_backward(model, prep, sources, target, 5, layer_major=layer_major, routes=routes, expert_sums=sums)
    _check_against_reference(sums, None)


@pytest.mark.parametrize("family", ["gemma2", "gpt2", "gpt_neox", "phi"])
@pytest.mark.parametrize("layer_major", [True, False])
def test_fused_routing_equals_autograd_routing_in_other_families(family, layer_major):
    # norms, GELU MLPs, parallel residuals: the fused backward's routed sums are autograd's ("batched")
    model = tiny(family)
    ids = model.encode(LONG_TEXT, max_length=SEQ)
    sources, target = list(range(model.n_layers - 1)), model.n_layers - 1
    prep = prepare_layers(model, ids, sources[0], target, SKIP)
    clustering = {layer: fit_clustering(prep.residuals[layer], experts=E, components=8, layer=layer) for layer in sources}
    routes = {layer: one_hot_routes(clustering[layer].assign(prep.residuals[layer]), E, prep.like) for layer in sources}
    sums = {layer: torch.zeros(E, model.d_model, model.d_model) for layer in sources}
    fused_backward(model, prep, sources, target, 5, layer_major=layer_major, routes=routes, expert_sums=sums)
    want = jacobian_for_prompt(model, ids, skip_first=SKIP, max_seq_len=SEQ, dim_batch=5, method="batched",
                               clustering=clustering).expert_sums
    assert want is not None
    for layer in sources:
        assert float((sums[layer] - want[layer]).norm() / want[layer].norm()) < 1e-5, layer


@functools.cache
def _expert_fit(rules: str = "jacobian") -> ExpertLens:
    lens = fit(tiny(), PROMPTS, experts=E, cluster_prompts=3, rules=rules, **SETTINGS)
    assert isinstance(lens, ExpertLens)
    return lens


@pytest.mark.parametrize("rules", ["jacobian", "relevance"])
def test_count_weighted_experts_equal_the_pooled_position_sum_of_the_same_fit(rules):
    lens = _expert_fit(rules)
    assert lens.kind == f"{rules}-experts" and lens.n_experts == E and lens.n_prompts == 4
    per_prompt = [jacobian_for_prompt(tiny(), p, rules=rules, **SETTINGS) for i, p in enumerate(PROMPTS) if i != 2]
    for layer in lens.source_layers:
        # sum_e #e J_{l,e} = sum over prompts of n_valid * J_l^prompt = sum over every position of G_p
        got = (lens.experts[layer].double() * lens.counts[layer].double()[:, None, None]).sum(0)
        want = sum(r.jacobians[layer].double() * r.n_valid for r in per_prompt)
        assert float((got - want).norm() / want.norm()) < 1e-6
        assert int(lens.counts[layer].sum()) == sum(r.n_valid for r in per_prompt)
    # the pooled lens is the plain fit's (per-prompt means, averaged over prompts)
    plain = fit(tiny(), PROMPTS, rules=rules, **SETTINGS)
    assert isinstance(plain, JacobianLens)
    for layer in plain.source_layers:
        torch.testing.assert_close(lens.pooled[layer], plain.jacobians[layer], rtol=1e-6, atol=1e-7)
    # every expert has fewer than 50 positions here: each reads with the pooled matrix
    torch.testing.assert_close(lens.expert_matrices(0), lens.pooled[0].expand(E, -1, -1))


def test_expert_fit_resumes_exactly_from_its_checkpoint(tmp_path, monkeypatch):
    whole = _expert_fit()
    ckpt = tmp_path / "fit.ckpt"
    first = fit(tiny(), PROMPTS[:3], experts=E, cluster_prompts=3, checkpoint_path=ckpt, **SETTINGS)
    assert isinstance(first, ExpertLens)
    saved = torch.load(ckpt, weights_only=True)
    assert set(saved["clustering"]) == {str(layer) for layer in first.source_layers}

    def no_reclustering(*args, **kwargs):
        raise AssertionError("a resumed expert fit must use its checkpoint's clustering")

    monkeypatch.setattr(fit_module, "cluster_source_layers", no_reclustering)
    resumed = fit(tiny(), PROMPTS, experts=E, cluster_prompts=3, checkpoint_path=ckpt, **SETTINGS)
    assert isinstance(resumed, ExpertLens) and resumed.n_prompts == whole.n_prompts
    for layer in whole.source_layers:
        assert resumed.clustering[layer].same_as(whole.clustering[layer])
        assert torch.equal(resumed.counts[layer], whole.counts[layer])
        torch.testing.assert_close(resumed.experts[layer], whole.experts[layer], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(resumed.pooled[layer], whole.pooled[layer], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="cluster_prompts=3, this fit asks for cluster_prompts=2"):
        fit(tiny(), PROMPTS, experts=E, cluster_prompts=2, checkpoint_path=ckpt, **SETTINGS)
    with pytest.raises(ValueError, match="experts=3, this fit asks for experts=0"):
        fit(tiny(), PROMPTS, checkpoint_path=ckpt, **SETTINGS)


def test_expert_fit_file_roundtrip(tmp_path):
    lens = _expert_fit()
    back = ExpertLens.load(lens.save(tmp_path / "experts.safetensors"))
    assert back.fit_settings.experts == E and back.fit_settings.cluster_prompts == 3
    for layer in lens.source_layers:
        assert torch.equal(back.experts[layer], lens.experts[layer])
        assert back.clustering[layer].same_as(lens.clustering[layer])


def test_more_experts_than_positions_is_one_sentence():
    with pytest.raises(ValueError, match=r"saw \d+ positions, fewer than experts=500: give more cluster prompts"):
        fit(tiny(), PROMPTS[:2], experts=500, cluster_prompts=2, **SETTINGS)


@pytest.mark.parametrize(("kwargs", "match"), [({"experts": -1}, "experts=-1 must be an integer >= 0"),
                                               ({"experts": 2, "cluster_prompts": 0}, "cluster_prompts=0 must be")])
def test_bad_expert_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fit(tiny(), PROMPTS, **kwargs, **SETTINGS)


# -- the command line: jlens fit --experts, jlens merge, torchrun ------------------------------------
@pytest.fixture(scope="module")
def cli_work(tmp_path_factory):
    from conftest import CORPUS, save_tiny

    root = tmp_path_factory.mktemp("expert-cli")
    model_dir = root / "tiny-llama"
    save_tiny(model_dir)
    words = CORPUS.split()
    texts = [" ".join(words[(7 * i + j) % len(words)] for j in range(30)) for i in range(12)]
    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(texts) + "\n", encoding="utf-8")
    return {"root": root, "model": str(model_dir), "corpus": str(corpus)}


def _cli_fit_args(work, out, *extra) -> list[str]:
    return ["fit", "--model", work["model"], "--corpus", work["corpus"], "--out", str(out), "--min-chars", "0",
            "--split", "all", "--max-seq-len", "24", "--skip-first", "4", "--no-progress", "--n-prompts", "7", *extra]


def _cli_expert_fit(work) -> ExpertLens:
    from jlens_core.cli.main import main

    out = work["root"] / "experts.safetensors"
    if not out.exists():
        assert main(_cli_fit_args(work, out, "--experts", "2", "--cluster-prompts", "3")) == 0
    return ExpertLens.load(out)


def test_cli_fit_experts_writes_an_expert_lens_whose_pooled_lens_is_the_plain_fit(cli_work):
    from jlens_core.cli.main import main

    lens = _cli_expert_fit(cli_work)
    assert lens.n_experts == 2 and lens.fit_settings.cluster_prompts == 3 and lens.n_prompts == 7
    plain_out = cli_work["root"] / "plain.safetensors"
    assert main(_cli_fit_args(cli_work, plain_out)) == 0
    plain = JacobianLens.load(plain_out)
    for layer in plain.source_layers:
        torch.testing.assert_close(lens.pooled[layer], plain.jacobians[layer], rtol=1e-6, atol=1e-7)
    # jlens merge of an expert lens with itself: the sums and counts double, the means stay
    merged_out = cli_work["root"] / "merged.safetensors"
    assert main(["merge", str(cli_work["root"] / "experts.safetensors"), str(cli_work["root"] / "experts.safetensors"),
                 "--out", str(merged_out)]) == 0
    merged = ExpertLens.load(merged_out)
    assert merged.n_prompts == 14 and torch.equal(merged.counts[0], 2 * lens.counts[0])
    torch.testing.assert_close(merged.experts[1], lens.experts[1])


@pytest.mark.slow
def test_torchrun_two_ranks_expert_fit_equals_one_process(cli_work, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    exe = Path(sys.executable).with_name("torchrun")
    launcher = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    out = tmp_path / "sharded.safetensors"
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(repo),
           "GLOO_SOCKET_IFNAME": "lo"}  # the ranks talk over loopback only
    proc = subprocess.run([*launcher, "--standalone", "--nproc-per-node", "2", "-m", "jlens_core",
                           *_cli_fit_args(cli_work, out, "--experts", "2", "--cluster-prompts", "3",
                                          "--checkpoint-every", "2")],
                          check=False, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sharded, one = ExpertLens.load(out), _cli_expert_fit(cli_work)
    assert sharded.n_prompts == one.n_prompts
    for layer in one.source_layers:
        assert sharded.clustering[layer].same_as(one.clustering[layer])
        assert torch.equal(sharded.counts[layer], one.counts[layer])
        torch.testing.assert_close(sharded.experts[layer], one.experts[layer], rtol=1e-6, atol=1e-7)
