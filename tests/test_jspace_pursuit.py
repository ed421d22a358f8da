"""The J-space's pursuit on plain tensors (docs/method.md §11.2): no model. Checked against a Lawson-Hanson NNLS
written out here on the same support, the KKT conditions, planted sparse nonnegative problems, and the greedy
rule (largest positive correlation with the unit atoms; stop when none is positive)."""

from __future__ import annotations

import pytest
import torch

from jlens_core.jspace.pursuit import kkt_violation, nnls_gram, pursuit


def lawson_hanson(a: torch.Tensor, x: torch.Tensor, iters: int = 200) -> torch.Tensor:
    """``argmin_{c >= 0} ||a^T c - x||`` for atoms ``a [m, d]`` (rows), float64, the textbook algorithm
    (Lawson & Hanson 1974, ch. 23), one problem at a time."""
    a, x = a.double(), x.double()
    m = a.shape[0]
    c = torch.zeros(m, dtype=torch.float64)
    passive: list[int] = []
    for _ in range(iters):
        w = a @ (x - a.T @ c)
        free = [i for i in range(m) if i not in passive]
        if not free or max(float(w[i]) for i in free) <= 1e-12 * float(w.abs().max() + 1e-300):
            break
        passive.append(max(free, key=lambda i: float(w[i])))
        while True:
            z = torch.zeros(m, dtype=torch.float64)
            sol = torch.linalg.lstsq(a[passive].T, x[:, None]).solution[:, 0]
            z[passive] = sol
            if all(float(z[i]) > 0 for i in passive):
                c = z
                break
            alpha = min(float(c[i] / (c[i] - z[i])) for i in passive if float(z[i]) <= 0)
            c = c + alpha * (z - c)
            passive = [i for i in passive if float(c[i]) > 1e-14]
            c[[i for i in range(m) if i not in passive]] = 0.0
    return c


def unit_rows(a: torch.Tensor) -> torch.Tensor:
    return a.double() / a.double().norm(dim=-1, keepdim=True)


@pytest.fixture(scope="module")
def problem():
    gen = torch.Generator().manual_seed(0)
    dictionary = torch.randn(300, 48, generator=gen) * torch.rand(300, 1, generator=gen) * 3  # uneven norms
    x = torch.randn(16, 48, generator=gen)
    return dictionary, x


def test_nnls_matches_an_independent_lawson_hanson_on_the_same_support(problem):
    dictionary, x = problem
    found = pursuit(dictionary, x, k=12, method="nnls")
    unit = unit_rows(dictionary)
    for i in range(x.shape[0]):
        support = found.indices[i][found.indices[i] >= 0]
        ref = lawson_hanson(unit[support], x[i])
        got = found.coefficients[i, : support.numel()]
        assert float((got - ref).norm() / ref.norm()) < 1e-6
        fitted = ref @ unit[support]
        assert float((found.fitted[i] - fitted).norm() / fitted.norm()) < 1e-6


def test_nnls_satisfies_kkt_and_the_residual_is_orthogonal_to_the_active_atoms(problem):
    dictionary, x = problem
    found = pursuit(dictionary, x, k=20, method="nnls")
    unit = unit_rows(dictionary)
    a = unit[found.indices.clamp_min(0)]  # [n, k, d]
    gram = a @ a.transpose(1, 2)
    b = (a @ x.double()[..., None])[..., 0]
    assert float(kkt_violation(gram, b, found.coefficients).max()) < 1e-9
    r = x.double() - found.fitted
    on_active = (a @ r[..., None])[..., 0][found.active]
    assert float(on_active.abs().max()) < 1e-9 * float(x.norm(dim=-1).max())


def test_nnls_gram_against_lawson_hanson_with_a_binding_constraint():
    gen = torch.Generator().manual_seed(3)
    # atoms in a narrow cone: the unconstrained least squares has negative coefficients
    a = unit_rows(torch.randn(8, 10, generator=gen) * 0.3 + torch.ones(10))
    x = torch.randn(10, generator=gen).double() + 2 * a[0] - a[1] * 0.0
    ref = lawson_hanson(a, x)
    unconstrained = torch.linalg.lstsq(a.T, x[:, None]).solution[:, 0]
    assert bool((unconstrained < 0).any())
    got = nnls_gram((a @ a.T)[None], (a @ x)[None])[0]
    assert float((got - ref).norm() / ref.norm()) < 1e-6
    assert bool((got == 0).any())


