"""The generated results page (bench/studies.py, bench/results_page.py) reports what the runs say.

Fake finished runs with hand-picked accuracies stand in for the real ones; the page's verdicts,
its FedHM − HeteroFL sentence, its tables, the README block and the missing-run plan are checked
against values computed here by hand (the t quantile is a literal from a t table, not the
project's own fedhm_flwr.math.stats)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from bench import estimates, results_page as page_mod, studies as results
from fedhm_flwr.math.stats import Estimate
from fedhm_flwr.reporting.verdicts import verdict

CHEAP = results.STUDIES["cheap"]
CAPACITY = results.STUDIES["capacity"]
T_975_DF2 = 4.302652729749464  # Student t, 0.975 quantile, 2 degrees of freedom (t table)

# (final global accuracy, final accuracy of the smallest level γ = 0.125) per seed 0, 1, 2
RUNS = {
    "fedhm": ([0.80, 0.82, 0.84], [0.796, 0.814, 0.836]),
    "heterofl": ([0.79, 0.80, 0.81], [0.70, 0.71, 0.73]),
    "fedrolex": ([0.83, 0.86, 0.87], [0.80, 0.80, 0.80]),
    "fedavg": ([0.85, 0.86, 0.88], None),
    "fedavg_smallest": ([0.78, 0.79, 0.80], None),
    "fedhm_distill": ([0.80, 0.83, 0.83], [0.79, 0.82, 0.82]),
}
SECONDS = {
    "fedhm": 300.0,
    "heterofl": 100.0,
    "fedrolex": 110.0,
    "fedavg": 200.0,
    "fedavg_smallest": 150.0,
    "fedhm_distill": 400.0,
}


def fake_run(
    root: Path,
    variant: str,
    seed: int,
    acc: float,
    small: float | None,
    study=CHEAP,
    seconds: float | None = None,
    transport: str | None = None,
) -> None:
    path = results.run_dir(study, "dir0.5", variant, seed, root)
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(f"seed: {seed}\nmethod:\n  name: {variant}\nlevels:\n  match: fedhm_params\n")
    levels = {"1": acc} if small is None else {"1": acc, "0.125": small}
    rounds = [
        {"round": r, "acc/global": acc - 0.015 * (3 - r), **{f"acc/level_{k}": v for k, v in levels.items()}}
        for r in (1, 2, 3)
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    summary = {
        "method": variant,
        "final_acc/global": acc,
        **{f"final_acc/level_{k}": v for k, v in levels.items()},
        "bytes_total": 2e6,
        "wall_seconds": seconds or SECONDS[variant],
        "rounds_completed": 3,
        "commit": "abc1234",
        "machine": "x86_64, 2 cores, no GPU",
        "finished_at": "2026-11-23 12:00 UTC",
        "level_costs": {
            k: {
                "params": 1000 if k == "1" else 200,
                "macs": 5000 if k == "1" else 900,
                "memory": 40000 if k == "1" else 9000,
            }
            for k in levels
        },
    }
    if transport:
        summary["transport"] = transport
    (path / "summary.json").write_text(json.dumps(summary))


@pytest.fixture()
def runs(tmp_path: Path) -> Path:
    root = tmp_path / "results"
    for variant, (accs, smalls) in RUNS.items():
        for seed, acc in enumerate(accs):
            fake_run(
                root,
                variant,
                seed,
                acc,
                None if smalls is None else smalls[seed],
                transport="ray" if seed == 2 else None,
            )
    partial = results.run_dir(CHEAP, "dir0.1", "fedrolex", 0, root).parent / ".seed0.partial"
    partial.mkdir(parents=True)  # an interrupted run: neither counted nor shown
    return root


def hand_ci(diffs_pt: list[float]) -> tuple[float, float, float]:
    """Mean and 95 % t interval of three paired differences, by hand."""
    mean, sd = statistics.fmean(diffs_pt), statistics.stdev(diffs_pt)
    half = T_975_DF2 * sd / math.sqrt(len(diffs_pt))
    return mean, mean - half, mean + half


def pt(a: list[float], b: list[float]) -> list[float]:
    return [(x - y) * 100 for x, y in zip(a, b)]


def by_hand(kind: str, low: float, high: float) -> str:
    """The page's rule on a 95 % interval in points, written out here."""
    if kind == "greater":
        return "supported" if low > 0 else "contradicted" if high < 0 else "not resolved at 3 seeds"
    return (
        "supported" if -1 < low and high < 1 else "contradicted" if low > 1 or high < -1 else "not resolved at 3 seeds"
    )


