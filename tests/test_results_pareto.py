"""The results page's per-resource part (bench/results_pareto.py, fedhm_flwr/reporting/pareto.py):
interpolation in log-cost, the per-resource verdict, the cost fallback from a run's saved config,
and the section rendered from the tracked runs.

Expected values are computed here by hand (the t quantile is a literal from a t table)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from bench import results_page as page_mod, studies
from bench.results_pareto import _cost, add_costs, config_costs, pareto_section, recount
from bench.results_verdicts import resource_table
from bench.studies import STUDIES, finished
from fedhm_flwr.reporting.pareto import interpolate, level_costs, resource_verdicts
from fedhm_flwr.reporting.verdicts import matched_label

T_975_DF2 = 4.302652729749464  # Student t, 0.975 quantile, 2 degrees of freedom (t table)
CHEAP = studies.STUDIES["cheap"]
TRACKED = studies.RUNS


def test_interpolation_is_linear_in_log_cost():
    # log 200 lies log 2 / log 10 of the way from log 100 to log 1000
    assert interpolate([100, 1000], [0.5, 0.8], 200) == pytest.approx(0.5 + 0.3 * math.log10(2))
    assert interpolate([1000, 100], [0.8, 0.5], math.sqrt(1e5)) == pytest.approx(0.65)  # geometric middle
    assert interpolate([100, 400, 1000], [0.5, 0.7, 0.8], 200) == pytest.approx(0.6)  # middle of 100 .. 400
    assert interpolate([100, 1000], [0.5, 0.8], 1000) == 0.8 and interpolate([100, 1000], [0.5, 0.8], 100) == 0.5
    assert interpolate([100, 1000], [0.5, 0.8], 99.9) is None
    assert interpolate([100, 1000], [0.5, 0.8], 1000.1) is None
    with pytest.raises(ValueError, match="distinct"):
        interpolate([100, 100], [0.5, 0.8], 100)
    with pytest.raises(ValueError, match="positive"):
        interpolate([0, 100], [0.5, 0.8], 50)


def synthetic_rows() -> list[dict]:
    """A baseline measured at MACs 100, 400, 1000 and FedHM at 1000 (the baseline's edge), 200 (the
    middle of 100 .. 400 in log) and 50 (below the baseline's range), three seeds."""
    base = {"1": (1000, [0.80, 0.82, 0.81]), "0.5": (400, [0.70, 0.70, 0.72]), "0.125": (100, [0.60, 0.62, 0.61])}
    ours = {"1": (1000, [0.70, 0.71, 0.72]), "0.25": (200, [0.80, 0.82, 0.81]), "0.125": (50, [0.10, 0.10, 0.10])}
    rows = []
    for method, levels in (("heterofl", base), ("fedhm", ours)):
        for seed in range(3):
            row = {"method": method, "seed": seed}
            for g, (macs, accs) in levels.items():
                row[f"macs/level_{g}"] = macs
                row[f"final_acc/level_{g}"] = accs[seed]
            rows.append(row)
    return rows


def hand_ci(diffs: list[float]) -> tuple[float, float, float]:
    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    half = T_975_DF2 * sd / math.sqrt(len(diffs))
    return mean, mean - half, mean + half


def test_resource_verdict_above_below_and_not_comparable():
    out = {v["level"]: v for v in resource_verdicts(synthetic_rows(), "heterofl", "macs")}
    assert list(out) == ["1", "0.25", "0.125"]
    # level 1: FedHM − the baseline at its own cost 1000: -0.10, -0.11, -0.09
    below = [0.70 - 0.80, 0.71 - 0.82, 0.72 - 0.81]
    # level 0.25 at MACs 200: the baseline's middle of its 100 and 400 levels, seed by seed
    above = [0.80 - (0.60 + 0.70) / 2, 0.82 - (0.62 + 0.70) / 2, 0.81 - (0.61 + 0.72) / 2]
    for level, diffs, expected in (("1", below, "below"), ("0.25", above, "above")):
        mean, low, high = hand_ci(diffs)
        assert (low > 0, high < 0) == (expected == "above", expected == "below")  # the case it was picked for
        v = out[level]
        assert [d for _, d in v["per_seed"]] == pytest.approx(diffs)
        assert (v["estimate"].mean, v["estimate"].low, v["estimate"].high) == pytest.approx((mean, low, high))
        assert v["verdict"] == expected and v["n"] == 3 and v["range"] == (100, 1000)
    assert out["0.125"]["verdict"] == "not comparable" and out["0.125"]["n"] == 0  # MACs 50 < 100
    one_seed = [r for r in synthetic_rows() if r["seed"] == 0]
    assert resource_verdicts(one_seed, "heterofl", "macs")[1]["verdict"] == "not resolved at 1 seed"
    assert resource_verdicts(synthetic_rows(), "heterofl", "params") == []  # no cost recorded: nothing judged
    rows = synthetic_rows()
    rows[0]["macs/level_1"] = 999  # one seed's run counts another cost: refused, not averaged
    with pytest.raises(ValueError, match="heterofl level 1: its runs record different macs"):
        level_costs(rows, "heterofl", "macs")
    with pytest.raises(ValueError, match="allowed: params, macs, memory"):
        level_costs(rows, "heterofl", "flops")


@pytest.mark.parametrize("run", ["capacity/dir0.1/fedhm/seed1", "capacity/dir0.5/heterofl/seed0"])
def test_costs_from_the_saved_config_equal_the_recorded_ones(run: str):
    path = TRACKED / run
    recorded = json.loads((path / "summary.json").read_text())["level_costs"]
    counted = config_costs(path)
    assert counted.keys() == recorded.keys()
    for level, costs in recorded.items():
        for name, value in costs.items():
            assert counted[level][name] == value, (run, level, name)
    # a row that lacks a cost gets it from the config, the recorded ones untouched
    row = {"dir": str(path), "method": "x", **{f"final_acc/level_{g}": 0.5 for g in recorded}}
    row.update({f"{r}/level_{g}": int(c[r]) for g, c in recorded.items() for r in ("params", "macs")})
    assert add_costs([row]) == len(recorded)  # one memory per level
    assert row["costs_from_config"] == [f"memory/level_{g}" for g in sorted(recorded, key=lambda g: -float(g))]
    assert all(row[f"memory/level_{g}"] == recorded[g]["memory"] for g in recorded)
    assert row["levels.match"] == "fedhm_params" and row["train.batch_size"] == 32


def test_the_cheap_runs_memory_was_counted_before_pool_came_before_relu():
    """The cheap study's runs predate commit cc2f2fc (the CNN pools before its ReLU): their ReLU outputs
    of conv1..conv3 were counted at full size. Parameters and MACs are recounted exactly; the full
    width-16 model's memory differs by 4 bytes × batch 32 × the ReLU outputs that shrank."""
    path = TRACKED / "dir0.5" / "fedavg" / "seed0"
    recorded = json.loads((path / "summary.json").read_text())["level_costs"]["1"]
    counted = config_costs(path)["1"]
    assert {k: counted[k] for k in ("params", "macs", "bytes")} == {k: recorded[k] for k in ("params", "macs", "bytes")}
    before = 16 * 28 * 28 + 32 * 14 * 14 + 64 * 7 * 7  # ReLU on each conv's output, then the pool
    after = 16 * 14 * 14 + 32 * 7 * 7 + 64 * 3 * 3  # the pool, then ReLU on a quarter
    assert recorded["memory"] - counted["memory"] == 4 * 32 * (before - after)
    rows = page_mod.study_rows(TRACKED, CHEAP)["dir0.5"]
    assert recount(rows) == {"params": 0, "macs": 0, "memory": len(rows), "refused": 0}


def test_the_section_renders_from_the_tracked_runs(tmp_path: Path):
    rows = page_mod.study_rows(TRACKED, CHEAP)["dir0.5"]
    lines = pareto_section(rows, ("cheap", "dir0.5"), tmp_path / "fig", tmp_path / "RESULTS.md")
    text = "\n".join(lines)
    for resource in ("params", "macs", "memory"):
        assert (tmp_path / "fig" / f"pareto_{resource}.png").stat().st_size > 10_000
        assert f"(fig/pareto_{resource}.png)" in text
    costs = {
        m: json.loads((TRACKED / "dir0.5" / m / "seed0" / "summary.json").read_text())["level_costs"]["0.125"]
        for m in ("fedhm", "heterofl")
    }
    # the smallest level's costs, FedHM ÷ HeteroFL, from the recorded figures (#42: 2.0–2.4× MACs and memory)
    macs, memory = (costs["fedhm"][r] / costs["heterofl"][r] for r in ("macs", "memory"))
    assert f"| 0.125 | MACs | {costs['fedhm']['macs'] / 1e6:#.3g} M MACs |" in text and f"| {macs:.2f}× |" in text
    assert f"| {memory:.2f}× |" in text and 2.0 < macs < 2.5 and 2.0 < memory < 2.4
    assert "HeteroFL (matched): **matched on parameters**" in text
    assert "batch size 32 and momentum 0.9" in text and "in MiB (2²⁰ bytes)" in text
    assert "Every cost here was recorded by its run." in text
    assert "parameters and MACs agree in every run; training memory differs in 18 of 18 runs" in text
    # no run of the cheap study was matched on MACs: interpolated, and said so in the verdict's own line
    assert (
        "| FedHM's level γ = 0.125 against HeteroFL at equal MACs | cheap | Dirichlet α = 0.5 | *interpolated*: "
        "HeteroFL matched on parameters, at FedHM's MACs |" in text
    )
    summary = "\n".join(resource_table({("cheap", "dir0.5"): rows}, _cost))
    assert (
        "| FedHM's level γ = 0.125 against HeteroFL at equal parameters | cheap | Dirichlet α = 0.5 | HeteroFL "
        "matched on parameters, the same level |" in summary
    )
    for resource in ("MACs", "training memory"):
        assert f"FedHM's level γ = 0.125 against HeteroFL at equal {resource} | cheap |" in summary
        assert f"*interpolated*: HeteroFL matched on parameters, at FedHM's {resource} |" in summary
    assert "γ = 0.5 against" not in summary  # the smallest level only


@pytest.mark.slow
def test_the_command_writes_the_page_with_the_new_sections(tmp_path: Path):
    from bench.results import main

    page, figures = tmp_path / "x.md", tmp_path / "xfig"
    assert main(["--no-run", "--no-readme", "--page", str(page), "--figures", str(figures)]) == 0
    text = page.read_text() + (tmp_path / "x_ARCHIVE.md").read_text()
    # every (study, setting) with a finished tracked run, on the page or its archive: the cheap and capacity
    # studies' 2 settings each, and whichever settings of the later studies have runs
    with_runs = [
        str(Path(study.folder) / setting)
        for study in STUDIES.values()
        for setting in study.settings
        if any(finished(p) for p in (studies.RUNS / study.folder / setting).glob("*/seed*"))
    ]
    assert {"dir0.5", "dir0.1", "capacity/dir0.5", "capacity/dir0.1"} <= set(with_runs)
    assert text.count("#### Matched on which resource") == len(with_runs)
    assert "FedHM beats HeteroFL (matched on parameters), smallest level" in text
    for folder in with_runs:
        for resource in ("params", "macs", "memory"):
            assert (figures / folder / f"pareto_{resource}.png").is_file()


def test_each_verdict_names_the_resource_the_baseline_was_matched_on():
    rows = [
        {"method": "heterofl", "levels.match": "fedhm_macs"},
        {"method": "fedrolex", "levels.match": "none"},
        {"method": "fedhm", "levels.match": "fedhm_memory"},
        {"method": "fedhm", "levels.match": "fedhm_params"},
    ]
    assert matched_label(rows, "heterofl") == "matched on MACs"
    assert matched_label(rows, "fedrolex") == "widths not matched"
    assert matched_label(rows, "fedhm") == "levels.match fedhm_memory / fedhm_params"  # mixed: both named
    assert matched_label([{"method": "heterofl"}], "heterofl") == "levels.match not recorded"
