"""The work a simulated node does before round 1, counted (never timed): a worker process decodes its
data and partitions it once for all the nodes it serves, and a later process reads the partitions the
first one computed (the launcher's check computes them; the simulation's workers then import no
flwr-datasets), the same indices bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from data_helpers import REPO, needs_fmnist
from flwr.app import Context, RecordDict

from fedhm_flwr.client import handlers
from fedhm_flwr.config import data_spec, load_config
from fedhm_flwr.data import cache
from fedhm_flwr.data.sources import check_partitions, partition_indices

NODES = 8
OVERRIDES = f"num_clients={NODES} dataset.max_train_examples=3000 partition.scheme=dirichlet"


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """A disk cache of the test's own, and nothing cached in this process."""
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    cache.clear_caches()
    yield tmp_path / "cache"
    cache.clear_caches()


def _spec() -> dict:
    return data_spec(load_config(OVERRIDES.split()))


def _query_every_node(spec: dict) -> list[int]:
    """The node-info answer of every node, as one worker process serving them all gives it."""
    examples = []
    for pid in range(NODES):
        context = Context(
            run_id=1,
            node_id=pid + 1,
            node_config={"partition-id": pid, "num-partitions": NODES},
            state=RecordDict(),
            run_config={},
        )
        examples.append(int(handlers.node_info(context, spec)["num-examples"]))
    return examples


@needs_fmnist
def test_one_process_answering_every_node_decodes_and_partitions_once(own_cache):
    spec = _spec()
    before = dict(cache.WORK)
    examples = _query_every_node(spec)
    work = {k: cache.WORK[k] - before.get(k, 0) for k in ("decode", "partition", "partition-read")}
    assert work == {"decode": 1, "partition": 1, "partition-read": 0}  # the training split, once for 8 nodes
    assert len(examples) == NODES and all(n > 0 for n in examples)

    # a new process (nothing in memory) reads the partitions back instead of computing them again
    computed = partition_indices(spec)
    cache.clear_caches()
    before = dict(cache.WORK)
    assert _query_every_node(spec) == examples
    read = partition_indices(spec)
    work = {k: cache.WORK[k] - before.get(k, 0) for k in ("decode", "partition", "partition-read")}
    assert work == {"decode": 1, "partition": 0, "partition-read": 1}
    assert len(read) == len(computed) == NODES
    for a, b in zip(read, computed):
        assert a.dtype == b.dtype == np.int64 and np.array_equal(a, b)


@needs_fmnist
def test_a_broken_partition_file_is_computed_again_to_the_same_indices(own_cache):
    spec = _spec()
    computed = [p.copy() for p in partition_indices(spec)]
    files = list((own_cache / "partitions").glob("*.npz"))
    assert len(files) == 1
    sizes = np.array([len(p) for p in computed], dtype=np.int64)
    flat = np.concatenate(computed)
    wrong = {
        "not an npz": None,
        "an index out of range": {"sizes": sizes, "indices": np.where(flat == flat.max(), 10**9, flat)},
        "sizes that do not add up": {"sizes": sizes + 1, "indices": flat},
        "another dtype": {"sizes": sizes, "indices": flat.astype(np.int32)},
        "unsorted partitions": {"sizes": sizes, "indices": flat[::-1].copy()},
    }
    for why, content in wrong.items():
        if content is None:
            files[0].write_bytes(b"not a numpy file")
        else:
            np.savez(files[0], **content)
        cache.clear_caches()
        before = cache.WORK["partition"]
        again = partition_indices(spec)
        assert cache.WORK["partition"] == before + 1, why
        assert all(np.array_equal(a, b) for a, b in zip(again, computed)), why


@needs_fmnist
def test_a_process_that_finds_the_partitions_on_disk_imports_no_flwr_datasets(own_cache):
    spec = _spec()
    partition_indices(spec)  # this process computes them, as the launcher's check does
    code = (
        "import json, sys\n"
        "from fedhm_flwr.data.sources import partition_indices\n"
        f"parts = partition_indices(json.loads({json.dumps(json.dumps(spec))}))\n"
        "print(json.dumps([sorted(m for m in ('flwr_datasets', 'datasets') if m in sys.modules), len(parts)]))\n"
    )
    env = {"PATH": "/usr/bin:/bin", cache.CACHE_ENV: str(own_cache)}

    def imported(env: dict[str, str]) -> list:
        cmd = [sys.executable, "-c", code]
        run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=True)
        return json.loads(run.stdout.splitlines()[-1])

    assert imported(env) == [[], NODES]
    # where the disk holds nothing, the same process computes them with flwr-datasets
    assert imported({**env, cache.CACHE_ENV: str(own_cache.parent / "empty")}) == [["datasets", "flwr_datasets"], NODES]


@needs_fmnist
def test_the_launchers_check_decodes_no_image_and_leaves_the_partitions_for_the_nodes(own_cache):
    spec = _spec()
    before = dict(cache.WORK)
    check_partitions(spec)  # the launcher, before anything starts
    assert cache.WORK["decode"] == before.get("decode", 0)  # the labels' file only
    assert cache.WORK["partition"] == before.get("partition", 0) + 1
    cache.clear_caches()  # a simulation worker: another process
    before = dict(cache.WORK)
    _query_every_node(spec)
    work = {k: cache.WORK[k] - before.get(k, 0) for k in ("decode", "partition", "partition-read")}
    assert work == {"decode": 1, "partition": 0, "partition-read": 1}
