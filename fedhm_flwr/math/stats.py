"""Statistics over seeds: mean, standard deviation and Student-t confidence intervals. No Flower.

SciPy is not a dependency of the project; the t quantile comes from mpmath (installed with torch,
through sympy): the CDF of Student's t with ``df`` degrees of freedom is, for ``t >= 0``,
``1 - I_x(df/2, 1/2) / 2`` with ``x = df / (df + t²)`` (the regularized incomplete beta
function), and the quantile is its root, found by bisection to float precision.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import mpmath


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` > 0 degrees of freedom."""
    if not df > 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df!r}")
    tail = 0.5 * mpmath.betainc(df / 2.0, 0.5, 0, df / (df + t * t), regularized=True)
    return float(1 - tail if t >= 0 else tail)


@functools.lru_cache(maxsize=1024)
def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (``0 < p < 1``); computed once per
    ``(p, df)``: a bisection over some 60 incomplete beta functions (mpmath, pure Python), asked
    thousands of times with the same few arguments by a results page."""
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p!r}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_quantile(1 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:  # bracket the root, then bisect to float precision
        low, high = high, 2 * high
    for _ in range(200):
        mid = (low + high) / 2
        if mid in (low, high):
            break
        low, high = (mid, high) if t_cdf(mid, df) < p else (low, mid)
    return (low + high) / 2


@dataclass(frozen=True)
class Estimate:
    """Mean of ``n`` values with their sample standard deviation and a t confidence interval
    (``std``, ``low``, ``high`` are NaN when ``n < 2``)."""

    n: int
    mean: float
    std: float
    low: float
    high: float
    confidence: float = 0.95

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> Estimate:
    """Mean, sample std (``ddof=1``) and the two-sided ``confidence`` interval of the mean,
    ``mean ± t_{(1+c)/2, n-1} · std / sqrt(n)``."""
    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    n = len(xs)
    if n == 0:
        raise ValueError("mean_ci needs at least one value")
    mean = math.fsum(xs) / n
    if n < 2:
        return Estimate(n, mean, math.nan, math.nan, math.nan, confidence)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile((1 + confidence) / 2, n - 1) * std / math.sqrt(n)
    return Estimate(n, mean, std, mean - half, mean + half, confidence)


def resolution_p(est: Estimate, margin: float = 0.0) -> float:
    """The smallest ``alpha`` at which the two-sided ``1 − alpha`` Student-t interval of ``est`` resolves
    a claim with ``margin`` (the results page's paired rule): for ``margin = 0`` (A beats B) the interval
    excludes 0, which is the two-sided t-test's p-value; for ``margin > 0`` (A is within ``margin`` of
    B) the interval lies inside ``(−margin, +margin)`` or wholly outside it. ``q`` is the largest t
    multiplier at which one of those holds, ``p = 2 · (1 − T_{n−1}(q))``; NaN below 2 values."""
    if est.n < 2 or not est.std > 0:
        return math.nan if est.n < 2 else (0.0 if abs(est.mean) != margin else 1.0)
    se = est.std / math.sqrt(est.n)
    inside = min(margin - est.mean, margin + est.mean) / se
    outside = (abs(est.mean) - margin) / se
    return 2 * (1 - t_cdf(max(inside, outside), est.n - 1))


def holm(pvalues: Sequence[float], alpha: float = 0.05) -> list[tuple[float, bool]]:
    """Holm's step-down correction of a family of tests: per p-value (in the given order) its
    adjusted p-value ``max_{j ≤ i} min(1, (m − j + 1) · p_(j))`` over the sorted p-values and whether
    it is rejected at family-wise level ``alpha`` (adjusted p < ``alpha``). NaN (no test) is left out
    of the family and never rejected."""
    order = sorted((p, i) for i, p in enumerate(pvalues) if not math.isnan(p))
    m, running = len(order), 0.0
    out: list[tuple[float, bool]] = [(math.nan, False)] * len(pvalues)
    for rank, (p, i) in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = (running, running < alpha)
    return out
