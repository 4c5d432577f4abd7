"""The capacity study's "Why this setting" on the results pages: the probe's figures, read from
``results/probe/capacity.json`` (:mod:`bench.capacity_probe` writes them)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.studies import STUDIES

PROBE_REPORT = Path("probe") / "capacity.json"


def probe_section(root: Path) -> list[str]:
    """Why the capacity setting: the probe's figures, read from ``results/probe/capacity.json``."""
    path = root / PROBE_REPORT
    if not path.is_file():
        return ["No capacity probe report yet (`python -m bench.capacity_probe`)."]
    data = json.loads(path.read_text())
    chosen = [n for n, e in data["candidates"].items() if e["overrides"] == STUDIES["capacity"].common]
    table = path.with_suffix(".md")  # the probe's own table, written with the JSON
    lines = [table.read_text().rstrip() if table.is_file() else "", ""]
    if chosen:
        e = data["candidates"][chosen[0]]
        gap = (
            f"full − smallest {e['gap_mean'] * 100:+.2f} pt, 95 % CI [{e['gap_low'] * 100:+.2f}, "
            f"{e['gap_high'] * 100:+.2f}] over {len(e['seeds'])} seeds"
            if "gap_mean" in e
            else "no interval yet"
        )
        lines.append(
            f"The capacity study uses candidate **{chosen[0]}** ({e['description']}): {gap}, "
            f"{'which meets' if e.get('meets') else 'which does NOT meet'} the criterion; estimated run "
            f"time of the whole study {e.get('estimated_study_seconds', float('nan')) / 3600:.1f} h (summed "
            f"over its runs; about {e.get('estimated_study_seconds', float('nan')) / 7200:.1f} h on 2 worker "
            f"processes). {adopted(root, chosen[0])} of its runs are the probe's own, copied unchanged."
        )
        overlap = sorted(set(e["seeds"]) & set(STUDIES["capacity"].seeds))
        if overlap:
            lines += [
                "",
                f"**Flagged: the probe chose this setting on seed(s) {', '.join(map(str, overlap))}, which "
                "the study then judges the methods on: a setting chosen on the seeds that judge it is "
                "chosen for their luck too. The probe is to be re-run on seeds disjoint from the study's "
                "(`python -m bench.capacity_probe` now refuses others) and the study's copied runs "
                "re-run.**",
            ]
    else:
        lines.append("The capacity study's setting is none of the probed candidates.")
    return lines


def adopted(root: Path, candidate: str) -> int:
    """How many of the capacity study's runs are byte-identical copies of the probe's runs."""
    probe, study = root / "probe" / candidate, root / STUDIES["capacity"].folder
    return sum(
        1
        for src in probe.rglob("summary.json")
        if (study / src.relative_to(probe)).is_file()
        and (study / src.relative_to(probe)).read_bytes() == src.read_bytes()
    )
