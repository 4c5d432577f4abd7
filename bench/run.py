"""What the method and the framework cost, measured side by side (``make bench``).

Figures (each in one process, compared things on the same machine state, medians over repeats):

1. server time per round (factorize, build messages, recover, aggregate) of FedHM against FedAvg
   on the same model and number of replies; FedHM's whole server round (configure + aggregate +
   the evaluation's share of the factorization) against its floor (bench/floors.py, plain torch:
   one float32 ``eigh`` of the Gram matrix per factorizable layer plus one weighted average of the
   replies by stacked factor products, timed bare in the same process); and the server's share of a
   round's wall time;
2. bytes per client per round for each level, measured from the serialized messages, against the
   full model, next to the parameter-count ratio;
3. training-step time of each level's model against the full model (CPU at 1 thread and at all
   cores; GPU too when present), next to the MACs ratio, and their quotient against its target,
   for the clients' step and the step as it was; the profile of a level that misses its target;
4. local-training throughput inside a Flower simulation (``flwr run``, Ray) against a bare
   PyTorch loop on the same model, data and cores;
5. scale: 1000 simulated clients, 100 per round, through ``flwr run``: round 1 ÷ round 2, node-query
   time ÷ round time, server time ÷ round time, peak memory of the whole process tree;
6. ``wire.dtype``: bytes both ways and the accuracy cost of float16 / bfloat16 against float32
   (the default job, a few rounds in process, same seed);
7. checkpoint time ÷ round time, a checkpoint every round (the CNN and ResNet-18);
8. the whole job (``fedhm run``, process start to exit) part by part (start-up by part, training, server
   work, evaluation, messaging, the final statistics query) against an independent bare loop doing the
   same training and evaluations, for the default job and a 100-client job; a two-job sweep with one
   shared Ray instance and with one per job;
9. the final statistics query's sample (``evaluation.bn_clients`` × ``evaluation.bn_examples``): the
   seconds it adds to the last round against each level's deployable accuracy, for the default, the
   previous default and every node's every example, on the same fixed-seed job;
10. each job's time outside its rounds, part by part, against an independent start-up floor (server
   imports, ``ray.init``, two actors importing torch and decoding the data) measured in the same run, for
   the default job and the jobs of a 2-round sweep;
11. level evaluation's share of the default job's round time (``eval_seconds`` ÷ ``seconds`` of each round,
   median over the rounds) against its target.

Writes ``bench/reports/bench.json`` and ``bench/reports/bench.md``. ``--quick`` shrinks every
figure (for a smoke test); ``--only 1,3`` runs some figures; ``--scale-clients 10000`` adds the
10,000-client run to figure 5 (kept in ``bench/scale/``, shown by every later report).

The figures live by subject: :mod:`bench.server` (1, 2), :mod:`bench.training` (3, 4),
:mod:`bench.scale` (5), :mod:`bench.jobs` (6, 7), :mod:`bench.whole_job` (8),
:mod:`bench.deploy_sample` (9), :mod:`bench.startup` (10), :mod:`bench.eval_share` (11); their floors in
:mod:`bench.floors`, :mod:`bench.engine_floor` (5), :mod:`bench.whole_job_floor` (8) and
:mod:`bench.startup_floor` (10).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.deploy_sample import deploy_sample_markdown, figure_deploy_sample
from bench.eval_share import eval_share_markdown, figure_eval_share
from bench.jobs import checkpoint_markdown, figure_checkpoint, figure_wire, wire_markdown
from bench.scale import figure_scale
from bench.scale_report import scale_markdown
from bench.server import bytes_markdown, figure_bytes, figure_server_time, server_time_markdown
from bench.startup import figure_startup, startup_markdown
from bench.training import figure_throughput, figure_train_step, throughput_markdown, train_step_markdown
from bench.whole_job import figure_whole_job, whole_job_markdown

REPORT_DIR = Path(__file__).resolve().parent / "reports"

#: figure number -> (its key in the report, the function measuring it, the one writing its section)
FIGURES: dict[str, tuple[str, Callable[..., dict[str, Any]], Callable[[dict[str, Any]], list[str]]]] = {
    "1": ("1_server_time", figure_server_time, server_time_markdown),
    "2": ("2_bytes", figure_bytes, bytes_markdown),
    "3": ("3_train_step", figure_train_step, train_step_markdown),
    "4": ("4_throughput", figure_throughput, throughput_markdown),
    "5": ("5_scale", figure_scale, scale_markdown),
    "6": ("6_wire", figure_wire, wire_markdown),
    "7": ("7_checkpoint", figure_checkpoint, checkpoint_markdown),
    "8": ("8_whole_job", figure_whole_job, whole_job_markdown),
    "9": ("9_deploy_sample", figure_deploy_sample, deploy_sample_markdown),
    "10": ("10_startup", figure_startup, startup_markdown),
    "11": ("11_eval_share", figure_eval_share, eval_share_markdown),
}


def markdown(report: dict[str, Any]) -> str:
    """The report: the machine, then each figure's section in figure order."""
    L = ["# fedhm-flwr benchmarks", "", f"{report['machine']}", ""]
    for name, _, section in FIGURES.values():
        if report.get("figures", {}).get(name):
            figure = report["figures"][name]
            head, *rest = section(figure)
            L += [head, "", f"_Measured {figure.get('measured', 'with the report')}._", *rest]
    return "\n".join(L)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument("--only", default=",".join(FIGURES), help="comma-separated figure numbers")
    parser.add_argument("--out", type=Path, default=REPORT_DIR)
    parser.add_argument(
        "--scale-clients",
        type=int,
        default=None,
        help="figure 5 also runs this many clients, 100 per round (e.g. 10000; heavy), "
        "saved to bench/scale/scale-N.json for later reports",
    )
    args = parser.parse_args(argv)
    keys = [key.strip() for key in args.only.split(",")]
    unknown = [key for key in keys if key not in FIGURES]
    if unknown:
        parser.error(f"--only: unknown figure(s) {unknown}; allowed: {', '.join(FIGURES)}")
    if args.scale_clients is not None and args.scale_clients <= 100:
        parser.error(f"--scale-clients must be above 100 (100 clients train per round), got {args.scale_clients}")
    report: dict[str, Any] = {
        "machine": f"{platform.node()} · {os.cpu_count()} CPUs · torch {torch.__version__} · "
        f"{'CUDA ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}",
        "quick": args.quick,
        "figures": {},
    }
    earlier = args.out / "bench.json"
    if earlier.is_file():  # --only: the figures not measured now stay as they were, with when and where
        kept = json.loads(earlier.read_text())
        if bool(kept.get("quick")) == args.quick:
            report["figures"] = {
                name: {"measured": kept.get("machine"), **figure} for name, figure in kept.get("figures", {}).items()
            }
    for key in keys:
        name, measure, _ = FIGURES[key]
        t0 = time.perf_counter()
        print(f"[bench] figure {name} ...", flush=True)
        extra = {"scale_clients": args.scale_clients} if key == "5" else {}
        report["figures"][name] = {
            "measured": f"{time.strftime('%Y-%m-%d %H:%M')} · {report['machine']}",
            **measure(args.quick, **extra),
        }
        print(f"[bench] figure {name} done in {time.perf_counter() - t0:.0f} s", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench.json").write_text(json.dumps(report, indent=1))
        (args.out / "bench.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
