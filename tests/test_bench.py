"""bench/fit_speed.py: its naive estimator (docs/method.md §2 as written) and its port of the reference algorithm agree with every
jacobian_for_prompt method."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import LONG_TEXT, make_tiny
from helpers import load_script

from jlens_core.fitting.estimator import jacobian_for_prompt


@pytest.fixture(scope="module")
def fit_speed():
    return load_script("bench/fit_speed.py")


@pytest.mark.parametrize("method", ["fused", "batched", "replicated"])
def test_plain_estimator_matches_jlens(fit_speed, method):
    model = make_tiny("llama")
    ids = model.encode(LONG_TEXT, max_length=24)
    sources, target = [0, 2], 3
    plain = fit_speed.plain_jacobian_for_prompt(model, ids, sources, target, dim_batch=5, skip_first=4)
    jlens = jacobian_for_prompt(model, ids, source_layers=sources, target_layer=target, dim_batch=7,
                                max_seq_len=24, skip_first=4, method=method).jacobians
    for layer in sources:
        assert plain[layer].abs().max() > 0
        torch.testing.assert_close(jlens[layer], plain[layer], rtol=1e-4, atol=1e-5)


def test_backward_flops_counts_the_remaining_layers(fit_speed):
    model = make_tiny("llama")
    one = fit_speed.backward_flops(model, 24, 4, [2], 3)
    three = fit_speed.backward_flops(model, 24, 4, [0, 2], 3)
    assert three == pytest.approx(3 * one)  # layers 1..3 against layer 3 alone
    cfg = model.config
    saved = model.d_model * 2 * (24 - 1 - 4) * model.d_model * cfg.intermediate_size
    assert fit_speed.backward_flops(model, 24, 4, [2], 3, fused=True) == pytest.approx(one - saved)
    # layer-major: per layer, the MLP's 3 products per row replaced by forming and applying a d x d
    # matrix per position; at the target only the forming (the cotangents there are one-hot)
    n, d, ff = 24 - 1 - 4, model.d_model, cfg.intermediate_size
    mlp_rows = d * 2 * n * 3 * d * ff
    formed, applied = 4 * n * d * d * ff, 2 * n * d ** 3
    assert fit_speed.backward_flops(model, 24, 4, [0, 2], 3, fused=True, layer_major=True) == pytest.approx(
        three - 3 * mlp_rows + 3 * formed + 2 * applied)


def test_reference_algorithm_matches_the_definition(fit_speed):
    """The port of the reference's own algorithm (one replicated forward, graph reused) gives docs/method.md §2's numbers."""
    model = make_tiny("llama")
    ids = model.encode(LONG_TEXT, max_length=24)
    sources, target = [0, 2], 3
    reference = fit_speed.reference_jacobian_for_prompt(model, ids, sources, target, dim_batch=6, skip_first=4)
    naive = fit_speed.plain_jacobian_for_prompt(model, ids, sources, target, dim_batch=5, skip_first=4)
    for layer in sources:
        assert reference[layer].abs().max() > 0
        torch.testing.assert_close(reference[layer], naive[layer], rtol=1e-4, atol=1e-5)
    # its FLOPs: every position of the full sequence, no causal savings
    assert fit_speed.reference_flops(model, 24, [0], 3) > fit_speed.backward_flops(model, 24, 4, [0], 3)


def test_every_family_of_the_families_table_takes_the_fused_path(fit_speed):
    # --families compares the fused backward with autograd: each random model must really be fused
    from jlens_core.fitting.fused import fused_unsupported_reason

    for family in fit_speed.FAMILIES:
        model = fit_speed.random_family_model(family, 32, 2, torch.float32, "cpu")
        assert model.config.model_type == family
        assert fused_unsupported_reason(model) is None, family


@pytest.fixture(scope="module")
def large_model():
    return load_script("bench/large_model.py")


def test_layer_split_map_cuts_the_layers_in_order_and_keeps_tied_weights_together(large_model):
    mapping = large_model.layer_split_map(["cpu", "cuda:0"], 16)
    assert [mapping[f"model.layers.{i}"] for i in range(16)] == ["cpu"] * 8 + ["cuda:0"] * 8
    assert mapping["model.embed_tokens"] == mapping["lm_head"] == mapping["model.norm"] == "cuda:0"
    three = large_model.layer_split_map(["cuda:0", "cuda:1", "cpu"], 5, tied=False)
    assert [three[f"model.layers.{i}"] for i in range(5)] == ["cuda:0", "cuda:0", "cuda:1", "cpu", "cpu"]
    assert three["model.embed_tokens"] == "cuda:0" and three["lm_head"] == "cpu"


def test_multi_device_row_runs_on_the_cpu_with_a_cpu_only_map(large_model, tmp_path):
    # bench/gpu.sh's multi-device row, on a small random model whose map names the CPU twice
    out = tmp_path / "multi.json"
    large_model.main(["--device-map", "cpu,cpu", "--d-model", "64", "--layers", "4", "--vocab", "49152",
                      "--budget-seq", "24", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["layers_per_device"] == {"cpu": 4} and result["measured_on_gpu"] is False
    steps = [row["step"] for row in result["rows"]]
    assert steps[0] == "build on the CPU and place" and steps[-1].startswith("one fit prompt, seq 24, layers 1..2 -> 3")
    assert all(row["seconds"] > 0 for row in result["rows"])
