"""What of a study is finished and what is missing, for ``docs/RESULTS.md``: per setting and method,
the seeds with a finished run, the seeds still missing and the estimated time of each missing run
(:mod:`bench.estimates`: from finished runs, the study's probe or the cheap study), read from the run
folders; shown for every study with a missing run."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.estimates import SOURCES, hours, job_estimates, job_seconds, per_round, probe_runs
from bench.studies import LABELS, TITLES, Study, finished, missing, run_dir


def _seeds(seeds: list[int]) -> str:
    return ", ".join(map(str, seeds)) or "–"


def progress_lines(root: Path, study: Study) -> list[str]:
    """The study's "finished and missing" table (empty when nothing is missing)."""
    todo = missing(root, [study])
    if not todo:
        return []
    estimates = dict(zip(todo, job_estimates(root, todo)))
    rows = []
    for setting in study.settings:
        for variant in study.variants:
            done = [k for k in study.seeds_of(setting) if finished(run_dir(study, setting, variant, k, root))]
            jobs = [j for j in todo if j.setting == setting and j.variant == variant]
            known = [e for j in jobs if (e := estimates[j][0]) is not None]
            each = f"{hours(known[0])} each" if known and len(set(known)) == 1 else f"{hours(math.fsum(known))} in all"
            rows.append(
                f"| {TITLES[setting]} | {LABELS[variant]} | {_seeds(done)} | {_seeds([j.seed for j in jobs])} | "
                + (
                    f"{each} ({', '.join(sorted({estimates[j][1] for j in jobs}))})"
                    if known
                    else "–"
                    if not jobs
                    else "not estimated"
                )
                + " |"
            )
    known_all = [e for e, _ in estimates.values() if e is not None]
    first = [j for j in todo if study.lead and j.setting == study.lead[0] and j.seed in study.lead[1]]
    lines = [
        "### What is finished and what is missing",
        "",
        f"{sum(finished(run_dir(study, s, v, k, root)) for s, v, k in study.runs())} of {len(study.runs())} runs "
        f"finished; {len(todo)} missing, estimated {hours(math.fsum(known_all))} of run time"
        + (f" ({len(todo) - len(known_all)} not estimated)" if len(known_all) < len(todo) else "")
        + (
            f"; they run in this order: {TITLES[study.lead[0]]} seeds {_seeds(list(study.lead[1]))} of every method "
            f"first ({len(first)} still missing), then the rest seed by seed"
            if study.lead
            else ""
        )
        + f' (`make results ARGS="--study {study.key}"`; `ARGS="--plan --study {study.key}"` prints the plan).',
        "",
        "| setting | method | finished seeds | missing seeds | estimated time per missing run (from) |",
        "|---|---|---|---|---|",
        *rows,
        "",
        *(f"- {source}: {text}" for source, text in SOURCES.items() if any(source in e[1] for e in estimates.values())),
        *probe_lines(root, study),
        "",
    ]
    return lines


def probe_lines(root: Path, study: Study) -> list[str]:
    """The measured figures behind the "probe" estimates: each shortened run's seconds per round."""
    from fedhm_flwr.reporting.summary_stats import read_metrics

    lines = []
    for variant, paths in probe_runs(root, study).items():
        for path in paths:
            info = json.loads((path / "summary.json").read_text())
            train, per_eval, rest = per_round(read_metrics(path), job_seconds(path))
            lines.append(
                f"  - {LABELS[variant]}: `{path.relative_to(root)}` ({info.get('rounds_completed')} rounds on "
                f"{info.get('machine')}, finished {info.get('finished_at')}): {train:.1f} s per round of training, "
                f"{per_eval:.1f} s per evaluation, {rest:.0f} s besides"
            )
    return (
        [
            "- the probe's runs (medians over their rounds):",
            *lines,
        ]
        if lines
        else []
    )
