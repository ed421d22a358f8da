"""The fit's memory budget (jlens_core.fitting.memory_budget): dim_batch and order from the byte formula,
the same lens whatever the budget, and a one-sentence error when even one row does not fit."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny

from jlens_core import fit
from jlens_core.fitting.memory_budget import (
    FitSizes,
    MemoryBudgetError,
    fused_prompt_bytes,
    fused_row_bytes,
    peak_memory_bytes,
    plan_memory,
)

PROMPTS = [
    "The capital of Italy is Rome. Water boils at one hundred degrees, and numbers like 12 appear.",
    "def add(a, b):\n    return a + b\n# Once upon a time there was a small model that read every layer.",
    "Numbers like 12, 345 and 6789 appear in text; so do symbols: #, @, %, & and *. The end.",
]
SETTINGS = {"skip_first": 2, "max_seq_len": 16}

# d 64, F 128 gated, 4 heads, 10 valid positions of 12 keys, 3 layers backward, 3 sources, fp32, CPU results
HAND = FitSizes(d_model=64, mlp_width=128, mlp_parts=2, heads=4, n_valid=10, keys=12, layers_backward=3,
                n_sources=3, element_bytes=4, results_on_device=True)
# Worked out by hand from the formulas in docs/fitting.md (memory budget), in bytes:
#   prompt:  per layer 4*10*(12+10) + 10*(8*64 + 2*128) + 3*12*64 = 880 + 7680 + 2304 = 10864 values,
#            x 3 layers x 4 B = 130368, + the forward 12*(4*64 + 3*128) + 2*4*12^2 = 8832 values x 4 B
#            = 35328, + results 3 * 64^2 * 4 = 49152                          -> 214848
#   row-major row:  10 * (6*64 + 3*128 + 2*4*12) * 4 = 10 * 864 * 4              -> 34560
#   layer-major:    (3*10*64^2 + 4*64*2*128) * 4 = (122880 + 65536) * 4          -> 753664 more
#   its attention row: 10 * (6*64 + 2*4*12) * 4 = 10 * 480 * 4                   -> 19200
HAND_PROMPT, HAND_ROW, HAND_LAYER_MAJOR, HAND_ATTENTION_ROW = 214848, 34560, 753664, 19200


def test_dim_batch_follows_the_byte_formula_worked_by_hand():
    # 400 000 B: the layer-major order (968 512 B before any row) does not fit; (400000 - 214848) // 34560 = 5
    plan = plan_memory(HAND, 400_000, "fused")
    assert (plan.dim_batch, plan.layer_major, plan.planned_bytes) == (5, False, HAND_PROMPT + 5 * HAND_ROW)
    # 2 000 000 B: (2000000 - 214848 - 753664) // 19200 = 53 rows per attention chunk, layer-major
    plan = plan_memory(HAND, 2_000_000, "fused")
    assert (plan.dim_batch, plan.layer_major) == (53, True)
    assert plan.planned_bytes == HAND_PROMPT + HAND_LAYER_MAJOR + 53 * HAND_ATTENTION_ROW
    # an integer dim_batch is the most rows per pass
    assert plan_memory(HAND, 2_000_000, "fused", most_rows=16).dim_batch == 16
    assert plan_memory(HAND, 400_000, "fused", most_rows=4).dim_batch == 4


def test_autograd_dim_batch_follows_its_byte_formula_worked_by_hand():
    # graph: per layer 10*(10*64 + 4*128) + 2*4*10*12 = 11520 + 960 = 12480 values x 3 x 4 B = 149760,
    #        + the forward 35328 + results 49152 = 234240
    # row:   10 * (6*64 + 3*128 + 2*4*12 + 64*3) * 4 = 10 * 1056 * 4 = 42240
    plan = plan_memory(HAND, 1_000_000, "batched")
    assert plan.dim_batch == (1_000_000 - 234240) // 42240 == 18
    assert plan.layer_major is None


def test_sizes_of_a_model():
    sizes = FitSizes.of(tiny(), n_valid=13, layers_backward=3, n_sources=3, skip_first=2)
    assert (sizes.d_model, sizes.mlp_width, sizes.mlp_parts, sizes.heads) == (32, 64, 2, 4)
    assert (sizes.keys, sizes.element_bytes, sizes.results_on_device) == (15, 4, True)
    assert FitSizes.of(tiny("gpt2"), n_valid=13, layers_backward=3, n_sources=3, skip_first=2).mlp_parts == 1


def test_a_budget_too_small_for_one_row_says_how_much_is_needed():
    with pytest.raises(MemoryBudgetError, match=r"too small .* needs 243\.6 KiB"):
        plan_memory(HAND, 200_000, "fused")
    with pytest.raises(MemoryBudgetError, match=r"max_memory=1\.0 KiB is too small for this fit.*needs"):
        fit(tiny(), PROMPTS, max_memory="1KiB", **SETTINGS)
    with pytest.raises(ValueError, match="not a memory size"):
        fit(tiny(), PROMPTS, max_memory="plenty", **SETTINGS)


def _budget_for_rows(rows: int) -> int:
    """A budget that holds ``rows`` row-major rows of the longest prompt (and not the layer-major order)."""
    sizes = FitSizes.of(tiny(), n_valid=13, layers_backward=3, n_sources=3, skip_first=2)
    return fused_prompt_bytes(sizes) + rows * fused_row_bytes(sizes) + 100


@pytest.mark.parametrize("method", ["fused", "batched"])
def test_the_lens_is_the_same_whatever_the_budget(method):
    reference = fit(tiny(), PROMPTS, dim_batch=8, method=method, **SETTINGS)
    events = []
    small = fit(tiny(), PROMPTS, dim_batch="auto", method=method, max_memory=_budget_for_rows(3),
                progress=events.append, **SETTINGS)
    large = fit(tiny(), PROMPTS, dim_batch="auto", method=method, max_memory="1GiB", **SETTINGS)
    for lens in (small, large):
        for layer in reference.source_layers:
            torch.testing.assert_close(lens.jacobians[layer], reference.jacobians[layer], rtol=1e-5, atol=1e-6)
    memory = small.record.provenance["memory"]
    assert memory["method"] == method and memory["budget_bytes"] == _budget_for_rows(3)
    if method == "fused":  # the small budget ran row-major in chunks of about 3 rows; the large one layer-major
        assert memory["dim_batch_at_max_seq_len"] == 3 and memory["layer_major"] is False
        assert large.record.provenance["memory"]["layer_major"] is True
        assert large.record.provenance["memory"]["dim_batch_at_max_seq_len"] == 32
    assert all(e.dim_batch is not None and e.dim_batch < 8 for e in events) or method == "batched"
    assert all(e.peak_memory_bytes and e.peak_memory_bytes > 0 for e in events)
    assert memory["peak_bytes"] == events[-1].peak_memory_bytes
    assert "whole process" in memory["peak_measure"]


def test_peak_memory_on_the_cpu_is_the_process_high_water_mark():
    with open("/proc/self/status") as status:
        hwm = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    assert abs(peak_memory_bytes(torch.device("cpu")) - hwm) <= 0.05 * hwm


def test_cli_fit_memory_sets_the_budget_and_reports_the_peak(tmp_path, capsys):
    import json

    from conftest import CORPUS, save_tiny

    from jlens_core import JacobianLens
    from jlens_core.cli.main import main

    model = save_tiny(tmp_path / "tiny-llama")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(CORPUS.split(". ")[:3]) + "\n", encoding="utf-8")

    def args(out, *extra):
        return ["fit", "--model", model, "--corpus", str(corpus), "--out", str(out), "--min-chars", "0",
                "--split", "all", "--max-seq-len", "16", "--skip-first", "2", "--no-progress", *extra]

    assert main(args(tmp_path / "plain.safetensors")) == 0
    assert main(args(tmp_path / "budget.safetensors", "--fit-memory", "300KiB")) == 0
    plain, budget = (JacobianLens.load(tmp_path / f"{name}.safetensors") for name in ("plain", "budget"))
    for layer in plain.source_layers:
        torch.testing.assert_close(budget.jacobians[layer], plain.jacobians[layer], rtol=1e-5, atol=1e-6)
    memory = budget.record.provenance["memory"]
    assert memory["budget_bytes"] == 300 * 1024 and budget.fit_plan.dim_batch == "auto"
    assert memory["layer_major"] is False and 1 <= memory["dim_batch_at_max_seq_len"] < 8
    assert "memory" not in plain.record.provenance
    status = json.loads((tmp_path / "budget.status.json").read_text())
    assert status["peak_memory_bytes"] > 0 and status["dim_batch"] >= 1
    capsys.readouterr()
    assert main(args(tmp_path / "tiny.safetensors", "--fit-memory", "1KiB")) != 0
    assert "is too small for this fit" in capsys.readouterr().err
