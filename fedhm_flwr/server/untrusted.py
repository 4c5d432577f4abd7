"""Untrusted clients in the shared round: the defences and client-level DP (the attacks the round
asks nodes to simulate are apart: :mod:`fedhm_flwr.server.simulated_attacks`).

A wrapper around the method's merge, the way Flower wraps a strategy for DP
(``flwr.serverapp.strategy.DifferentialPrivacyServerSideFixedClipping``): :class:`Untrusted` holds
the method and offers the same ``merge(server_round, global_state, replies)``, defended or made
private as configured, falling back to the method's own merge when nothing is. It never reaches
into the round: the replies carry what it needs (their node's label, the payload they were sent),
and what it refuses or measures it keeps (:attr:`Untrusted.rejected`, :attr:`Untrusted.columns`)
for the round to record. The math is in :mod:`fedhm_flwr.math.robust` (defences) and
:mod:`fedhm_flwr.math.privacy` (the accountant).

Every reply first passes :meth:`Untrusted.screen` (in the reply checks of ``aggregate_train``): a
floating tensor holding NaN/inf, or of L2 norm above ``aggregation.max_norm`` (1e6), is refused
like any malformed reply (counted in ``rejected``, reason in ``failure_reasons``); with factors
that small a recovered product cannot overflow. A recovered update that is still not finite is
refused the same way in :meth:`Untrusted.merge`, before any defence runs.

Defences work on each reply's *recovered* full-shape model ``v_p`` and coverage
(:meth:`fedhm_flwr.server.methods.method.Method.recovered`) and its update ``Δ_p = v_p - r_p``
against the model the node received, recovered the same way (``r_p``; for FedHM the truncation of the global model at
the node's rank, so the truncation error is not counted as the client's update):

* ``aggregation.outlier_z`` (any method): replies whose ``‖Δ_p‖`` has a robust z-score above it
  are dropped (counted in ``robust_rejected``) before anything else;
* ``krum``: Krum / Multi-Krum on the recovered models picks ``krum_m`` replies, which the method's
  own merge then folds in (methods whose replies cover the whole model);
* ``clip``: ``v_p ← r_p + min(1, c / ‖Δ_p‖) Δ_p`` with ``c`` fixed (``clip_norm``) or the
  ``clip_quantile`` of the round's norms, then the method's weighted mean over the covering
  clients (:meth:`fedhm_flwr.server.methods.method.Method.reply_weights`, classifier rows over the
  clients holding the class);
* ``median`` / ``trimmed_mean``: coordinate-wise, over the clients covering each element.

``dp.enabled`` (DP-FedAvg, client level; the math in :mod:`fedhm_flwr.math.privacy`): the nodes are
Poisson-sampled with ``q = fraction_train`` from a stream no client knows
(:meth:`fedhm_flwr.server.sampling.RoundSampler.sample`); each reply's whole recovered model minus the
global model (not minus its own truncation) is clipped to ``dp.clip`` ``C``, summed, divided by
the expected number of sampled clients ``m = fraction_train × num_clients`` (fixed in advance: no
level or example-count weight), and Gaussian noise of standard deviation ``σ · C / m`` is added to
every element, drawn from OS entropy (``dp.seed`` set: reproducible and not private). A round
without any reply still adds its noise. ε at ``dp.delta`` from the RDP accountant. Trust model:
the server still sees every client's individual update (central DP, not local DP); the guarantee
covers the global models only, not the per-round metrics (``update_norm_max``, the clients'
training figures, ``dp_clipped``, failure reasons), which are computed from individual replies.
"""

from __future__ import annotations

import dataclasses
import json
import math
import traceback
from collections.abc import Iterable, Sequence
from logging import ERROR, WARNING
from typing import Any, TypeVar

import torch
from flwr.app import ArrayRecord
from flwr.supercore import log

from fedhm_flwr.core import protocol as wire
from fedhm_flwr.math import privacy, robust
from fedhm_flwr.math.privacy import RdpAccountant
from fedhm_flwr.server.methods.method import Method, Reply, State


