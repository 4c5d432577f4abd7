"""``docs/RESULTS.md``, its archive ``docs/RESULTS_ARCHIVE.md`` (which study goes where:
:mod:`bench.results_archive`) and the README's results block from the finished runs of :mod:`bench.results`.

No number on the page is typed by hand: the tables (:mod:`bench.results_tables`), the verdicts
(:mod:`fedhm_flwr.reporting.verdicts`), the reason for the second setting (the probe's
``results/probe/capacity.json``) and the plots (:func:`fedhm_flwr.reporting.summary_plots.write_plots`) all
come from the run folders.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

from bench.estimates import plan
from bench.page_notes import (
    DEPLOYABLE,
    SHOWN,
    aggregation_lines,
    bn_sample_line,
    code_lines,
    recipe_lines,
    run_version,
    statistics_line,
    use_deployable,
)
from bench.results_archive import archive_head, archive_page, archived, main_head
from bench.results_choice import choice_section
from bench.results_pareto import INTERPOLATION, _cost, add_costs, pareto_section
from bench.results_probe import probe_section
from bench.results_progress import progress_lines
from bench.results_rounds import gap_section
from bench.results_tables import fedhm_vs_heterofl, headline, level_table, paired_table
from bench.results_verdicts import LAST_K, RULE_K, resource_table, verdict_table
from bench.studies import (
    FIGURES,
    LABELS,
    PAGE,
    STUDIES,
    TITLES,
    TRANSPORTS,
    VARIANTS,
    Study,
    finished,
    missing,
    run_dir,
)
from fedhm_flwr.reporting.verdicts import RULE, smallest_level

README_START, README_END = "<!-- results:start -->", "<!-- results:end -->"


def variant_rows(root: Path, study: Study, setting: str) -> list[dict[str, Any]]:
    """One row per finished run of ``setting`` (as :func:`fedhm_flwr.reporting.summary.collect` reads it),
    named by its variant (``fedavg_smallest`` rather than ``fedavg method.variant=smallest``), with
    the run's commit, machine, finishing time and transport."""
    from fedhm_flwr.reporting.summary import collect
    from fedhm_flwr.reporting.summary_stats import last_evaluations, read_metrics

    dirs = [
        run_dir(study, setting, v, k, root)
        for v in study.variants
        for k in study.seeds_of(setting)
        if finished(run_dir(study, setting, v, k, root))
    ]
    if not dirs:
        return []
    _, rows = collect(dirs)
    for row in rows:
        path = Path(row["dir"])
        row["method"] = path.parent.name
        info = json.loads((path / "summary.json").read_text())
        row.update({k: info.get(k) for k in ("commit", "machine", "finished_at", "bn_stats", "deployable_bn_stats")})
        row.update({k: v for k, v in info.items() if k.startswith((DEPLOYABLE, "code_"))})
        row["transport"] = info.get("transport", "grid")
        row.update(last_evaluations(read_metrics(path), LAST_K))
    return rows


def study_rows(root: Path, study: Study) -> dict[str, list[dict[str, Any]]]:
    """Setting -> its finished runs' rows, shown with the deployable accuracy when every run of the
    study recorded it (:func:`bench.page_notes.use_deployable`), else all with the test-batch figure."""
    rows = {s: variant_rows(root, study, s) for s in study.settings}
    use_deployable([r for setting in rows.values() for r in setting])
    add_costs([r for setting in rows.values() for r in setting])
    return rows


def transport_line(study: Study, rows: list[dict[str, Any]], mixed_code: bool = False) -> str:
    """Which finished runs used which transport (from each run's ``summary.json``)."""
    parts = []
    for transport, what in TRANSPORTS.items():
        runs = [r for r in rows if r["transport"] == transport]
        if runs:
            seeds = sorted({int(r["seed"]) for r in runs})
            parts.append(f"{what}: {len(runs)} run(s), seed(s) {', '.join(map(str, seeds))}")
    planned = (
        f" (planned: seed(s) {', '.join(map(str, study.ray_seeds))} of every method on Ray, the others "
        "on the in-process grid)"
        if study.ray_seeds
        else " (every run planned on the in-process grid)"
    )
    return (
        "- transport: "
        + ("; ".join(parts) or "no finished run yet")
        + planned
        + (
            "; both run the project's server loop (strategy, messages, ClientApp handlers)"
            + (
                ", but the runs' code differs too (see the code versions): the transport is not the only difference"
                if mixed_code
                else ": the transport is the only difference"
            )
        )
    )