@pytest.mark.parametrize("method", ["nnls", "gradient_pursuit"])
def test_planted_sparse_nonnegative_problems_recover_their_support(method):
    gen = torch.Generator().manual_seed(1)
    d, n_atoms, s = 128, 400, 5
    dictionary = torch.randn(n_atoms, d, generator=gen)
    unit = unit_rows(dictionary)
    recovered = 0
    for trial in range(10):
        support = torch.randperm(n_atoms, generator=gen)[:s]
        c = 1 + torch.rand(s, generator=gen, dtype=torch.float64)
        x = c @ unit[support]
        found = pursuit(dictionary, x, k=s, method=method)
        recovered += set(found.indices[0].tolist()) == set(support.tolist())
        if method == "nnls":
            order = {int(t): i for i, t in enumerate(support)}
            got = torch.tensor([float(found.coefficients[0, j]) for j in range(s)])
            want = torch.tensor([float(c[order[int(t)]]) for t in found.indices[0]])
            torch.testing.assert_close(got.double(), want.double(), rtol=1e-6, atol=1e-9)
    assert recovered == 10


def test_greedy_stops_when_no_atom_has_a_positive_correlation():
    # x points away from every atom: nothing is selected
    dictionary = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    found = pursuit(dictionary, torch.tensor([-1.0, -2.0]), k=2, method="nnls")
    assert found.indices.tolist() == [[-1, -1]]
    assert float(found.fitted.abs().max()) == 0.0
    # x in the cone of one atom: one step, then the residual is zero
    found = pursuit(dictionary, torch.tensor([3.0, 0.0]), k=2)
    assert found.indices.tolist() == [[0, -1]]
    torch.testing.assert_close(found.coefficients[0, 0], torch.tensor(3.0, dtype=torch.float64))


def test_selection_uses_unit_atoms_not_raw_inner_products():
    # atom 1 has the larger inner product only because it is long; the unit correlation picks atom 0
    dictionary = torch.tensor([[1.0, 0.0, 0.0], [0.0, 100.0, 0.0]])
    x = torch.tensor([1.0, 0.5, 0.0])
    assert pursuit(dictionary, x, k=1).indices.tolist() == [[0]]


def test_gradient_pursuit_is_one_exact_line_search_step():
    gen = torch.Generator().manual_seed(2)
    dictionary = torch.randn(50, 20, generator=gen)
    x = torch.randn(20, generator=gen)
    unit = unit_rows(dictionary)
    two = pursuit(dictionary, x, k=2, method="gradient_pursuit")
    one = pursuit(dictionary, x, k=1, method="gradient_pursuit")
    # step 2 by hand: the gradient on the two selected atoms, the exact step, projected onto c >= 0
    a = unit[two.indices[0]]
    c = torch.stack([one.coefficients[0, 0], torch.tensor(0.0, dtype=torch.float64)])
    g = a @ (x.double() - a.T @ c)
    g = torch.where((c <= 0) & (g < 0), 0.0, g)
    step = (g @ g) / ((a.T @ g) @ (a.T @ g))
    torch.testing.assert_close(two.coefficients[0], (c + step * g).clamp_min(0), rtol=1e-10, atol=1e-12)
    # the first step is exact: the projection onto the first atom
    assert abs(float(one.coefficients[0, 0]) - float(unit[one.indices[0, 0]] @ x.double())) < 1e-9


def test_bad_input_is_refused():
    d = torch.randn(5, 3)
    with pytest.raises(ValueError, match="k=0"):
        pursuit(d, torch.randn(3), k=0)
    with pytest.raises(ValueError, match="do not match"):
        pursuit(d, torch.randn(4), k=1)
    with pytest.raises(ValueError, match="method="):
        pursuit(d, torch.randn(3), k=1, method="omp")
    with pytest.raises(ValueError, match="no nonzero atom"):
        pursuit(torch.zeros(5, 3), torch.randn(3), k=1)