class Untrusted:
    """The method's merge, defended or made private (see the module docstring)."""

    def __init__(self, method: Method, history: list[dict[str, Any]]) -> None:
        self.method = method
        opts = method.opts
        self.opts = opts
        self.attack = opts.failures.attack
        self.agg = opts.aggregation
        self.dp = opts.dp
        self._max_norm = self.agg.max_norm
        self._active = self.agg.robust != "none" or self.agg.outlier_z > 0 or self.dp.enabled
        self.history = history  # the run's rows (a resumed run's accountant replays them; the summary)
        self.wire_dtype = opts.wire.dtype
        self.accountant = RdpAccountant() if self.dp.enabled else None
        self.columns: dict[str, Any] = {}
        self.rejected: list[tuple[int, str]] = []  # this round's replies refused here (node id, why)
        self._references: dict[int, tuple[Any, State]] = {}

    @property
    def active(self) -> bool:
        """Any defence or DP (read once: asked every round)."""
        return self._active

    @property
    def merges_empty(self) -> bool:
        """DP merges a round without replies too (its noise does not depend on who replied)."""
        return bool(self.dp.enabled)

    def screen(self, state: State, flat: torch.Tensor | None = None) -> str | None:
        """Why a reply's tensors are refused before any merge, or None (:func:`robust.oversized`;
        ``flat``: every floating value of ``state`` in one tensor, when the caller has it)."""
        return robust.oversized(state, self._max_norm, flat)

    @property
    def expected_clients(self) -> float:
        """DP's fixed denominator ``m``: the expected number of Poisson-sampled clients."""
        return self.opts.fraction_train * self.opts.num_clients

    def begin_round(self) -> None:
        """Reset the round's columns and refusals."""
        self._references = {}
        self.columns = {}
        self.rejected = []

    # ------------------------------------------------------------------ merge

    def reference(self, reply: Reply, global_state: State) -> State:
        """The recovered model the node received (``reply.sent``: its payload; cached per payload)."""
        payload = reply.sent
        cached = self._references.get(id(payload))
        if cached is None or cached[0] is not payload:
            sent = wire.from_wire(ArrayRecord.from_array_dict(payload.arrays).to_torch_state_dict(), self.wire_dtype)
            sent = {k: sent[k] for k in reply.state}
            state, _ = self.method.recovered(dataclasses.replace(reply, state=sent), global_state)
            cached = self._references[id(payload)] = (payload, state)
        return cached[1]

    def guarded_merge(self, server_round: int, global_state: State, replies: list[Reply]) -> State:
        """:meth:`merge`, which no reply can make raise or leave a non-finite model: when it does, each
        reply is recovered alone, those that fail (or recover to non-finite values) are refused with
        the reason (:attr:`rejected`) and the rest merged again; should that fail too, every reply is
        refused and the global model stays (the error is logged: a bug, not a reply's doing)."""
        try:
            new = self.merge(server_round, global_state, replies)
            if _finite(new):
                return new
            why = "the merged model is not finite"
        except Exception as exc:  # noqa: BLE001 (no reply can raise out of the round)
            why = f"merge failed: {type(exc).__name__}: {exc}"
        log(WARNING, "round %d: %s; recovering each reply alone", server_round, why)
        self.rejected, kept = [], []
        for reply in replies:
            try:
                state, _ = self.method.recovered(reply, global_state)
                problem = None if _finite(state) else "recovered model holds NaN or Inf"
            except Exception as exc:  # noqa: BLE001
                problem = f"cannot be recovered: {type(exc).__name__}: {exc}"
            if problem:
                self.rejected.append((reply.node_id, problem))
            else:
                kept.append(reply)
        try:
            if kept or self.merges_empty:
                new = self.merge(server_round, global_state, kept)
                if _finite(new):
                    return new
        except Exception:  # noqa: BLE001
            log(
                ERROR,
                "round %d: the merge fails without the replies that fail alone:\n%s",
                server_round,
                traceback.format_exc(),
            )
        self.rejected = [(r.node_id, why) for r in replies]
        return global_state

    def merge(self, server_round: int, global_state: State, replies: list[Reply]) -> State:
        s = self.method
        if not self.active:
            return s.merge(server_round, global_state, replies)
        recovered = [s.recovered(r, global_state) for r in replies]
        values = [v for v, _ in recovered]
        coverages = [c for _, c in recovered]
        refs = [global_state] * len(replies) if self.dp.enabled else [self.reference(r, global_state) for r in replies]
        updates = [
            {k: v[k].to(torch.float64) - ref[k].to(torch.float64) for k in v if v[k].is_floating_point()}
            for v, ref in zip(values, refs)
        ]
        finite = robust.finite_updates(updates)
        if not finite.all():  # refused like a malformed reply, before any defence
            for r in (r for r, ok in zip(replies, finite) if not ok):
                self.rejected.append((r.node_id, "recovered update holds NaN or Inf"))
            replies, values, coverages, refs, updates = (
                _kept(replies, finite),
                _kept(values, finite),
                _kept(coverages, finite),
                _kept(refs, finite),
                _kept(updates, finite),
            )
        norms = robust.update_norms(updates, coverages)
        if len(norms):
            self.columns["update_norm_max"] = float(norms.max())  # not private (see the module docstring)
        if self.dp.enabled:
            return self._dp_merge(server_round, global_state, values)
        if not replies:
            return global_state
        if self.agg.outlier_z > 0:
            keep = robust.outlier_keep(norms, self.agg.outlier_z)
            dropped = [r.label for r, k in zip(replies, keep) if not k]
            self.columns.update({"robust_rejected": len(dropped), "robust_rejected_nodes": json.dumps(dropped)})
            replies, values, coverages, refs, updates = (
                _kept(replies, keep),
                _kept(values, keep),
                _kept(coverages, keep),
                _kept(refs, keep),
                _kept(updates, keep),
            )
            norms = norms[keep]
        mode = self.agg.robust
        if mode == "none":
            return s.merge(server_round, global_state, replies)
        if mode == "krum":
            keys = [k for k, v in global_state.items() if v.is_floating_point()]
            vectors = torch.stack([robust.flatten(v, keys) for v in values])
            f = math.ceil(self.agg.krum_fraction * len(replies) - 1e-9)  # the assumed attackers among them
            picked = robust.krum_select(vectors, f, min(int(self.agg.krum_m), len(replies)))
            self.columns["krum_selected"] = json.dumps([replies[i].label for i in picked])
            return s.merge(server_round, global_state, [replies[i] for i in picked]) if picked else global_state
        if mode == "clip":
            bound = self.agg.clip_norm or robust.quantile_bound(norms, self.agg.clip_quantile)
            scales = robust.clip_scales(norms, max(bound, 1e-12))
            self.columns.update({"clip_bound": bound, "clipped": int((scales < 1).sum())})
            values = [_shifted(v, ref, u, a) for v, ref, u, a in zip(values, refs, updates, scales)]
        masks = [
            robust.with_class_rows(v, c, r.class_counts > 0, s.classifier_keys)
            for v, c, r in zip(values, coverages, replies)
        ]
        rule = "mean" if mode == "clip" else mode
        weights = s.reply_weights(replies) if rule == "mean" else None
        return robust.combine(global_state, values, masks, rule, weights, self.agg.trim_fraction)

    def _dp_merge(self, server_round: int, global_state: State, values: list[State]) -> State:
        """DP-FedAvg (:func:`privacy.dp_mean`): whole recovered models minus the global, clipped to
        C, summed over ``m`` (fixed), plus Gaussian noise σ·C/m from a secret stream."""
        clip, sigma, m = self.dp.clip, self.dp.noise_multiplier, self.expected_clients
        new, scales = privacy.dp_mean(global_state, values, clip, m)
        std = privacy.noise_std(sigma, clip, m)
        new = privacy.add_noise(new, std, privacy.noise_generator(self.dp.seed, server_round))
        self._replay(server_round)
        q = self.opts.fraction_train
        assert self.accountant is not None
        self.accountant.step(q, sigma)
        self.columns.update(
            {
                "dp_clipped": int((scales < 1).sum()),
                "dp_noise_std": std,
                "dp_q": q,
                "dp_sigma": sigma,
                "dp_expected_clients": m,
                "dp_epsilon": self.accountant.epsilon(self.dp.delta),
            }
        )
        return new

    def _replay(self, server_round: int) -> None:
        """A resumed run's accountant: the earlier rounds' rates, from their metrics rows."""
        assert self.accountant is not None
        if self.accountant.steps == 0:
            for row in self.history:
                if row.get("dp_q") is not None and int(row["round"]) < server_round:
                    self.accountant.step(float(row["dp_q"]), float(row["dp_sigma"]))

    def summary(self) -> dict[str, Any]:
        """What the run's summary adds: attack and defence totals, final ε."""
        rows = self.history
        out: dict[str, Any] = {}
        if self.attack.kind != "none":
            out.update(
                {
                    "attack": self.attack.kind,
                    "attack_fraction": self.attack.fraction,
                    "attackers_sampled": int(sum(r.get("attackers_count", 0) for r in rows)),
                }
            )
        if self.active:
            out.update(
                {"robust": self.agg.robust, "robust_rejected": int(sum(r.get("robust_rejected", 0) for r in rows))}
            )
        if self.dp.enabled:
            eps = [r["dp_epsilon"] for r in rows if r.get("dp_epsilon") is not None]
            out.update(
                {
                    "dp_epsilon": eps[-1] if eps else 0.0,
                    "dp_delta": self.dp.delta,
                    "dp_noise_multiplier": self.dp.noise_multiplier,
                    "dp_clip": self.dp.clip,
                }
            )
        return out


def _finite(state: State) -> bool:
    """Every floating tensor of ``state`` finite (one max-abs per tensor: no overflow on the way)."""
    floats = [v for v in state.values() if v.is_floating_point()]
    return not floats or bool(torch.stack(torch._foreach_norm(floats, math.inf)).isfinite().all())


def _shifted(value: State, reference: State, update: State, scale: float) -> State:
    """``reference + scale · update`` on the update's keys (the others as in ``value``); scale 0
    gives the reference itself (never ``0 · inf``)."""
    if scale >= 1.0:
        return value
    out = dict(value)
    for key, delta in update.items():
        moved = reference[key].to(torch.float64) + (float(scale) * delta if scale > 0 else 0.0)
        out[key] = moved.to(value[key].dtype)
    return out


_T = TypeVar("_T")


def _kept(items: Sequence[_T], keep: Iterable[object]) -> list[_T]:
    """The items whose flag in ``keep`` is true."""
    return [x for x, k in zip(items, keep) if k]