def setting_section(rows: list[dict[str, Any]], key: tuple[str, str], out: Path, page: Path) -> list[str]:
    """The section of study and setting ``key``."""
    from fedhm_flwr.reporting.summary_plots import write_plots

    title = TITLES[key[1]]
    if not rows:
        return [f"### {title}", "", "No finished run yet.", ""]
    write_plots(["method", "seed"], rows, out, costs=False)
    rel = os.path.relpath(out, page.parent)
    return [
        f"### {title}",
        "",
        fedhm_vs_heterofl(rows),
        "",
        "#### Headline: final global accuracy",
        "",
        *headline(rows),
        "",
        "#### Paired differences against FedHM (same seed)",
        "",
        *paired_table(rows),
        "",
        "#### Per level",
        "",
        *level_table(rows),
        "",
        f"![accuracy by round]({rel}/accuracy_by_round.png)",
        "",
        f"![accuracy against bytes moved]({rel}/accuracy_vs_bytes.png)",
        "",
        "#### Which method for which constraint",
        "",
        *choice_section(rows),
        "",
        *gap_section(rows, title, out, page),
        *pareto_section(rows, key, out, page),
    ]


def shown_studies(root: Path, replaced: dict[str, Study] | None = None) -> list[Study]:
    """The studies on the page: every default study and any other with a finished run under ``root``
    (e.g. CIFAR-10's, for a user who ran it), each replaced by ``replaced``'s (a shortened one) where given."""
    out = []
    for key, st in STUDIES.items():
        st = (replaced or {}).get(key, st)
        if st.default or any(finished(run_dir(st, s, v, k, root)) for s, v, k in st.runs()):
            out.append(st)
    return out


