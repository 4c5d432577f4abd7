"""How long the missing runs of ``make results`` should take, from what was measured (no figure is
typed in code), in this order of preference for one run of a study and method:

1. the finished runs of the same study and method: the mean of their whole job's seconds;
2. the study's own shortened runs (``<study folder>/rounds<N>/``, written by ``make results
   ARGS="--study S --rounds N ..."``, e.g. the full study's probe): each run's seconds per round of
   training and per evaluation (medians over its rounds), from its ``metrics.jsonl``
   rows, projected onto the study's own rounds and evaluation cadence, plus what the run spent
   outside those (start-up, the last round's deployment statistics) (:func:`project`);
3. the same for the method it stands in for (:data:`bench.studies.STAND_IN`: a memory-matched
   width's run costs as the parameter-matched one's);
4. the reference (cheap) study's mean for the method, times the median ratio study / reference
   over the methods both have figures for.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from bench.studies import ROOT, STAND_IN, STUDIES, VARIANTS, Job, Study, finished


def job_seconds(path: Path) -> float:
    """A finished run's seconds: the whole job's (``job_seconds``, Ray's start-up included) where
    recorded, else the run's ``wall_seconds``."""
    info = json.loads((path / "summary.json").read_text())
    return float(info.get("job_seconds", info["wall_seconds"]))


def measured_seconds(root: Path) -> dict[tuple[str, str, str], list[float]]:
    """(study, variant, transport) -> the seconds (:func:`job_seconds`) of every finished run of every study."""
    out: dict[tuple[str, str, str], list[float]] = {}
    for st in STUDIES.values():
        for s in st.settings:
            for v in VARIANTS:
                for path in sorted((root / st.folder / s / v).glob("seed*")):
                    if finished(path):
                        info = json.loads((path / "summary.json").read_text())
                        out.setdefault((st.key, v, info.get("transport", "grid")), []).append(job_seconds(path))
    return out


def evaluations(rounds: int, every: int) -> int:
    """How many rounds of ``rounds`` are evaluated: every ``every``-th and the last."""
    return rounds // every + (rounds % every != 0)


def per_round(rows: list[dict[str, Any]], seconds: float) -> tuple[float, float, float]:
    """(seconds of a round's training, of an evaluation, of the rest) of a run from its metrics rows
    (``seconds`` of each round, evaluation included, and ``eval_seconds`` where it evaluated) and its
    whole ``seconds``: a round's training and an evaluation are their medians over the rows (what a
    first round's warm-up or the last round's deployment statistics add counts once, in the rest)."""
    train = statistics.median(float(r["seconds"]) - float(r.get("eval_seconds", 0.0)) for r in rows)
    evals = [float(r["eval_seconds"]) for r in rows if "eval_seconds" in r]
    per_eval = statistics.median(evals) if evals else 0.0
    return train, per_eval, max(0.0, seconds - len(rows) * train - len(evals) * per_eval)


def project(rows: list[dict[str, Any]], seconds: float, rounds: int, every: int) -> float:
    """The seconds of a run of ``rounds`` rounds evaluated every ``every`` rounds, from another run of
    the same work (:func:`per_round`)."""
    train, per_eval, rest = per_round(rows, seconds)
    return rest + rounds * train + evaluations(rounds, every) * per_eval


@functools.lru_cache(maxsize=32)
def schedule(overrides: str) -> tuple[int, int]:
    """(rounds, evaluation.every) of the composed config of ``overrides``."""
    from fedhm_flwr.config import load_config

    cfg = load_config(overrides)
    return int(cfg.rounds), int(cfg.evaluation.every)


def probe_runs(root: Path, study: Study) -> dict[str, list[Path]]:
    """Variant -> the finished shortened runs of ``study`` (``<folder>/rounds<N>/<setting>/<variant>/seed<k>``)."""
    out: dict[str, list[Path]] = {}
    for short in sorted((root / study.folder).glob("rounds*")):
        for path in sorted(short.glob("*/*/seed*")):
            if finished(path) and path.parent.name in VARIANTS:
                out.setdefault(path.parent.name, []).append(path)
    return out


def projected_seconds(root: Path, studies: list[Study] | None = None) -> dict[tuple[str, str], float]:
    """(study, variant) -> the mean of :func:`project` over the study's shortened runs of the method,
    onto the study's own rounds and cadence."""
    from fedhm_flwr.reporting.summary_stats import read_metrics

    out = {}
    for st in studies or list(STUDIES.values()):
        for variant, paths in probe_runs(root, st).items():
            rounds, every = schedule(st.overrides(st.settings[0], variant, st.seeds[0]))
            out[(st.key, variant)] = statistics.fmean(
                project(read_metrics(p), job_seconds(p), rounds, every) for p in paths
            )
    return out


def estimate(
    measured: dict[tuple[str, str, str], list[float]],
    projected: dict[tuple[str, str], float],
    study: str,
    variant: str,
    transport: str = "grid",
    reference: str = "cheap",
) -> tuple[float | None, str]:
    """(the expected seconds of one run, where the figure came from): see the module docstring."""

    def mean_of(st: str, v: str, tr: str | None = None) -> float | None:
        values = [x for (s, m, t), xs in measured.items() if s == st and m == v and tr in (None, t) for x in xs]
        return statistics.fmean(values) if values else None

    for v in dict.fromkeys((variant, STAND_IN.get(variant, variant))):
        whose = "" if v == variant else f" (as {v}'s)"
        for value, source in (
            (mean_of(study, v, transport), "finished runs"),
            (mean_of(study, v), "finished runs"),
            (projected.get((study, v)), "probe"),
        ):
            if value is not None:
                return value, source + whose
    own = {v: a if (a := mean_of(study, v)) is not None else projected.get((study, v)) for v in VARIANTS}
    like = variant if mean_of(reference, variant) is not None else STAND_IN.get(variant, variant)
    base, whose = mean_of(reference, like), "" if like == variant else f" (as {like}'s)"
    ratios = [a / b for v, a in own.items() if a is not None and (b := mean_of(reference, v))]
    if base is None:
        return None, "nothing measured"
    if ratios:
        return base * statistics.median(ratios), f"{reference} × ratio{whose}"
    return base, f"{reference}'s{whose}"


def estimate_seconds(
    measured: dict[tuple[str, str, str], list[float]],
    study: str,
    variant: str,
    transport: str = "grid",
    reference: str = "cheap",
    projected: dict[tuple[str, str], float] | None = None,
) -> float | None:
    """The expected wall time of one run (:func:`estimate` without its source)."""
    return estimate(measured, projected or {}, study, variant, transport, reference)[0]


SOURCES = {
    "finished runs": "the mean of the finished runs of the same study and method",
    "probe": "the seconds per round of the study's shortened runs (<study>/rounds<N>/), projected onto its "
    "rounds and evaluation cadence",
    "cheap × ratio": "the cheap study's time for the method × the median ratio of this study's to the cheap one's",
    "cheap's": "the cheap study's time for the method (nothing of this study measured)",
}


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def job_estimates(root: Path, todo: list[Job]) -> list[tuple[float | None, str]]:
    """(estimated seconds, source) of each job of ``todo``."""
    measured, projected = measured_seconds(root), projected_seconds(root)
    return [estimate(measured, projected, j.study, j.variant, j.transport) for j in todo]


def plan(root: Path, todo: list[Job], jobs: int) -> list[str]:
    """What ``make results`` will run: per study and setting (a study's ``lead`` seeds apart, in the
    order they run), the missing runs and their estimated time and where it came from, then the
    total (run time summed, and wall time on ``jobs`` worker processes)."""
    measured = measured_seconds(root)
    estimates = job_estimates(root, todo)
    lines, total, unknown = [], 0.0, 0
    groups: dict[tuple[str, str, bool], list[int]] = {}
    for i, job in enumerate(todo):
        lead = STUDIES[job.study].lead if job.study in STUDIES else None
        first = bool(lead and job.setting == lead[0] and job.seed in lead[1])
        groups.setdefault((job.study, job.setting, first), []).append(i)
    for (study, setting, _), members in groups.items():
        known = [e for i in members if (e := estimates[i][0]) is not None]
        total += math.fsum(known)
        unknown += len(members) - len(known)
        ray = sum(todo[i].transport == "ray" for i in members)
        ray_unmeasured = ray and not any(k[0] == study and k[2] == "ray" for k in measured)
        seeds = sorted({todo[i].seed for i in members})
        label = f", seed(s) {', '.join(map(str, seeds))}" if study in STUDIES and STUDIES[study].lead else ""
        lines.append(
            f"  {study} {setting}{label}: {len(members)} run(s) missing ({ray} on Ray), estimated "
            f"{hours(math.fsum(known))} of run time"
            + (f" + {len(members) - len(known)} run(s) with nothing measured yet" if len(known) < len(members) else "")
            + (" (Ray runs from in-process times: no Ray run of this study measured yet)" if ray_unmeasured else "")
        )
        counts = {k: len(list(g)) for k, g in itertools.groupby(sorted(estimates[i][1] for i in members))}
        lines.append("    estimated from: " + "; ".join(f"{n} run(s): {source}" for source, n in counts.items()))
    used = {source.split(" (as ")[0] for _, source in estimates}
    probes = sorted(
        str(p.parents[2].relative_to(root))
        for st in {j.study for j in todo}
        if st in STUDIES
        for paths in probe_runs(root, STUDIES[st]).values()
        for p in paths
    )
    # the repository's folders without the machine's path (the page quotes the plan)
    under = root.resolve().relative_to(ROOT) if root.resolve().is_relative_to(ROOT) else root
    for source in [s for s in SOURCES if s in used]:
        where = (
            f" ({', '.join(f'{n} run(s) in {f}/' for f, n in Counter(probes).items())})" if source == "probe" else ""
        )
        lines.append(f"  [{source}]: {SOURCES[source]}{where}")
    lines.append(
        f"make results: {len(todo)} run(s) missing under {under}; estimated {hours(total)} of run time, "
        f"about {hours(total / max(1, jobs))} on {jobs} worker process(es)"
        + (f" (+ {unknown} run(s) not estimated)" if unknown else "")
    )
    return lines
