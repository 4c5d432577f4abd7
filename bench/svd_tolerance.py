"""The tolerance of FedHM's fast decomposition (``method.svd_tolerance``), measured:
``python -m bench.svd_tolerance`` writes the table of docs/METHODS.md#fedhm-svd-tolerance.

A small, cheap setting (the default CNN on a Fashion-MNIST subset, in process, a few rounds), run
for every tolerance and seed in two ways:

* ``decomposition``: the run as it is at that tolerance (float32 ``eigh`` of the Gram matrix,
  accepted when every truncation's backward error is within the tolerance, else after one float32
  step of subspace iteration, else float64, else the exact SVD); the decompositions that stayed
  float32 (and of those, the ones after the subspace step) are counted;
* ``admitted``: the worst the check lets through, made real: every hand-out is the exact truncated
  SVD of the layer's weight plus a random perturbation of relative Frobenius size = the tolerance
  (fresh every round and layer).

against the reference: the exact float64 SVD every time. Seed noise is the spread of the
reference's final accuracy over the seeds. Writes ``bench/reports/svd_tolerance.json`` and the
marked block of docs/METHODS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
METHODS = ROOT / "docs" / "METHODS.md"
START, END = "<!-- svd-tolerance:start -->", "<!-- svd-tolerance:end -->"
REPORT = ROOT / "bench" / "reports" / "svd_tolerance.json"
OVERRIDES = [
    "rounds=10",
    "num_clients=10",
    "fraction_train=0.5",
    "dataset.max_train_examples=6000",
    "dataset.max_test_examples=2000",
    "evaluation.levels=false",
]
TOLERANCES = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2)
EXACT = 1e-300  # no float32 or float64 Gram passes: the exact float64 SVD


def one_run(seed: int, tolerance: float, mode: str, overrides: list[str]) -> dict[str, Any]:
    """One in-process run; ``mode``: ``decomposition`` or ``admitted`` (see the module doc)."""
    import torch
    from safetensors.torch import load_file

    import fedhm_flwr.server.methods.fedhm as fedhm_module
    from fedhm_flwr.config import load_config
    from fedhm_flwr.math import lowrank
    from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
    from fedhm_flwr.ops.apps.server_app import run
    from fedhm_flwr.reporting.results import CHECKPOINT_DIR, MODEL_FILE

    paths = {"float32": 0, "refined": 0, "float64": 0, "exact": 0}  # refined: float32 after the subspace step
    real, step = fedhm_module.compute_svds, lowrank._subspace_step
    draws = iter(range(10**9))
    stepped = []

    def counted_step(*args):
        stepped.append(True)
        return step(*args)

    def counted(full_state, names, ranks=None, tol=lowrank.SVD_TOLERANCE):
        svds = {}
        for name in names:  # one layer at a time: whether its float32 result took the subspace step
            stepped.clear()
            svd = svds[name] = real(full_state, [name], ranks, tol)[name]
            full = lowrank.full_rank(full_state[f"{name}.weight"].shape)
            paths["float32" if svd.S.dtype == torch.float32 else "exact" if svd.S.numel() == full else "float64"] += 1
            paths["refined"] += bool(stepped) and svd.S.dtype == torch.float32
        return svds

    def admitted(full_state, names, ranks=None, tol=lowrank.SVD_TOLERANCE):
        out = {}
        for name in names:
            weight = full_state[f"{name}.weight"]
            noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(1000 * seed + next(draws)))
            moved = weight + tolerance * weight.norm() / noise.norm() * noise
            out[name] = lowrank.layer_svd(moved, (ranks or {}).get(name, ()), tolerance=EXACT)
        return out

    fedhm_module.compute_svds = counted if mode == "decomposition" else admitted
    lowrank._subspace_step = counted_step
    try:
        cfg = load_config([*overrides, f"seed={seed}", f"method.svd_tolerance={tolerance}"])
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            run(LocalGrid(int(cfg.num_clients), client_handlers()), cfg, Path(tmp))
            wall = time.perf_counter() - t0
            rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
            model = load_file(str(Path(tmp) / CHECKPOINT_DIR / MODEL_FILE))
    finally:
        fedhm_module.compute_svds, lowrank._subspace_step = real, step
    return {
        "seed": seed,
        "tolerance": tolerance,
        "mode": mode,
        "final_acc": rows[-1]["acc/global"],
        "final_loss": rows[-1]["loss/global"],
        "paths": paths,
        "wall_seconds": wall,
        "model": {k: v for k, v in model.items()},
    }


def _distance(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Relative Frobenius distance between two final global models (floating tensors)."""
    num = sum(float((a[k].double() - b[k].double()).square().sum()) for k in a if a[k].is_floating_point())
    den = sum(float(b[k].double().square().sum()) for k in b if b[k].is_floating_point())
    return (num / den) ** 0.5


