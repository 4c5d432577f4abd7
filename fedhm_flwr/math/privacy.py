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
probability ``q`` (Poisson sampling). DP runs sample exactly so (:func:`poisson_sample`, with
``q = fraction_train`` and no minimum), from a stream no client knows (:func:`secret_uniform`).

The mechanism (:func:`dp_mean`, :func:`noise_std`): DP-FedAvg's fixed-denominator estimator
(McMahan et al. 2018, ``f̃_f``). Client ``p``'s contribution is its whole recovered model minus the
global model it was cut from, ``Δ_p = v_p − w`` (a low-rank client's truncation error is part of
its contribution), clipped as a whole to L2 norm ``C``; the new model is
``w + (Σ_p clip_C(Δ_p)) / m + N(0, (σ C / m)² I)`` with ``m`` the expected number of sampled
clients, a constant of the run (``fraction_train × num_clients``), not the number that replied.
Adding or removing one client changes the sum by at most ``C``, hence the mean by at most
``C / m`` (:func:`sensitivity`), whatever its level, its reported example count or how many others
replied; the noise std is ``σ`` times that bound. Weights never come from the clients.
"""

from __future__ import annotations

import functools
import math
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import SupportsInt, cast

import numpy as np
import torch
from torch import Tensor

from fedhm_flwr.math.robust import clip_scales, update_norms

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
    for alpha in orders:
        if int(alpha) != alpha or alpha < 2:
            raise ValueError(f"orders must be integers >= 2, got {alpha!r}")
    return np.asarray(_rdp_at(float(q), float(sigma), tuple(int(a) for a in orders)), dtype=np.float64)


@functools.lru_cache(maxsize=64)
def _rdp_at(q: float, sigma: float, orders: tuple[int, ...]) -> tuple[float, ...]:
    """:func:`rdp_sampled_gaussian`'s values, computed once per (rate, noise, orders): every DP round of a
    run asks for the same ones (0.2 s of pure-Python sums at the 255 default orders)."""
    out = []
    for alpha in orders:
        if q == 0:
            out.append(0.0)
        elif q == 1.0:
            out.append(alpha / (2 * sigma * sigma))
        else:
            out.append(_log_a_int(q, sigma, alpha) / (alpha - 1))
    return tuple(out)


def compute_rdp(q: float, sigma: float, steps: int, orders: Sequence[int] = ORDERS) -> np.ndarray:
    """RDP of ``steps`` compositions (TensorFlow Privacy's ``compute_rdp``)."""
    return rdp_sampled_gaussian(q, sigma, orders) * int(steps)


def epsilon_from_rdp(
    rdp: Sequence[float] | np.ndarray, delta: float, orders: Sequence[int] = ORDERS
) -> tuple[float, int]:
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
            self.orders = tuple(int(a) for a in cast("list[int]", state["orders"]))  # as state() wrote them
            self.rdp = np.asarray(state["rdp"], dtype=np.float64)
            self.steps = int(cast(int, state["steps"]))


# ----------------------------------------------------------------------------------- the mechanism

State = dict[str, Tensor]


def sensitivity(clip: float, expected_clients: float) -> float:
    """L2 sensitivity of :func:`dp_mean` to adding or removing one client: ``C / m``."""
    if not clip > 0 or not expected_clients > 0:
        raise ValueError(f"clip and expected_clients must be > 0, got {clip!r}, {expected_clients!r}")
    return float(clip) / float(expected_clients)


def noise_std(sigma: float, clip: float, expected_clients: float) -> float:
    """Standard deviation of the Gaussian noise on every element: ``σ · C / m``."""
    if not sigma > 0:
        raise ValueError(f"noise multiplier must be > 0, got {sigma!r}")
    return float(sigma) * sensitivity(clip, expected_clients)


def contributions(global_state: Mapping[str, Tensor], models: Sequence[Mapping[str, Tensor]]) -> list[State]:
    """``Δ_p = v_p − w`` (float64) on every floating key of the global state; a key a model does not
    hold contributes 0."""
    keys = [k for k, v in global_state.items() if v.is_floating_point()]
    return [
        {
            k: (m[k].to(torch.float64) - global_state[k].to(torch.float64))
            if k in m
            else torch.zeros(global_state[k].shape, dtype=torch.float64)
            for k in keys
        }
        for m in models
    ]


def dp_mean(
    global_state: Mapping[str, Tensor], models: Sequence[Mapping[str, Tensor]], clip: float, expected_clients: float
) -> tuple[State, np.ndarray]:
    """The noiseless DP-FedAvg update ``w + Σ_p clip_C(v_p − w) / m`` and each model's clip scale
    (see the module docstring). Non-floating tensors keep the global value; no model: ``w``."""
    sensitivity(clip, expected_clients)  # validates
    deltas = contributions(global_state, models)
    norms = update_norms(deltas, [None] * len(deltas))
    scales = clip_scales(norms, clip)  # a non-finite update gets 0
    out: State = {}
    for key, value in global_state.items():
        if not value.is_floating_point():
            out[key] = value.clone()
            continue
        total = torch.zeros(value.shape, dtype=torch.float64)
        for delta, scale in zip(deltas, scales):
            if scale > 0:
                total += float(scale) * delta[key]
        out[key] = (value.to(torch.float64) + total / float(expected_clients)).to(value.dtype)
    return out, scales


def add_noise(state: Mapping[str, Tensor], std: float, generator: torch.Generator) -> State:
    """``state`` plus independent ``N(0, std²)`` on every floating element (drawn in float64)."""
    out: State = {}
    for key, value in state.items():
        if value.is_floating_point():
            noise = torch.randn(value.shape, generator=generator, dtype=torch.float64) * float(std)
            out[key] = (value.to(torch.float64) + noise).to(value.dtype)
        else:
            out[key] = value.clone()
    return out


#: stream ids of the reproducible (``dp.seed``) mode, apart from every seed the round derives
NOISE_STREAM, SAMPLE_STREAM = "dp-noise", "dp-sample"


def _words(seed: int, *parts: str | SupportsInt) -> list[int]:
    """Integers for a SeedSequence from a seed and labels (strings hashed to 32-bit words)."""
    out = [int(seed)]
    for part in parts:
        out += list(part.encode()) if isinstance(part, str) else [int(part)]
    return out


def noise_generator(seed: int | None, server_round: int) -> torch.Generator:
    """The generator of one round's noise: 63 bits from the OS's entropy (``secrets``) when
    ``seed`` is None, the private setting; otherwise derived from ``(seed, round, "dp-noise")``,
    reproducible and therefore private against nobody who knows ``seed``."""
    if seed is None:
        return torch.Generator().manual_seed(secrets.randbits(63))
    words = np.random.SeedSequence(_words(seed, server_round, NOISE_STREAM)).generate_state(2, np.uint32)
    return torch.Generator().manual_seed((int(words[0]) << 31) | (int(words[1]) >> 1))


def secret_uniform(seed: int | None, server_round: int) -> Callable[[int], float]:
    """A uniform draw in [0, 1) per client key for one round's Poisson sampling: from the OS's
    entropy (``secrets``, 53 bits) when ``seed`` is None; else derived from ``(seed, round,
    "dp-sample", key)`` (reproducible, not private)."""
    if seed is None:
        return lambda key: secrets.randbits(53) / float(1 << 53)
    return lambda key: float(np.random.default_rng(_words(seed, server_round, SAMPLE_STREAM, key)).random())


def poisson_sample(keys: Iterable[int], q: float, uniform: Callable[[int], float]) -> list[int]:
    """Poisson sampling: each key independently with probability ``q`` (``uniform(key) < q``),
    sorted; the count is random and may be 0."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"sampling rate q must be in [0, 1], got {q!r}")
    return sorted(k for k in keys if uniform(k) < q)