def verdict_line(page: str, claim: str) -> str:
    lines = [line for line in page.splitlines() if line.startswith(f"| {claim} | cheap | Dirichlet α = 0.5 |")]
    assert len(lines) == 1, claim
    return lines[0]


def test_each_verdict_matches_a_hand_computation(runs: Path, tmp_path: Path):
    page = page_mod.render(runs, [CHEAP], tmp_path / "fig", tmp_path / "RESULTS.md")
    g, s = {k: v[0] for k, v in RUNS.items()}, {k: v[1] for k, v in RUNS.items()}
    cases = [  # claim, per-seed differences (pt), kind, expected verdict (decided here from the hand CI)
        (
            "FedHM's global model beats FedAvg trained on the smallest FedHM model",
            pt(g["fedhm"], g["fedavg_smallest"]),
            "greater",
            "supported",
        ),  # [2, 3, 4]
        (
            "FedHM beats HeteroFL (matched on parameters), global model",
            pt(g["fedhm"], g["heterofl"]),
            "greater",
            "not resolved at 3 seeds",
        ),  # [1, 2, 3]
        (
            "FedHM beats HeteroFL (matched on parameters), smallest level",
            pt(s["fedhm"], s["heterofl"]),
            "greater",
            "supported",
        ),  # [9.6, 10.4, 10.6]
        (
            "FedHM beats FedRolex (matched on parameters), global model",
            pt(g["fedhm"], g["fedrolex"]),
            "greater",
            "contradicted",
        ),  # [-3, -4, -3]
        (
            "FedHM beats FedRolex (matched on parameters), smallest level",
            pt(s["fedhm"], s["fedrolex"]),
            "greater",
            "not resolved at 3 seeds",
        ),  # [-0.4, 1.4, 3.6]
        (
            "FedHM's smallest level is within 1 pt of FedHM's global model",
            pt(s["fedhm"], g["fedhm"]),
            "within",
            "supported",
        ),  # [-0.4, -0.6, -0.4]
        (
            "self-distillation improves FedHM's global model",
            pt(g["fedhm_distill"], g["fedhm"]),
            "greater",
            "not resolved at 3 seeds",
        ),  # [0, 1, -1]
    ]
    judged = []
    for claim, diffs, kind, expected in cases:
        mean, low, high = hand_ci(diffs)
        assert by_hand(kind, low, high) == expected, claim  # the fake numbers exercise the case they were picked for
        # each fake run's last three evaluations: its global accuracy 1.5 pt below the final one on average, its
        # level's the final one; so only the level-against-global claim moves, by +1.5 pt
        last = [d + 1.5 for d in diffs] if claim.startswith("FedHM's smallest level is within") else diffs
        lmean, llow, lhigh = hand_ci(last)
        # the smallest alpha at which the two-sided interval resolves it (df 2: F(t) = 1/2 + t / (2 sqrt(2 + t²)))
        se, margin = statistics.stdev(last) / math.sqrt(3), 1.0 if kind == "within" else 0.0
        q = max(min(margin - lmean, margin + lmean) / se, (abs(lmean) - margin) / se)
        cells = (f"{mean:+.2f} | [{low:+.2f}, {high:+.2f}]", f"{lmean:+.2f} | [{llow:+.2f}, {lhigh:+.2f}]")
        word = by_hand(kind, llow, lhigh)
        # flagged: another label at the final evaluation (and its sign, if that differs too), or a final gap
        # outside the last-3 interval and at least 1 pt from the last-3 mean
        why = [f"final evaluation: {expected}"] if expected != word else []
        why += ["other sign"] if why and (mean > 0) != (lmean > 0) else []
        why += (
            [f"the final gap lies {abs(mean - lmean):.1f} pt from the last-3 mean"]
            if (not llow <= mean <= lhigh and abs(mean - lmean) >= 1)
            else []
        )
        judged.append((claim, cells, word, 1 - q / math.sqrt(2 + q * q), f"**{', '.join(why)}**" if why else ""))
    # Holm over the table's 7 verdicts, by hand: the i-th smallest p times (7 - i), a running maximum
    order, running, adjusted = sorted(range(7), key=lambda i: judged[i][3]), 0.0, {}
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (7 - rank) * judged[i][3]))
        adjusted[i] = running
    assert sum(a < 0.05 for a in adjusted.values()) == 1  # one claim survives it; three resolved at 95 % do not
    assert sum(bool(j[4]) for j in judged) == 1  # one claim changes sign between the final and the last evaluations
    for i, (claim, (final, last), word, p, flag) in enumerate(judged):
        label = (
            word if adjusted[i] < 0.05 or word.startswith("not") else f"not resolved after Holm (uncorrected: {word})"
        )
        assert verdict_line(page, claim) == (
            f"| {claim} | cheap | Dirichlet α = 0.5 | 3 | {final} | {last} | {p:.3g} | {adjusted[i]:.3g} | {label} | "
            f"{flag} |"
        )
    assert "(−1, +1) pt" in page and "not resolved at n seeds" in page  # the rule is stated on the page


