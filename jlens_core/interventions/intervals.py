"""Confidence intervals of a binomial proportion (``successes`` out of ``n`` trials), for swap success
(docs/method.md §7).

* :func:`clopper_pearson_interval` — the exact interval: the 95 % bounds are quantiles of beta
  distributions, ``Beta(0.025; k, n - k + 1)`` and ``Beta(0.975; k + 1, n - k)`` (``0`` at ``k = 0``,
  ``1`` at ``k = n``). It never under-covers, and it stays wide when every trial fails
  (``0/10 -> [0, 0.3085]``), where a bootstrap over the trials collapses to ``[0, 0]``. The tables use it.
* :func:`wilson_interval` — the Wilson score interval, narrower and approximate; kept beside it.

And of a mean (pass@k rates, side-effect divergences): :func:`bootstrap_interval`, the seeded 95 % percentile
bootstrap.

No scipy: the beta quantile is a bisection on the regularised incomplete beta function ``I_x(a, b)``,
evaluated with its continued fraction (modified Lentz, as in Numerical Recipes §6.4), in float64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

N_BOOT = 2000  # bootstrap resamples of a mean
Z_95 = 1.959964  # the standard normal's 0.975 quantile
_CF_EPS = 1e-15
_CF_TINY = 1e-300
_CF_MAX_TERMS = 10_000
_BISECTIONS = 200  # halves [0, 1] far below float64 resolution


def _check_counts(successes: int, n: int) -> None:
    if not 0 <= successes <= n:
        raise ValueError(f"successes={successes} is outside 0..n (n={n}): a proportion counts trials that "
                         "succeeded out of those run.")


def _beta_continued_fraction(x: float, a: float, b: float) -> float:
    """The continued fraction of ``I_x(a, b)`` (converges fast for ``x < (a + 1) / (a + b + 2)``)."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > _CF_TINY else _CF_TINY)
    h = d
    for m in range(1, _CF_MAX_TERMS + 1):
        m2 = 2 * m
        for numerator in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                          -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > _CF_TINY else _CF_TINY)
            c = 1.0 + numerator / c
            c = c if abs(c) > _CF_TINY else _CF_TINY
            step = c * d
            h *= step
        if abs(step - 1.0) < _CF_EPS:
            break
    return h


def regularized_incomplete_beta(x: float, a: float, b: float) -> float:
    """``I_x(a, b)``, the CDF at ``x`` of the ``Beta(a, b)`` distribution (``a, b > 0``, ``x`` in [0, 1]).

    Raises:
        ValueError: ``a`` or ``b`` not positive, or ``x`` outside [0, 1].
    """
    if not (a > 0 and b > 0):
        raise ValueError(f"Beta parameters must be positive, not a={a}, b={b}.")
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x={x} is outside [0, 1].")
    if x == 0.0 or x == 1.0:
        return x
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log1p(-x))
    # the fraction converges on one side of the mean; the symmetry I_x(a, b) = 1 - I_{1-x}(b, a) covers the other
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(x, a, b) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(1.0 - x, b, a) / b


def beta_quantile(p: float, a: float, b: float) -> float:
    """The ``p`` quantile of ``Beta(a, b)``: the ``x`` with ``I_x(a, b) = p``, by bisection (the CDF is
    increasing), to about 1e-15.

    Raises:
        ValueError: ``p`` outside [0, 1], or ``a``, ``b`` not positive.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p={p} is outside [0, 1].")
    low, high = 0.0, 1.0
    for _ in range(_BISECTIONS):
        mid = 0.5 * (low + high)
        if mid in (low, high):
            break
        if regularized_incomplete_beta(mid, a, b) < p:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


def clopper_pearson_interval(successes: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The exact (Clopper-Pearson) ``level`` interval of ``successes / n``; ``(nan, nan)`` for ``n = 0``.

    Raises:
        ValueError: ``successes`` outside ``0..n``, or ``level`` outside (0, 1).
    """
    if n <= 0:
        return math.nan, math.nan
    _check_counts(successes, n)
    if not 0.0 < level < 1.0:
        raise ValueError(f"level={level} must be between 0 and 1 (0.95 for a 95 % interval).")
    tail = (1.0 - level) / 2
    low = 0.0 if successes == 0 else beta_quantile(tail, successes, n - successes + 1)
    high = 1.0 if successes == n else beta_quantile(1.0 - tail, successes + 1, n - successes)
    return low, high


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """The 95 % Wilson score interval of ``successes / n`` (``(nan, nan)`` for ``n = 0``).

    Raises:
        ValueError: ``successes`` outside ``0..n``.
    """
    if n <= 0:
        return math.nan, math.nan
    _check_counts(successes, n)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_interval(values: Sequence[float], *, n_boot: int = N_BOOT, seed: int = 0) -> tuple[float, float]:
    """The 95 % percentile bootstrap interval of the mean of ``values`` (``(nan, nan)`` when empty), from
    ``n_boot`` resamples drawn with ``numpy.random.default_rng(seed)``."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = arr[rng.integers(0, arr.size, size=(int(n_boot), arr.size))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


__all__ = ["N_BOOT", "beta_quantile", "bootstrap_interval", "clopper_pearson_interval", "regularized_incomplete_beta", "wilson_interval"]
