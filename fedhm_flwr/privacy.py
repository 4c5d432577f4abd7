"""Rényi-DP accountant of the sampled Gaussian mechanism (client-level DP-FedAvg): pure math.

One round of DP-FedAvg (McMahan et al., ICLR 2018) clips every sampled client's update to norm
``C`` and adds Gaussian noise of standard deviation ``σ·C`` (scaled by the aggregation weight) to
the aggregate: a sampled Gaussian mechanism with sampling rate ``q`` (clients sampled / clients)
and noise multiplier ``σ``. Its Rényi DP of integer order ``α ≥ 2`` (Mironov, Talwar and Zhang,
"Rényi Differential Privacy of the Sampled Gaussian Mechanism", 2019, Sec. 3.3) is

    ε_α = log( Σ_{k=0..α} C(α, k) (1-q)^(α-k) q^k exp((k² - k) / (2σ²)) ) / (α - 1),

composed additively over rounds, and converted to (ε, δ)-DP by
``ε = min_α ε_α(T) + log(1/δ) / (α - 1)`` (Mironov 2017, Prop. 3). This is the computation of
TensorFlow Privacy's ``rdp_accountant`` at integer orders (it is checked against that library's
published test values in ``tests/test_robust.py``); fractional orders are not used, so ε can only
be slightly larger (more conservative) than an accountant that also tries them.

Accounting assumption (as in DP-FedAvg): every client is included in a round independently with
probability ``q`` (Poisson sampling). The strategy samples a fixed number of clients; ``q`` is
set to that number over the population, the usual approximation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

#: Rényi orders tried (integers; large orders matter for small ε, small ones for large ε)
ORDERS: tuple[int, ...] = tuple(range(2, 257))


def _log_add(a: float, b: float) -> float:
    if a == -math.inf:
        return b
    if b == -math.inf:
        return a
    hi, lo = max(a, b), min(a, b)
    return hi + math.log1p(math.exp(lo - hi))


def _log_a_int(q: float, sigma: float, alpha: int) -> float:
    """``log A_α`` of the sampled Gaussian mechanism at integer order ``α``."""
    total = -math.inf
    for k in range(alpha + 1):
        log_binom = math.lgamma(alpha + 1) - math.lgamma(k + 1) - math.lgamma(alpha - k + 1)
        log_q = k * math.log(q) if k else 0.0
        log_1q = (alpha - k) * math.log1p(-q) if alpha - k else 0.0
        total = _log_add(total, log_binom + log_q + log_1q + (k * k - k) / (2 * sigma * sigma))
    return total


def rdp_sampled_gaussian(q: float, sigma: float, orders: Sequence[int] = ORDERS) -> np.ndarray:
    """RDP ``ε_α`` of one application, at each (integer, >= 2) order."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"sampling rate q must be in [0, 1], got {q!r}")
    if not sigma > 0:
        raise ValueError(f"noise multiplier must be > 0, got {sigma!r}")
    out = []
    for alpha in orders:
        if int(alpha) != alpha or alpha < 2:
            raise ValueError(f"orders must be integers >= 2, got {alpha!r}")
        alpha = int(alpha)
        if q == 0:
            out.append(0.0)
        elif q == 1.0:
            out.append(alpha / (2 * sigma * sigma))
        else:
            out.append(_log_a_int(q, sigma, alpha) / (alpha - 1))
    return np.asarray(out, dtype=np.float64)


def compute_rdp(q: float, sigma: float, steps: int, orders: Sequence[int] = ORDERS) -> np.ndarray:
    """RDP of ``steps`` compositions (TensorFlow Privacy's ``compute_rdp``)."""
    return rdp_sampled_gaussian(q, sigma, orders) * int(steps)


def epsilon_from_rdp(rdp: Sequence[float] | np.ndarray, delta: float,
                     orders: Sequence[int] = ORDERS) -> tuple[float, int]:
    """``(ε, optimal order)`` for ``δ``: ``min_α rdp_α + log(1/δ) / (α - 1)``."""
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    a = np.asarray(orders, dtype=np.float64)
    eps = np.asarray(rdp, dtype=np.float64) + math.log(1.0 / delta) / (a - 1)
    best = int(np.nanargmin(eps))
    return float(eps[best]), int(orders[best])


class RdpAccountant:
    """Accumulates the RDP of the rounds run so far (the rate may change from round to round)."""

    def __init__(self, orders: Sequence[int] = ORDERS) -> None:
        self.orders = tuple(int(a) for a in orders)
        self.rdp = np.zeros(len(self.orders), dtype=np.float64)
        self.steps = 0

    def step(self, q: float, sigma: float, count: int = 1) -> None:
        self.rdp = self.rdp + compute_rdp(q, sigma, count, self.orders)
        self.steps += int(count)

    def epsilon(self, delta: float) -> float:
        if self.steps == 0:
            return 0.0
        return epsilon_from_rdp(self.rdp, delta, self.orders)[0]

    def state(self) -> dict[str, object]:
        return {"orders": list(self.orders), "rdp": self.rdp.tolist(), "steps": self.steps}

    def load_state(self, state: dict[str, object]) -> None:
        if state:
            self.orders = tuple(int(a) for a in state["orders"])  # type: ignore[union-attr]
            self.rdp = np.asarray(state["rdp"], dtype=np.float64)
            self.steps = int(state["steps"])  # type: ignore[arg-type]
