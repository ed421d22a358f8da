"""Selecting atoms from bf16 and fp16 products (docs/method.md §11.2, ``pursuit.bounded_best``): plain tensors,
checked against the best atom computed in float64, on random dictionaries, on near-ties planted below the low
precision's resolution, on scores whose sign the bound has to respect, on magnitudes far outside fp16's range, and
through the J-space on a tiny model (bf16 selection for many rows and fp16 selection for a few, on and off, give the
same decomposition)."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from conftest import make_tiny
from helpers import random_lens

# the module (the package re-exports a function of the same name)
P = importlib.import_module("jlens_core.jspace.pursuit")


def brute_best(z, offset, weight, scale, chosen):
    """float64 ``s_t (z . w_t + o)`` with the chosen atoms excluded: (best, pick, second best)."""
    score = (z.double() @ weight.double().T + offset.double()[:, None]) * scale.double()
    if chosen.numel():
        score.scatter_(1, chosen, -math.inf)
    top2 = score.topk(2, dim=-1)
    return top2.values[:, 0], top2.indices[:, 0], top2.values[:, 1]


def problem(seed: int, n_atoms: int = 3000, d: int = 64, m: int = 24, steps: int = 5):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n_atoms, d, generator=gen) * (0.2 + torch.rand(n_atoms, 1, generator=gen))
    z = torch.randn(m, d, generator=gen) * 30  # large rows against small scores, as in the J-space
    offset = torch.randn(m, generator=gen) * 5
    scale = 0.05 + torch.rand(n_atoms, generator=gen)
    chosen = torch.stack([torch.randperm(n_atoms, generator=gen)[:steps] for _ in range(m)])
    return z, offset, weight, scale, chosen


LOW = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("seed", range(4))
def test_the_low_precision_selection_is_the_float64_best(seed, dtype):
    z, offset, weight, scale, chosen = problem(seed)
    atoms = P.Bf16Atoms.of(weight, dtype=dtype)
    best, pick, rescored = P.bounded_best(z, offset, atoms, scale, chosen)
    want, want_pick, second = brute_best(z, offset, weight, scale, chosen)
    clear = (want - second) > 1e-5 * want.abs()
    assert clear.all(), "the random problem has a float64 near-tie; pick another seed"
    assert torch.equal(pick, want_pick)
    torch.testing.assert_close(best.double(), want, rtol=1e-5, atol=1e-5)
    assert not bool((chosen == pick[:, None]).any())  # no row picks an atom it has chosen
    assert 0 < rescored < weight.shape[0]  # the bound screened, and re-scored more than the picks


@pytest.mark.parametrize(("dtype", "nudge"), [(torch.bfloat16, 1e-3), (torch.float16, 1e-4)])
def test_near_ties_that_low_precision_orders_wrongly_are_decided_in_fp32(dtype, nudge):
    """A rival of each row's best whose low-precision row is the best's (a perturbation below that precision's
    resolution), scaled up a little: in low precision the rival scores higher, in fp32 and float64 lower. Selecting
    from the low-precision scores alone (no bound) picks the rival; the bound re-scores both and picks the best."""
    z, offset, weight, scale, chosen = problem(7, steps=0)
    weight = weight.to(dtype).float()  # every row exact in the low precision, so a small perturbation rounds back
    _, want_pick, _ = brute_best(z, offset, weight, scale, chosen)
    weight, scale = weight.clone(), scale.clone()
    rows = range(6)
    free = [i for i in range(weight.shape[0]) if i not in set(want_pick.tolist())]  # overwrite no row's best
    rivals = {row: free[50 * row] for row in rows}
    for row in rows:
        t = int(want_pick[row])
        rival = rivals[row]
        w = weight[t]
        big = w.abs() >= w.abs().median()
        delta = torch.where(big, -nudge * torch.sign(z[row]) * w.abs(), 0.0)  # below half a unit: rounds to w
        weight[rival] = w + delta
        assert torch.equal(weight[rival].to(dtype), w.to(dtype))
        score = float(z[row] @ w + offset[row])
        assert score > 0
        loss = float(-(delta @ z[row]))  # > 0: what the perturbation costs the rival in fp32
        scale[rival] = scale[t] * (1 + 0.5 * loss / score)
    _, want_pick2, _ = brute_best(z, offset, weight, scale, chosen)
    assert torch.equal(want_pick2[:6], want_pick[:6])  # the best is still the best in float64
    atoms = P.Bf16Atoms.of(weight, dtype=dtype)
    _, pick, _ = P.bounded_best(z, offset, atoms, scale, chosen)
    assert torch.equal(pick, want_pick2)
    for row in rows:
        t = int(want_pick[row])
        # the same stored row and a larger scale: the low-precision scores alone would pick the rival
        assert torch.equal(atoms.weight_low[rivals[row]], atoms.weight_low[t]) and scale[rivals[row]] > scale[t]


@pytest.mark.parametrize(("z_size", "w_size"), [(1e6, 1e-2), (1e-3, 1e-6), (3e4, 3e4)])
def test_fp16_selection_far_outside_fp16s_range(z_size, w_size):
    """Rows and targets whose products would overflow fp16 (65504) or fall into its subnormals are scaled by powers
    of two on the way in and out: the pick is still the float64 best."""
    z, offset, weight, scale, chosen = problem(11, m=3)
    z, offset, weight = z / 30 * z_size, offset / 5 * z_size * w_size, weight * w_size
    best, pick, _ = P.bounded_best(z, offset, P.Bf16Atoms.of(weight, dtype=torch.float16), scale, chosen)
    want, want_pick, _ = brute_best(z, offset, weight, scale, chosen)
    assert torch.equal(pick, want_pick)
    torch.testing.assert_close(best.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_an_unknown_low_precision_is_refused():
    with pytest.raises(ValueError, match="is not a low precision to select from"):
        P.Bf16Atoms.of(torch.ones(3, 2), dtype=torch.float64)


def test_fp16_selection_needs_fp32_sums(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch._C, "_get_cpu_allow_fp16_reduced_precision_reduction", lambda: False)
    assert P.fp16_selection_available()
    monkeypatch.setattr(torch._C, "_get_cpu_allow_fp16_reduced_precision_reduction", lambda: True)
    assert not P.fp16_selection_available()  # fp16 sums: outside the bound
    monkeypatch.setattr(torch._C, "_get_cpu_allow_fp16_reduced_precision_reduction", lambda: False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert not P.fp16_selection_available()  # no fast fp16 kernel measured there


def test_the_full_fp32_fallback_gives_the_same(monkeypatch):
    z, offset, weight, scale, chosen = problem(3)
    atoms = P.Bf16Atoms.of(weight)
    screened = P.bounded_best(z, offset, atoms, scale, chosen)
    monkeypatch.setattr(P, "MAX_RESCORE_FRACTION", 0.0)
    full = P.bounded_best(z, offset, atoms, scale, chosen)
    assert full[2] == weight.shape[0] and screened[2] < weight.shape[0]
    assert torch.equal(screened[1], full[1])
    torch.testing.assert_close(screened[0], full[0], rtol=1e-6, atol=1e-6)


def test_negative_best_scores_and_no_offset_or_scale():
    z, _, weight, _, chosen = problem(5)
    weight = weight - 3 * z.mean(0) / z.mean(0).norm() * weight.norm(dim=-1, keepdim=True)  # most scores negative
    none = torch.zeros(z.shape[0])
    best, pick, _ = P.bounded_best(z, None, P.Bf16Atoms.of(weight), None, chosen)
    want, want_pick, _ = brute_best(z, none, weight, torch.ones(weight.shape[0]), chosen)
    assert torch.equal(pick, want_pick)
    torch.testing.assert_close(best.double(), want, rtol=1e-5, atol=1e-4)


def test_a_transposed_view_is_gathered_like_a_contiguous_block():
    z, offset, weight, scale, chosen = problem(2)
    base = weight.T.contiguous()  # [d, n_atoms], as the head matrix is kept
    a = P.bounded_best(z, offset, P.Bf16Atoms.of(base.T), scale, chosen)
    b = P.bounded_best(z, offset, P.Bf16Atoms.of(weight), scale, chosen)
    assert torch.equal(a[1], b[1])
    torch.testing.assert_close(a[0], b[0])


@pytest.mark.parametrize(("flag", "part", "rows"), [
    ("BF16_SELECTION", "_bf16", slice(1, None)),  # every position but the first: bf16 products
    ("FP16_SELECTION", "_fp16", slice(-3, None)),  # three rows, below BF16_MIN_ROWS: fp16 products
])
def test_the_jspace_decomposes_alike_with_and_without_low_precision_selection(monkeypatch, flag, part, rows):
    from jlens_core.jspace import decompose
    from jlens_core.jspace import dictionary as D
    from jlens_core.reading.inputs import record_residuals

    model = make_tiny("llama")
    lens = random_lens(model)
    layer = 1
    x = record_residuals(model, model.encode("The capital of France is Paris. The capital of Italy is"),
                         [layer])[layer].float()[rows]
    assert (x.shape[0] < D.BF16_MIN_ROWS) is (flag == "FP16_SELECTION")
    out = {}
    for on in (False, True):
        monkeypatch.setattr(D, flag, on)
        space = D.jspace(model, lens, layer)
        assert (getattr(space, part) is not None) is on
        out[on] = decompose(model, lens, x, layer, k=6, method="nnls")
    assert torch.equal(out[True].token_ids, out[False].token_ids)
    torch.testing.assert_close(out[True].explained, out[False].explained, rtol=0, atol=1e-6)
    torch.testing.assert_close(out[True].random_explained, out[False].random_explained, rtol=0, atol=1e-6)


def test_bf16_selection_follows_the_cpu_flag(monkeypatch):
    from jlens_core.jspace import dictionary as D

    monkeypatch.setattr(D, "BF16_SELECTION", None)
    monkeypatch.setattr(D, "cpu_bf16_flag", lambda: None)
    assert D.bf16_selection() is False
    monkeypatch.setattr(D, "cpu_bf16_flag", lambda: "avx512_bf16")
    assert D.bf16_selection() is True
    monkeypatch.setattr(D, "BF16_SELECTION", False)
    assert D.bf16_selection() is False


def test_atom_norms_are_stored_and_read_back(monkeypatch, tmp_path):
    from jlens_core.interventions.read_directions import read_vector_norms
    from jlens_core.jspace import dictionary as D

    monkeypatch.setenv("JLENS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(D, "STORE_NORMS_FROM_FLOP", 0.0)
    model = make_tiny("llama")
    lens = random_lens(model)
    want = read_vector_norms(model, lens, 1, centred=True).float()
    first = D._stored_norms(model, lens, 1, "centred")
    files = list((tmp_path / "jspace-norms").glob("*.npy"))
    assert len(files) == 1
    torch.testing.assert_close(first, want, rtol=0, atol=0)
    files[0].write_bytes(files[0].read_bytes()[:-8] + b"\0" * 8)  # a stored file is what is read back
    changed = D._stored_norms(model, lens, 1, "centred")
    assert not torch.equal(changed, want)
    assert D._stored_norms(model, lens, 1, "raw").shape == want.shape  # another gauge: another file
    assert len(list((tmp_path / "jspace-norms").glob("*.npy"))) == 2
    other = random_lens(model, seed=5)  # another lens: its own file, its own norms
    torch.testing.assert_close(D._stored_norms(model, other, 1, "centred"),
                               read_vector_norms(model, other, 1, centred=True).float(), rtol=0, atol=0)
    assert len(list((tmp_path / "jspace-norms").glob("*.npy"))) == 3
    files[0].write_bytes(b"not a numpy file")  # unreadable: recomputed
    torch.testing.assert_close(D._stored_norms(model, lens, 1, "centred"), want, rtol=0, atol=0)


@pytest.mark.parametrize("bf16", [True, False])
def test_layers_decomposed_together_equal_each_layer_alone(monkeypatch, bf16):
    """decompose_layers stacks layers into pursuits of up to STACK_ROWS rows, one low-precision product over the
    shared head per step, each layer's rows bounded with its own norms: the same atoms, coefficients and fractions
    as decompose one layer at a time (small stacks here, so that layers split across several)."""
    import importlib

    from jlens_core.jspace import dictionary as D

    M = importlib.import_module("jlens_core.jspace.decompose")
    from jlens_core.reading.inputs import record_residuals

    monkeypatch.setattr(D, "BF16_SELECTION", bf16)
    monkeypatch.setattr(M, "STACK_ROWS", 16)
    model = make_tiny("llama")
    lens = random_lens(model)
    layers = [0, 1, 2]
    ids = model.encode("The capital of France is Paris. The capital of Italy is")
    recorded = record_residuals(model, ids, layers)
    xs = {layer: recorded[layer].float()[1:8] for layer in layers}  # 7 rows a layer: stacks of 2 layers, then 1
    together = M.decompose_layers(model, lens, xs, k=6, controls="random")
    assert list(together) == layers
    for layer in layers:
        alone = M.decompose(model, lens, xs[layer], layer, k=6, controls="random")
        assert torch.equal(together[layer].token_ids, alone.token_ids), layer
        torch.testing.assert_close(together[layer].coefficients, alone.coefficients, rtol=0, atol=1e-6)
        torch.testing.assert_close(together[layer].explained, alone.explained, rtol=0, atol=1e-6)
        torch.testing.assert_close(together[layer].random_explained, alone.random_explained, rtol=0, atol=1e-6)
        assert together[layer].layer == layer
    assert M.decompose_layers(model, lens, {}, k=6) == {}
    with pytest.raises(ValueError, match="zero vector"):
        M.decompose_layers(model, lens, {0: xs[0], 1: torch.zeros(2, model.d_model)}, k=6)


def test_rows_of_several_dictionaries_need_a_select_that_takes_groups():
    weight = torch.randn(10, 4)
    with pytest.raises(ValueError, match="need a select that takes their groups"):
        P.greedy_pursuit(torch.randn(3, 4), 2, correlate=lambda r: r @ weight.T, fetch=lambda i: weight[i],
                         groups=torch.tensor([0, 0, 1]))


def test_row_blocks_are_the_runs_of_groups():
    from jlens_core.jspace.dictionary import row_blocks

    assert row_blocks(torch.tensor([0, 0, 2, 2, 2, 5])) == [(0, 0, 2), (2, 2, 5), (5, 5, 6)]
