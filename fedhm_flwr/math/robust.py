"""Robust aggregation of heterogeneous replies: pure functions on tensors, no Flower import.

A reply is seen here as its *recovered* full-shape model ``v_p`` (FedHM: ``A·B`` recovered; HeteroFL
and FedRolex: the width slice scattered into the global shapes; FedLoRA: ``B·A``), its *update*
``Δ_p = v_p - r_p`` against the model it received, recovered the same way (``r_p``), and its
*coverage*: which elements of the global model it holds. A coverage is a mapping key -> boolean
tensor of the key's full shape; a key absent from the reply, or from its coverage when the
coverage is not ``None``, is not covered; ``None`` covers every element of every key the reply
holds. Classifier rows of classes a client does not hold are marked uncovered by the caller
(:func:`with_class_rows`), so they are treated like an element outside a width slice.

* :func:`update_norms`, :func:`clip_scales`, :func:`quantile_bound`: clipping by norm, with a
  fixed bound or a quantile of the round's norms (adaptive);
* :func:`outlier_keep`: a norm filter on the robust z-score ``(‖Δ‖ - median) / (1.4826 · MAD)``
  (median and MAD instead of mean and standard deviation: one huge norm cannot hide itself by
  inflating the spread);
* :func:`combine`: per element, over the clients covering it, the weighted ``mean``, the
  coordinate-wise ``median`` or the ``trimmed_mean`` (``floor(f·c)`` values cut at each end of an
  element's ``c`` covering clients); elements nobody covers keep the previous value;
* :func:`krum_scores`, :func:`krum_select`: Krum / Multi-Krum (Blanchard et al. 2017) on
  flattened models that all cover the whole model;
* :func:`oversized`, :func:`finite_updates`: the screening every reply passes before any defence
  (a tensor whose L2 norm exceeds a bound, or a recovered update that is not finite, is refused).

Hostile numbers: a NaN/inf value is never covered (:func:`combine`), a non-finite norm clips its
update to zero (:func:`clip_scales`) and is left out of the adaptive bound
(:func:`quantile_bound`), a vector that is not finite or whose squared distances overflow gets an
infinite Krum score and is never selected (:func:`krum_select`).

Flower's ``fedmedian`` / ``fedtrimmedavg`` / ``krum`` assume every reply holds every element;
the coverage masks are what is added here (with full coverage the results agree with Flower's
helpers, see ``tests/test_robust.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

State = dict[str, Tensor]
Coverage = Mapping[str, Tensor] | None

RULES = ("mean", "median", "trimmed_mean")


def covered(state: Mapping[str, Tensor], coverage: Coverage, key: str, shape: Sequence[int]) -> Tensor:
    """Boolean tensor of ``shape``: the elements of ``key`` this reply covers."""
    if key not in state:
        return torch.zeros(tuple(shape), dtype=torch.bool)
    if coverage is None:
        return torch.ones(tuple(shape), dtype=torch.bool)
    mask = coverage.get(key)
    return torch.zeros(tuple(shape), dtype=torch.bool) if mask is None else mask.to(torch.bool)


def with_class_rows(
    state: Mapping[str, Tensor], coverage: Coverage, holds: np.ndarray, classifier_keys: Sequence[str]
) -> dict[str, Tensor]:
    """A coverage where the classifier rows (first dimension: classes) of classes the client does
    not hold are uncovered (``holds``: one flag per class)."""
    out = {key: covered(state, coverage, key, value.shape) for key, value in state.items()}
    rows = torch.as_tensor(np.asarray(holds, dtype=bool))
    for key in classifier_keys:
        if key in out:
            out[key] = out[key] & rows.view(-1, *([1] * (out[key].dim() - 1)))
    return out


# ----------------------------------------------------------------------------------- norms


def update_norms(updates: Sequence[Mapping[str, Tensor]], coverages: Sequence[Coverage]) -> np.ndarray:
    """L2 norm of every update over the elements it covers (float64)."""
    out = []
    for delta, coverage in zip(updates, coverages):
        total = 0.0
        for key, value in delta.items():
            if not value.is_floating_point():
                continue
            part = value.to(torch.float64) * covered(delta, coverage, key, value.shape)
            total += float((part * part).sum())
        out.append(total**0.5)
    return np.asarray(out, dtype=np.float64)


def clip_scales(norms: Sequence[float] | np.ndarray, bound: float) -> np.ndarray:
    """``min(1, bound / ‖Δ‖)`` per update (an update of norm 0 keeps scale 1; a NaN or infinite
    norm gets scale 0: nothing of that update is kept)."""
    if not bound > 0 or not math.isfinite(bound):
        raise ValueError(f"clipping bound must be finite and > 0, got {bound!r}")
    n = np.asarray(norms, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        scales = np.where(n > bound, bound / np.maximum(n, 1e-300), 1.0)
    return np.where(np.isfinite(n), scales, 0.0)


def quantile_bound(norms: Sequence[float] | np.ndarray, quantile: float) -> float:
    """The adaptive bound: the ``quantile`` of the round's finite update norms (linear
    interpolation; NaN when none is finite)."""
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"quantile must be in (0, 1], got {quantile!r}")
    n = np.asarray(norms, dtype=np.float64)
    n = n[np.isfinite(n)]
    return float(np.quantile(n, quantile)) if n.size else math.nan


def robust_z(norms: Sequence[float] | np.ndarray) -> np.ndarray:
    """``(‖Δ‖ - median) / (1.4826 · MAD)``; with MAD 0, 0 for the median's value and inf otherwise."""
    n = np.asarray(norms, dtype=np.float64)
    med = np.median(n)
    mad = 1.4826 * np.median(np.abs(n - med))
    if mad == 0:
        return np.where(np.isclose(n, med, rtol=1e-12, atol=0.0), 0.0, np.inf)
    return (n - med) / mad


