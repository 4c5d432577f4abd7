"""Which nodes train a round: the round's sample over the nodes' stable keys.

One job: the draw. A round samples ``fraction_train`` of the known nodes (at least
``min_train_nodes``) with a generator seeded by the run's seed and the round
(:func:`fedhm_flwr.math.levels.sample_clients`); a DP run draws each node in with probability
``fraction_train`` instead (Poisson sampling, what the privacy accountant assumes) from a stream no
client knows (:class:`PoissonDraws`). A node not yet asked for its node info
(``availability.query = sampled``) takes part by a hash of its node id.
"""

from __future__ import annotations

from collections.abc import Iterable

from fedhm_flwr.config.options import RunOptions
from fedhm_flwr.math import levels as lv
from fedhm_flwr.math.privacy import poisson_sample, secret_uniform
from fedhm_flwr.server.known_nodes import KnownNodes, hashed_key


class PoissonDraws:
    """DP runs: each key in with probability ``fraction`` (no minimum), drawn once per round and key
    (:func:`fedhm_flwr.math.privacy.secret_uniform`; kept, so that the prefetch and the round see the
    same draw)."""

    def __init__(self, fraction: float, seed: int | None) -> None:
        self.fraction, self.seed = fraction, seed
        self._draws: dict[int, dict[int, float]] = {}  # round -> key -> its secret uniform draw

    def sample(self, server_round: int, keys: list[int]) -> list[int]:
        for old in [r for r in self._draws if r < server_round - 1]:
            del self._draws[old]
        mine = self._draws.setdefault(server_round, {})
        uniform = secret_uniform(self.seed, server_round)
        return poisson_sample(keys, self.fraction, lambda k: mine[k] if k in mine else mine.setdefault(k, uniform(k)))


class RoundSampler:
    """The nodes that train a round (see the module docstring)."""

    def __init__(self, opts: RunOptions, known: KnownNodes) -> None:
        self.known = known
        # the round's rules, read once (a config lookup costs more than a round's sampling at 10 nodes)
        self.seed, self.dp = opts.seed, opts.dp.enabled
        self.fraction, self.min_train = opts.fraction_train, opts.min_train_nodes
        self.poisson = PoissonDraws(self.fraction, opts.dp.seed)  # DP: the round's sample

    def sample(
        self, server_round: int, nodes: Iterable[int] | None = None, unknown: Iterable[int] | None = None
    ) -> list[int]:
        """The nodes that train this round (seeded by round, over the stable keys; a node not yet
        queried takes part by a hash of its node id), drawn from the known nodes (or ``nodes``, known
        ones) and the ones not yet queried (or ``unknown``)."""
        keys = {self.known.key(n): n for n in (self.known.nodes if nodes is None else nodes)}
        keys.update({hashed_key(f"node:{n}"): n for n in (self.known.unknown if unknown is None else unknown)})
        if self.dp:  # the accountant's Poisson sampling, from a stream no client knows
            return [keys[k] for k in self.poisson.sample(server_round, list(keys))]
        picked = lv.sample_clients(
            list(keys), self.fraction, self.min_train, lambda: lv.round_rng(self.seed, server_round, stream=0)
        )
        return [keys[k] for k in picked]
