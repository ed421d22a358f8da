"""Binomial intervals (jlens_core.interventions.intervals, docs/method.md §7): Clopper-Pearson against
published values and closed forms of the incomplete beta function, Wilson beside it, and the case a
bootstrap gets wrong (every trial fails)."""

from __future__ import annotations

import math

import pytest

from jlens_core.evaluation.passk import bootstrap_interval
from jlens_core.interventions.intervals import (
    beta_quantile,
    clopper_pearson_interval,
    regularized_incomplete_beta,
    wilson_interval,
)


@pytest.mark.parametrize("k, n, low, high", [
    (0, 10, 0.0, 0.3084971), (10, 10, 0.6915029, 1.0), (5, 10, 0.1870860, 0.8129140),
    (3, 100, 0.006229972, 0.085176053),  # R: binom.test(3, 100)$conf.int
    (1, 1, 0.025, 1.0), (0, 1, 0.0, 0.975),
])
def test_clopper_pearson_known_values(k, n, low, high):
    got = clopper_pearson_interval(k, n)
    assert got == pytest.approx((low, high), abs=2e-7)


def test_incomplete_beta_against_closed_forms_and_the_binomial_tail():
    for x in (0.01, 0.3, 0.5, 0.77, 0.99):
        assert regularized_incomplete_beta(x, 1, 4.5) == pytest.approx(1 - (1 - x) ** 4.5, rel=1e-12)
        assert regularized_incomplete_beta(x, 3.2, 1) == pytest.approx(x ** 3.2, rel=1e-12)
        assert regularized_incomplete_beta(x, 0.5, 0.5) == pytest.approx(2 / math.pi * math.asin(math.sqrt(x)),
                                                                         rel=1e-12)
        # I_p(k, n - k + 1) = P(Binomial(n, p) >= k)
        n, k = 40, 13
        tail = sum(math.comb(n, j) * x ** j * (1 - x) ** (n - j) for j in range(k, n + 1))
        assert regularized_incomplete_beta(x, k, n - k + 1) == pytest.approx(tail, rel=1e-10, abs=1e-300)
    for p in (0.025, 0.5, 0.975):
        assert regularized_incomplete_beta(beta_quantile(p, 7, 3), 7, 3) == pytest.approx(p, abs=1e-12)


def test_clopper_pearson_stays_wide_where_a_bootstrap_collapses():
    failures = [0.0] * 12
    assert bootstrap_interval(failures) == (0.0, 0.0)  # every resample of all-failures is all-failures
    low, high = clopper_pearson_interval(0, 12)
    assert low == 0.0 and high == pytest.approx(1 - 0.025 ** (1 / 12), rel=1e-9)  # closed form at k = 0
    assert high > 0.25
    # exact intervals are wider than Wilson's at the edges, and both contain the rate
    w_low, w_high = wilson_interval(0, 12)
    assert w_low == 0.0 and w_high < high
    for k in range(13):
        lo, hi = clopper_pearson_interval(k, 12)
        assert lo <= k / 12 <= hi


def test_bad_counts_are_one_sentence():
    with pytest.raises(ValueError, match=r"successes=11 is outside 0\.\.n \(n=10\)"):
        clopper_pearson_interval(11, 10)
    with pytest.raises(ValueError, match=r"successes=-1 is outside"):
        wilson_interval(-1, 10)
    assert all(math.isnan(x) for x in clopper_pearson_interval(0, 0))
