"""FedRolex (docs/METHODS.md#fedrolex): HeteroFL's sub-models cut by a rolling window.

In round ``j`` a layer with ``K`` channels keeps ``{(i + j) mod K : i < ceil(rate·K)}``; the window
moves forward one channel per round and wraps, and all clients of a round share it. Here
``j = server_round - 1``: Flower's first round uses the first ``ceil(rate·K)`` channels, as
HeteroFL does (:func:`fedhm_flwr.math.width.window_start`). Aggregation, Scaler, clipping and masked
cross-entropy are HeteroFL's. A level's deployable model is its sub-model under the window of
the round just trained (the model its clients would hold).
"""

from __future__ import annotations

from fedhm_flwr.config.options.width import FedRolexOptions
from fedhm_flwr.server.methods.heterofl import HeteroFL


class FedRolex(HeteroFL):
    """HeteroFL with a rolling channel window."""

    name = "fedrolex"
    options = FedRolexOptions
    mode = "rolling"