def measure(seeds: list[int], overrides: list[str]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)  # in-process clients set their own; the machine is shared
    runs: list[dict[str, Any]] = []
    arms = [(EXACT, "decomposition")] + [(t, m) for t in TOLERANCES for m in ("decomposition", "admitted")]
    for tolerance, mode in arms:
        for seed in seeds:
            r = one_run(seed, tolerance, mode, overrides)
            print(
                f"[svd-tolerance] tol {tolerance:g} {mode} seed {seed}: acc {r['final_acc']:.4f} "
                f"paths {r['paths']} ({r['wall_seconds']:.0f} s)",
                flush=True,
            )
            runs.append(r)
    reference = {r["seed"]: r for r in runs if r["tolerance"] == EXACT}
    for r in runs:
        ref = reference[r["seed"]]
        r["acc_minus_exact_pt"] = 100 * (r["final_acc"] - ref["final_acc"])
        r["model_distance_to_exact"] = _distance(r["model"], ref["model"])
    for r in runs:
        del r["model"]
    return {"overrides": overrides, "seeds": seeds, "tolerances": list(TOLERANCES), "runs": runs}


def table(result: dict[str, Any], command: str) -> str:
    runs, seeds = result["runs"], result["seeds"]
    ref = [r["final_acc"] for r in runs if r["tolerance"] == EXACT]
    noise = statistics.stdev(ref) if len(ref) > 1 else 0.0
    L = [
        START,
        "",
        f"Generated by `{command}` ({result.get('commit', '?')}, {result.get('date', '?')}): FedHM, "
        f"`{' '.join(result['overrides'])}`, seeds {', '.join(map(str, seeds))}, in process. Seed noise (standard "
        f"deviation of the exact SVD's final accuracy over the seeds): **{100 * noise:.2f} pt**.",
        "",
        "| tolerance | hand-out | decompositions float32 (of which after the subspace step) / float64 / exact "
        "| final accuracy per seed | mean | "
        "mean − exact (pt) | final model's distance to the exact run's (relative) |",
        "|---|---|---|---|---|---|---|",
    ]
    arms = [(EXACT, "decomposition")] + [(t, m) for t in result["tolerances"] for m in ("decomposition", "admitted")]
    for tolerance, mode in arms:
        rows = [r for r in runs if r["tolerance"] == tolerance and r["mode"] == mode]
        accs = [r["final_acc"] for r in rows]
        paths = {k: sum(r["paths"].get(k, 0) for r in rows) for k in ("float32", "refined", "float64", "exact")}
        label = "exact SVD" if tolerance == EXACT else f"{tolerance:g}"
        what = {
            "decomposition": "as decomposed" if tolerance != EXACT else "reference",
            "admitted": "exact cut of W + Δ, ‖Δ‖ = tol·‖W‖",
        }[mode]
        counts = (
            f"{paths['float32']} ({paths['refined']}) / {paths['float64']} / {paths['exact']}"
            if mode == "decomposition"
            else "—"
        )
        dist = max(r["model_distance_to_exact"] for r in rows)
        L.append(
            f"| {label} | {what} | {counts} | {' '.join(f'{a:.4f}' for a in accs)} | {statistics.mean(accs):.4f} | "
            f"{statistics.mean(r['acc_minus_exact_pt'] for r in rows):+.2f} | "
            f"{'—' if tolerance == EXACT else f'≤ {dist:.1e}'} |"
        )
    L += ["", END]
    return "\n".join(L)


def write_block(block: str, path: Path = METHODS) -> None:
    text = path.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{path} lacks the markers {START} … {END}")
    head, rest = text.split(START, 1)
    path.write_text(head + block + rest.split(END, 1)[1])


def main(argv: list[str] | None = None) -> int:
    import datetime as dt

    from bench.results import commit

    parser = argparse.ArgumentParser(
        prog="python -m bench.svd_tolerance", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--render", action="store_true", help="rewrite the block from the saved report only")
    args = parser.parse_args(argv)
    command = "python -m bench.svd_tolerance"
    if args.render:
        result = json.loads(REPORT.read_text())
    else:
        result = measure([int(s) for s in args.seeds.split(",")], OVERRIDES)
        result["commit"], result["date"] = commit(), dt.date.today().isoformat()
        REPORT.parent.mkdir(parents=True, exist_ok=True)
        REPORT.write_text(json.dumps(result, indent=1))
    block = table(result, command)
    write_block(block)
    print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