def test_verdict_rule_at_its_boundaries():
    def est(low: float, high: float, n: int = 5) -> Estimate:
        return Estimate(n, (low + high) / 2, 0.01, low, high)

    assert verdict(est(0.001, 0.02)) == "supported"
    assert verdict(est(-0.02, -0.001)) == "contradicted"
    assert verdict(est(-0.001, 0.02)) == "not resolved at 5 seeds"
    assert verdict(est(-0.009, 0.009), "within", 0.01) == "supported"
    assert verdict(est(-0.011, 0.009), "within", 0.01) == "not resolved at 5 seeds"
    assert verdict(est(0.012, 0.03), "within", 0.01) == "contradicted"
    assert verdict(est(-0.05, -0.011), "within", 0.01) == "contradicted"
    assert verdict(Estimate(1, 0.05, math.nan, math.nan, math.nan)) == "not resolved at 1 seed"
    assert verdict(None) == "not resolved at 0 seeds"
    with pytest.raises(ValueError, match="kind must be 'greater' or 'within'"):
        verdict(est(0, 1), "better")


def test_page_states_the_paired_difference_with_its_t_interval(runs: Path, tmp_path: Path):
    page = page_mod.render(runs, [CHEAP, CAPACITY], tmp_path / "fig", tmp_path / "RESULTS.md")
    # differences 1, 2, 3 pt: mean 2, sd 1, t(0.975, df 2) = 4.302653 -> half width 4.302653 / sqrt(3) = 2.4841
    assert (
        "FedHM − HeteroFL (matched on parameters), final global accuracy: +2.00 pt, 95 % CI [-0.48, +4.48] "
        "over 3 paired seeds" in page
    )
    assert "the interval contains 0" in page
    # the headline row of FedHM: mean 82.00, sd 2.00, CI 82 ± 4.302653 * 2 / sqrt(3) = [77.03, 86.97]
    assert "| FedHM | 3 | 82.00 ± 2.00 | [77.03, 86.97] |" in page
    assert "18 run(s) not recounted: today's config check refuses their saved config" in page  # fake configs
    assert "runs 18 of 96" in page  # cheap 2 × 6 × 3 + capacity 2 × 6 × 5; the partial run is not a finished one
    for plot in ("accuracy_by_round", "accuracy_vs_bytes", "pareto_params", "pareto_macs", "pareto_memory"):
        assert (tmp_path / "fig" / "dir0.5" / f"{plot}.png").stat().st_size > 1000
        assert f"fig/dir0.5/{plot}.png" in page
    # which runs used which transport, from each run's summary.json (seed 2 said "ray")
    assert "in-process grid (`fedhm_flwr/ops/apps/local_grid.py`): 12 run(s), seed(s) 0, 1" in page
    assert "Ray simulation engine (`fedhm_flwr/ops/job/launch.py`): 6 run(s), seed(s) 2" in page
    assert "| cheap | dir0.5 | fedhm | 2 | ray | 84.00 |" in page
    assert "## Study `capacity`" in page and "No finished run yet." in page


def test_missing_runs_are_the_unfinished_ones(runs: Path):
    todo = results.missing(runs, [CHEAP])
    assert len(todo) == 36 - 18
    keys = [(j.setting, j.variant, j.seed) for j in todo]
    assert ("dir0.5", "fedhm", 0) not in keys and ("dir0.1", "fedrolex", 0) in keys
    assert [j.seed for j in todo] == sorted(j.seed for j in todo)  # seed by seed
    capacity = results.missing(runs, [CAPACITY])
    assert len(capacity) == 60
    assert {j.seed for j in capacity if j.transport == "ray"} == set(CAPACITY.ray_seeds) != set()
    assert all(("model.width" in j.overrides) == ("model.width" in CAPACITY.common) for j in capacity)


