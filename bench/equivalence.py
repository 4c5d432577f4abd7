"""Whether a later commit trains the same models as a study's commit: the standard that lets runs made
after a study's commit join it (docs/RESULTS.md, "code versions").

A study's runs are on one clean commit. A method added later (FIARSE after the full study's ``e59c115``)
can only run at a later commit; its runs join the study when the later commit trains, for every method
both commits have, the same final model bit for bit. This command checks that and keeps the record:

    python -m bench.equivalence e59c115 HEAD

runs, at each commit (its files taken with ``git archive``, this virtualenv), fixed-seed in-process
runs of every method in :data:`CASES` the commit has (``conf/method/<name>.yaml``), each on one thread,
and compares a SHA-256 of each final global model (``checkpoint/global_model.safetensors``, tensors by
name). It writes ``results/equivalence/<base>-<later>.json``; the later commit is certified when every
method both commits have gives the same digest (:func:`certified`). A method only the later commit has
is listed as such: its runs are the new ones.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.studies import ROOT

#: where the records are kept
RECORDS = ROOT / "results" / "equivalence"
#: small fixed-seed runs (2 rounds, 4 clients, a width-8 CNN on 400 examples) of each method
COMMON = (
    "rounds=2 num_clients=4 fraction_train=1.0 model.width=8 dataset.max_train_examples=400 "
    "dataset.max_test_examples=200 tracking.tensorboard=false seed=3"
)
CASES = {
    "fedhm": "method=fedhm",
    "fedhm_iid": "method=fedhm partition.scheme=iid",
    "heterofl": "method=heterofl",
    "heterofl_memory": "method=heterofl levels.match=fedhm_memory",
    "fedrolex": "method=fedrolex",
    "fjord": "method=fjord",
    "fedavg": "method=fedavg",
    "fedavg_smallest": "method=fedavg_smallest",
    "prism": "method=prism",
    "fiarse": "method=fiarse",
}
#: the runs, in the commit's own code (its module paths have moved: both are tried)
CHILD = r"""
import hashlib, json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
torch.set_num_threads(1)
try:
    from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
    from fedhm_flwr.ops.apps.server_app import run
except ImportError:
    from fedhm_flwr.ops.local_grid import LocalGrid, client_handlers
    from fedhm_flwr.ops.server_app import run
from fedhm_flwr.config import load_config
out, cases = Path(sys.argv[1]), json.loads(sys.argv[2])
digests = {}
for name, overrides in cases.items():
    cfg = load_config(overrides)
    run(LocalGrid(int(cfg.num_clients), client_handlers()), cfg, out / name)
    tensors = load_file(str(out / name / "checkpoint" / "global_model.safetensors"))
    h = hashlib.sha256()
    for key in sorted(tensors):
        h.update(key.encode())
        h.update(tensors[key].contiguous().numpy().tobytes())
    digests[name] = h.hexdigest()
print("DIGESTS " + json.dumps(digests))
"""


def resolve(commit: str) -> str:
    """The short hash of ``commit`` (as runs record ``code_commit``)."""
    return subprocess.run(
        ["git", "rev-parse", "--short", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def methods_at(commit: str) -> list[str]:
    """The cases whose method the commit has (its ``conf/method/<name>.yaml``)."""
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", commit, "conf/method/"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    have = {Path(n).stem for n in names}
    return [case for case, overrides in CASES.items() if overrides.split()[0].removeprefix("method=") in have]


def digests_at(commit: str, cases: list[str], work: Path) -> dict[str, str]:
    """Each case's final-model digest, run in the commit's own files."""
    tree = work / commit
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    overrides = {case: f"{COMMON} {CASES[case]}" for case in cases}
    env = {**os.environ, "PYTHONPATH": str(tree)}  # the commit's package first (this one is installed editable)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(work / f"{commit}-runs"), json.dumps(overrides)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    found = [line for line in done.stdout.splitlines() if line.startswith("DIGESTS ")]
    if done.returncode != 0 or not found:
        raise SystemExit(f"bench.equivalence: the runs at {commit} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(found[-1].removeprefix("DIGESTS ")))


def compare(base: str, later: str, base_digests: Mapping[str, str], later_digests: Mapping[str, str]) -> dict[str, Any]:
    """The record of two commits' digests: which methods both have and whether each is identical."""
    shared = sorted(set(base_digests) & set(later_digests))
    return {
        "base": base,
        "later": later,
        "runs": COMMON,
        "cases": {c: CASES[c] for c in sorted(set(base_digests) | set(later_digests))},
        "digests": {"base": dict(base_digests), "later": dict(later_digests)},
        "identical": [c for c in shared if base_digests[c] == later_digests[c]],
        "differ": [c for c in shared if base_digests[c] != later_digests[c]],
        "only_later": sorted(set(later_digests) - set(base_digests)),
    }


def certified(record: Mapping[str, Any]) -> bool:
    """Whether the record certifies its later commit: some methods compared, all identical."""
    return bool(record.get("identical")) and not record.get("differ")


def records(root: Path = RECORDS) -> dict[tuple[str, str], dict[str, Any]]:
    """The kept records, by (base, later) short hash."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(root.glob("*.json")) if root.is_dir() else []:
        record = json.loads(path.read_text())
        out[(str(record["base"]), str(record["later"]))] = record
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.equivalence", description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="the study's commit")
    parser.add_argument("later", help="the later commit whose runs are to join it")
    parser.add_argument("--out", type=Path, default=RECORDS, help="where the record is written")
    args = parser.parse_args(argv)
    base, later = resolve(args.base), resolve(args.later)
    cases = methods_at(later)
    with tempfile.TemporaryDirectory(prefix="fedhm-equivalence-") as tmp:
        work = Path(tmp)
        later_digests = digests_at(later, cases, work)
        base_digests = digests_at(base, [c for c in methods_at(base) if c in cases], work)
    record = compare(base, later, base_digests, later_digests)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{base}-{later}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    verdict = "certified" if certified(record) else "NOT certified"
    print(
        f"bench.equivalence: {later} against {base}: {len(record['identical'])} method(s) identical, "
        f"{len(record['differ'])} differ {record['differ']}, new at {later}: {record['only_later']}; {verdict}; {path}"
    )
    return 0 if certified(record) else 1


if __name__ == "__main__":
    raise SystemExit(main())