def render(
    root: Path,
    studies: list[Study] | None = None,
    figures: Path = FIGURES,
    page: Path = PAGE,
    head: list[str] | None = None,
) -> str:
    """The Markdown of a results page for ``studies`` (by default :func:`shown_studies`) from the
    finished runs under ``root``, opening with ``head`` (by default the main page's title and opening,
    :func:`bench.results_archive.main_head`); writes the plots into ``figures`` (``figures/<setting>``
    for the cheap study, ``figures/<study>/<setting>`` otherwise)."""
    studies = shown_studies(root) if studies is None else studies
    all_rows = {(st.key, s): rows for st in studies for s, rows in study_rows(root, st).items()}
    runs = [r for rows in all_rows.values() for r in rows]
    expected = sum(len(st.runs()) for st in studies)
    commits = sorted({run_version(r) for r in runs})
    machines = sorted({str(r.get("machine")) for r in runs})
    hours = sum(float(r["wall_seconds"]) for r in runs) / 3600
    lines = [
        *(main_head(page) if head is None else head),
        f"- command: `make results` (runs {len(runs)} of {expected}: "
        + "; ".join(
            f"{st.key}: {len(st.settings)} settings × {len(st.variants)} methods × seeds "
            + (
                ", ".join(f"{s} {_span(st.seeds_of(s))}" for s in st.settings)
                if st.setting_seeds
                else ", ".join(map(str, st.seeds))
            )
            for st in studies
        )
        + ")",
        f"- code: {', '.join(f'`{c}`' for c in commits)} (each run's code is in its `summary.json`: `code_commit` "
        "and `code_dirty` when it started, `commit` when it finished; per study below); page generated "
        + dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        f"- machine: {'; '.join(machines)}; runs made {min(str(r.get('finished_at')) for r in runs) if runs else '-'}"
        f" to {max(str(r.get('finished_at')) for r in runs) if runs else '-'}; total wall time of the runs "
        f"{hours:.2f} h (one thread per run, up to `--jobs` runs at a time on a machine shared with other work; "
        "wall time of each run below)",
        "- methods: "
        + "; ".join(f"{LABELS[v]}: `{o}`" for v, o in VARIANTS.items() if any(v in st.variants for st in studies)),
        "- per study below: the batch-norm statistics behind its accuracies (test-batch or deployable), its runs' "
        "code versions (flagged where they are not one clean commit) and the training options that differ by method",
        "- statistics: mean ± sample standard deviation over seeds, 95 % confidence intervals from the "
        "Student-t distribution (`fedhm_flwr/math/stats.py`); paired differences are taken seed by seed (same "
        "partitions, sampling and initial model)",
        "",
        "## Verdicts",
        "",
        f"Rule (`fedhm_flwr/reporting/verdicts.py`): {RULE}. The smallest level is the smallest γ present in the runs "
        f"(γ = {smallest_level(runs)}). {RULE_K}",
        "",
        *verdict_table(all_rows, {st.key: st.variants for st in studies}),
        "",
        "Per resource (parameters, MACs, training memory; their units and meaning in each setting's section), "
        "FedHM's smallest level against each baseline family at equal cost: against the family's runs matched "
        f"on that resource, level by level; where none was, *interpolated*: {INTERPOLATION}",
        "",
        *resource_table(all_rows, _cost),
        "",
    ]
    for st in studies:
        rows_of = {s: all_rows[(st.key, s)] for s in st.settings}
        study_runs = [r for rows in rows_of.values() for r in rows]
        code, flagged = code_lines(study_runs)
        lines += [
            f"## Study `{st.key}`: {st.title}",
            "",
            f"- work: `{st.common}` with `partition.alpha` 0.5 and 0.1 (Dirichlet over labels), i.e. {st.work}",
            statistics_line(study_runs),
            *(
                [bn_sample_line(study_runs)]
                if study_runs and all(r.get(SHOWN) == "deployable" for r in study_runs)
                else []
            ),
            *code,
            transport_line(st, study_runs, flagged),
            "",
            "### Training recipe",
            "",
            *recipe_lines({LABELS[v]: st.overrides(st.settings[0], v, st.seeds[0]) for v in st.variants}),
            "",
            *aggregation_lines({LABELS[v]: st.overrides(st.settings[0], v, st.seeds[0]) for v in st.variants}),
            "",
        ]
        if st.key == "capacity":
            lines += ["### Why this setting", "", *probe_section(root), ""]
        lines += progress_lines(root, st)
        for s in st.settings:
            out = figures / st.folder / s
            lines += setting_section(rows_of[s], (st.key, s), out, page)
    todo = missing(root, studies)
    lines += [
        "## Missing runs",
        "",
        "```",
        *(plan(root, todo, 2) if todo else ["none"]),
        "```",
        "",
        "## Every run",
        "",
        "| study | setting | method | seed | transport | final accuracy (%) | wall time (s) | code | finished |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (study, setting), rows in all_rows.items():
        for r in sorted(rows, key=lambda r: (list(VARIANTS).index(r["method"]), r["seed"])):
            lines.append(
                f"| {study} | {setting} | {r['method']} | {r['seed']} | {r['transport']} | "
                f"{float(r['final_acc/global']) * 100:.2f} | {float(r['wall_seconds']):.0f} | "
                f"{run_version(r)} | {r.get('finished_at')} |"
            )
    return "\n".join(lines) + "\n"


def _span(seeds: tuple[int, ...]) -> str:
    return (
        f"{seeds[0]}–{seeds[-1]}"
        if len(seeds) > 2 and list(seeds) == list(range(seeds[0], seeds[-1] + 1))
        else ", ".join(map(str, seeds))
    )


def readme_block(root: Path, studies: list[Study] | None = None) -> str:
    """The README's quote of the page: per study and setting, the FedHM − HeteroFL sentence and the
    headline table."""
    lines = [README_START, ""]
    for st in shown_studies(root) if studies is None else studies:
        rows_of = study_rows(root, st)
        lines += [
            f"**{st.key}**: finished runs per setting: "
            + "; ".join(
                f"{TITLES[s]} {len(rows_of[s])} of {sum(1 for x in st.runs() if x[0] == s)}" for s in st.settings
            )
            + " (the others are listed with their estimated time on the page).",
            "",
        ]
        for setting, rows in rows_of.items():
            if rows:
                lines += [
                    f"**{st.key}, {TITLES[setting]}**: {fedhm_vs_heterofl(rows).replace('**', '')}",
                    "",
                    *headline(rows),
                    "",
                    *choice_section(rows, smallest_only=True),
                    "",
                ]
    lines += [
        "Generated by `make results`; verdicts, details, plots and every run in [docs/RESULTS.md](docs/RESULTS.md); "
        "the studies that do not meet its standard in [docs/RESULTS_ARCHIVE.md](docs/RESULTS_ARCHIVE.md).",
        "",
        README_END,
    ]
    return "\n".join(lines)


def update_readme(readme: Path, block: str) -> None:
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        raise SystemExit(f"{readme}: no {README_START} ... {README_END} block to update")
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(head + block + tail)


def write_page(
    root: Path,
    page: Path = PAGE,
    figures: Path = FIGURES,
    readme: Path | None = None,
    replaced: dict[str, Study] | None = None,
) -> None:
    """Write the page and its archive page (:func:`bench.results_archive.archive_page`) for
    :func:`shown_studies` (``replaced``: see there), each study on the one its runs place it on
    (:func:`bench.results_archive.archived`), and the README's block for the main page's studies."""
    from fedhm_flwr.reporting.results import atomic_write

    studies = shown_studies(root, replaced)
    why = archived(root, studies)
    current = [st for st in studies if st.key not in why]
    atomic_write(page, render(root, current, figures, page))
    old = [st for st in studies if st.key in why]
    head = archive_head(page, why, [st.key for st in current])
    atomic_write(archive_page(page), render(root, old, figures, archive_page(page), head))
    if readme is not None:
        update_readme(readme, readme_block(root, current))