def test_plan_counts_missing_runs_and_estimates_their_time(runs: Path):
    # one capacity run measured: fedavg at 3 x the cheap study's fedavg time (600 s against 200 s)
    fake_run(runs, "fedavg", 0, 0.9, None, study=CAPACITY, seconds=600.0)
    measured = estimates.measured_seconds(runs)
    assert measured[("cheap", "fedhm", "grid")] == [300.0, 300.0] and measured[("cheap", "fedhm", "ray")] == [300.0]
    assert estimates.estimate_seconds(measured, "capacity", "fedavg") == 600.0  # measured itself
    assert estimates.estimate_seconds(measured, "capacity", "heterofl") == pytest.approx(100.0 * 3)  # scaled
    assert estimates.estimate_seconds(measured, "cheap", "fedhm") == 300.0
    assert estimates.estimate_seconds({}, "capacity", "fedhm") is None
    todo = results.missing(runs, [CHEAP, CAPACITY])
    lines = estimates.plan(runs, todo, 2)
    # cheap dir0.1: every method × 3 seeds, each at its cheap time: (300+100+110+200+150+400) × 3 s = 1.05 h
    assert "  cheap dir0.1: 18 run(s) missing (0 on Ray), estimated 1.1 h of run time" in lines
    # capacity dir0.5: 29 missing (fedavg seed 0 done): 3 × the cheap times, fedavg 600 s
    capacity_s = 5 * 3 * (300 + 100 + 110 + 200 + 150 + 400) - 600
    assert (
        f"  capacity dir0.5: 29 run(s) missing (6 on Ray), estimated {capacity_s / 3600:.1f} h of run time"
        " (Ray runs from in-process times: no Ray run of this study measured yet)"
    ) in lines
    total = 3 * 1260 + capacity_s + 5 * 3 * 1260  # cheap dir0.1, capacity dir0.5, capacity dir0.1
    assert lines[-1].startswith(f"make results: {18 + 29 + 30} run(s) missing")
    assert f"estimated {total / 3600:.1f} h of run time, about {total / 2 / 3600:.1f} h on 2 worker" in lines[-1]


def test_readme_block_is_replaced_and_nothing_else(runs: Path, tmp_path: Path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{page_mod.README_START}\nold\n{page_mod.README_END}\noutro\n")
    page_mod.update_readme(readme, page_mod.readme_block(runs))
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("\noutro\n") and "old" not in text
    assert "+2.00 pt, 95 % CI [-0.48, +4.48]" in text
    readme.write_text("no block\n")
    with pytest.raises(SystemExit, match="results:start"):
        page_mod.update_readme(readme, "x")


def test_capacity_probe_reports_the_gap_and_the_criterion(tmp_path: Path):
    from bench import capacity_probe as probe

    root = tmp_path / "results"
    study = probe.candidate_study("w8", (0, 1, 2))
    full, small = [0.82, 0.80, 0.81], [0.78, 0.775, 0.77]  # full − smallest: 4, 2.5, 4 pt
    for seed in range(3):
        fake_run(root, "fedavg", seed, full[seed], None, study=study, seconds=80.0)
        fake_run(root, "fedavg_smallest", seed, small[seed], None, study=study, seconds=120.0)
    entry = probe.report(root, ["w8"], (0, 1, 2))["candidates"]["w8"]
    mean, low, high = hand_ci(pt(full, small))  # 3.5, [1.35, 5.65]
    assert entry["seeds"] == [0, 1, 2]
    assert entry["gap_mean"] * 100 == pytest.approx(mean) and entry["gap_low"] * 100 == pytest.approx(low)
    assert entry["gap_high"] * 100 == pytest.approx(high)
    assert entry["meets"] is True  # 3.5 pt ≥ 3 pt and the interval excludes 0
    assert entry["seconds_per_run"] == {"fedavg": 80.0, "fedavg_smallest": 120.0}
    table = probe.markdown(probe.report(root, ["w8"], (0, 1, 2)))
    assert f"| {mean:+.2f} | [{low:+.2f}, {high:+.2f}] | yes | 80, 120 |" in table