def outlier_keep(norms: Sequence[float] | np.ndarray, z: float) -> np.ndarray:
    """Which replies the norm filter keeps: robust z-score at most ``z`` (only too-large norms are
    outliers; a small update is harmless)."""
    if not z > 0:
        raise ValueError(f"outlier z must be > 0, got {z!r}")
    return robust_z(norms) <= z


# ----------------------------------------------------------------------------------- combine


def _combine_key(prev: Tensor, values: Tensor, cover: Tensor, rule: str, weights: Tensor, trim: float) -> Tensor:
    """One tensor: ``values``/``cover`` are (clients, *shape) float64 / bool."""
    count = cover.sum(dim=0)
    if rule == "mean":
        w = weights.view(-1, *([1] * prev.dim())) * cover
        total = w.sum(dim=0)
        mixed = (w * values).sum(dim=0) / total.clamp_min(1e-300)
        held = total > 0
    else:
        x = np.where(cover.numpy(), values.numpy(), np.nan)
        x = np.sort(x, axis=0)  # NaN (uncovered) last
        idx = np.arange(x.shape[0]).reshape(-1, *([1] * prev.dim()))
        c = count.numpy()
        if rule == "median":
            low, high = (c - 1) // 2, c // 2  # the middle one, or the two middle ones
            keep = (idx == low) | (idx == high)
        else:
            k = np.floor(trim * c).astype(np.int64)
            keep = (idx >= k) & (idx < c - k)
        kept = keep.sum(axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            mixed = torch.as_tensor(np.where(keep, x, 0.0).sum(axis=0) / np.maximum(kept, 1))
        held = count > 0
    return torch.where(held, mixed, prev.to(torch.float64)).to(prev.dtype)


def combine(
    previous: Mapping[str, Tensor],
    values: Sequence[Mapping[str, Tensor]],
    coverages: Sequence[Coverage],
    rule: str = "mean",
    weights: Sequence[float] | np.ndarray | None = None,
    trim: float = 0.0,
) -> State:
    """The new state: every element over the clients covering it (see the module docstring).

    ``weights`` (one per client, default 1) weight the ``mean`` and are renormalised per element
    over its covering clients; ``median`` and ``trimmed_mean`` are order statistics, unweighted.
    A NaN or infinite value does not cover its element. Non-floating tensors and elements nobody
    covers keep ``previous``.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {list(RULES)}, got {rule!r}")
    if not values or len(values) != len(coverages):
        raise ValueError("need one coverage per client state, and at least one state")
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trim fraction must be in [0, 0.5), got {trim!r}")
    w = (
        torch.ones(len(values), dtype=torch.float64)
        if weights is None
        else torch.as_tensor(np.asarray(weights, dtype=np.float64))
    )
    if w.shape != (len(values),) or bool((w < 0).any()):
        raise ValueError("weights must be non-negative, one per client")
    out: State = {}
    for key, prev in previous.items():
        if not prev.is_floating_point():
            out[key] = prev.clone()
            continue
        cover = torch.stack([covered(v, c, key, prev.shape) for v, c in zip(values, coverages)])
        stacked = torch.stack(
            [v[key].to(torch.float64) if key in v else torch.zeros(prev.shape, dtype=torch.float64) for v in values]
        )
        cover &= torch.isfinite(stacked)  # a NaN/inf value covers nothing
        stacked = torch.where(cover, stacked, torch.zeros_like(stacked))  # (0 · inf would be NaN)
        if not bool(cover.any()):
            out[key] = prev.clone()
            continue
        out[key] = _combine_key(prev, stacked, cover, rule, w, trim)
    return out


# ----------------------------------------------------------------------------------- Krum


def flatten(state: Mapping[str, Tensor], keys: Sequence[str]) -> Tensor:
    """The floating tensors ``keys`` of a state as one float64 vector."""
    return torch.cat([state[k].to(torch.float64).reshape(-1) for k in keys])


def krum_scores(vectors: Tensor, f: int) -> np.ndarray:
    """Krum's score of each of ``n`` vectors (rows): the sum of its squared distances to its
    ``max(1, n - f - 2)`` nearest other vectors (the choice of Flower's ``multikrum``).

    A vector that is not finite scores inf and is nobody's neighbour; a squared distance that
    overflows float64 stays inf (so does the score of a vector it is among the nearest of). A
    lone finite vector scores 0."""
    n = vectors.shape[0]
    if f < 0:
        raise ValueError(f"f must be >= 0, got {f!r}")
    x = vectors.to(torch.float64)
    good = torch.isfinite(x).all(dim=1)
    scores = np.full(n, np.inf)
    idx = torch.nonzero(good).flatten()
    if len(idx) == 0:
        return scores
    y = x[idx]
    d = torch.cdist(y, y, compute_mode="donot_use_mm_for_euclid_dist").pow(2)  # no cancellation
    d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
    if len(idx) == 1:
        scores[int(idx[0])] = 0.0
        return scores
    closest = min(max(1, n - f - 2), len(idx) - 1)
    d.fill_diagonal_(math.inf)
    nearest = torch.sort(d, dim=1).values[:, :closest]
    scores[idx.numpy()] = nearest.sum(dim=1).numpy()
    return scores


def krum_select(vectors: Tensor, f: int, m: int = 1) -> list[int]:
    """Indices of the ``m`` vectors with the lowest Krum scores (Krum: ``m = 1``), ties by index;
    a vector of infinite score is never selected (fewer than ``m``, or none, may come back)."""
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m!r}")
    scores = krum_scores(vectors, f)
    return [int(i) for i in np.argsort(scores, kind="stable")[:m] if np.isfinite(scores[i])]


# ----------------------------------------------------------------------------------- screening


def oversized(state: Mapping[str, Tensor], bound: float, flat: Tensor | None = None) -> str | None:
    """Why a reply's tensors are refused, or None: the first floating tensor that holds NaN/inf or
    whose L2 norm (float64) exceeds ``bound``. With every factor's norm at most ``bound``, a
    recovered product ``A·B`` has norm at most ``bound²`` (``‖AB‖_F <= ‖A‖_F ‖B‖_F``): a bound of
    1e6 (at most 1e15, as the config allows) keeps every recovery and every average far from
    float32's overflow (3.4e38).

    Passes from cheap to exact, each looked at only when the one before fails: ``flat`` (every
    floating value of ``state`` in one float32 tensor, when the caller has it,
    :func:`fedhm_flwr.server.reply_arrays.reply_tensors`) by one float32 sum of squares, at most
    ``bound²`` (no tensor's norm exceeds the whole's; NaN/inf or an overflow make it fail); then one
    float32 norm per tensor (NaN/inf make it non-finite; a float32 overflow of the squares means a
    norm far above any allowed bound); then each tensor in detail."""
    if flat is not None and float(torch.dot(flat, flat)) <= bound * bound:
        return None
    floats = [v.float() for v in state.values() if v.is_floating_point()]
    if not floats or bool((torch.stack(torch._foreach_norm(floats)) <= bound).all()):  # one call for all
        return None
    for key, value in state.items():
        if not value.is_floating_point():
            continue
        if not bool(torch.isfinite(value).all()):
            return f"{key} holds NaN or Inf"
        norm = float(torch.linalg.vector_norm(value.to(torch.float64)))
        if not norm <= bound:
            return f"{key} has L2 norm {norm:.3g}, above the bound {bound:g} (aggregation.max_norm)"
    return None


def finite_updates(updates: Sequence[Mapping[str, Tensor]]) -> np.ndarray:
    """Which updates hold only finite values (a recovery that overflowed does not)."""
    return np.asarray(
        [all(bool(torch.isfinite(v).all()) for v in u.values() if v.is_floating_point()) for u in updates], dtype=bool
    )
