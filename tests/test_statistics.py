"""Statistics over seeds: t quantiles against printed tables, CIs by hand, grouping, pairing."""

import csv
import json
import math

import pytest

from fedhm_flwr.math.stats import mean_ci, t_cdf, t_quantile
from fedhm_flwr.reporting.summary import (
    collect,
    find_runs,
    paired_differences,
    seed_statistics,
    tail_accuracies,
    write_summary,
)

# Two-sided 95 % and 99 % critical values of Student's t (any printed table, 3 decimals)
T_TABLE = {
    1: (12.706, 63.657),
    2: (4.303, 9.925),
    3: (3.182, 5.841),
    4: (2.776, 4.604),
    5: (2.571, 4.032),
    10: (2.228, 3.169),
    20: (2.086, 2.845),
    30: (2.042, 2.750),
    120: (1.980, 2.617),
}


@pytest.mark.parametrize("df", sorted(T_TABLE))
def test_t_quantile_matches_the_printed_table(df):
    q95, q99 = T_TABLE[df]
    assert t_quantile(0.975, df) == pytest.approx(q95, abs=6e-4)
    assert t_quantile(0.995, df) == pytest.approx(q99, abs=6e-4)
    assert t_quantile(0.025, df) == pytest.approx(-q95, abs=6e-4)


def test_t_cdf_closed_forms():
    # df = 1 is the Cauchy distribution, df = 2 has F(t) = 1/2 + t / (2 sqrt(2 + t^2))
    for t in (-3.0, -0.5, 0.0, 0.7, 4.0):
        assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)
        assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)
    # and the quantile inverts it: df = 2 has the closed form t = (2p - 1) sqrt(2 / (4p(1 - p)))
    p = 0.975
    assert t_quantile(p, 2) == pytest.approx((2 * p - 1) * math.sqrt(2 / (4 * p * (1 - p))), rel=1e-12)


def test_ci_of_one_two_three_by_hand():
    est = mean_ci([1, 2, 3])
    # mean 2, sample std 1, t_{0.975, 2} = 4.302652729749464 (df 2 closed form), half width t / sqrt(3)
    half = 4.302652729749464 / math.sqrt(3)
    assert (est.n, est.mean, est.std) == (3, 2.0, 1.0)
    assert est.low == pytest.approx(2 - half, abs=1e-12) and est.high == pytest.approx(2 + half, abs=1e-12)


def test_ci_of_one_value_is_undefined_and_empty_is_refused():
    est = mean_ci([0.8])
    assert est.mean == 0.8 and math.isnan(est.std) and math.isnan(est.low)
    with pytest.raises(ValueError):
        mean_ci([])


def test_tail_mean_takes_the_last_ten_percent_of_rounds():
    rows = [{"round": r, "acc/global": r / 100} for r in range(1, 31)]  # 30 rounds -> the last 3
    assert tail_accuracies(rows)["tail_acc/global"] == pytest.approx((28 + 29 + 30) / 300)
    sparse = [{"round": 1, "acc/global": 0.1}, {"round": 5, "acc/global": 0.5}, {"round": 6}]
    assert tail_accuracies(sparse)["tail_acc/global"] == pytest.approx(0.5)  # no evaluation in round 6


def _run(folder, method, seed, accs, alpha=0.5, levels=None, distill=None):
    """A finished run as the ServerApp writes it, with a Hydra overrides file like the sweep's."""
    folder.mkdir(parents=True)
    (folder / ".hydra").mkdir()
    extra = "" if distill is None else f"- train.distill.enabled={str(distill).lower()}\n"
    (folder / ".hydra" / "overrides.yaml").write_text(
        f"- method={method}\n- seed={seed}\n- partition.alpha={alpha}\n{extra}"
    )
    (folder / "config.yaml").write_text(
        f"seed: {seed}\nmethod:\n  name: {method}\npartition:\n  alpha: {alpha}\nrounds: {len(accs)}\n"
        f"train:\n  distill:\n    enabled: {str(bool(distill)).lower()}\n"
    )
    lines = []
    for r, a in enumerate(accs, start=1):
        row = {"round": r, "acc/global": a}
        for lvl, extra in (levels or {}).items():
            row[f"acc/level_{lvl}"] = a + extra
        lines.append(json.dumps(row))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    summary = {
        "method": method,
        "final_acc/global": accs[-1],
        "best_acc/global": max(accs),
        "bytes_total": 1000,
        "wall_seconds": 1.0,
        "rounds_completed": len(accs),
        "level_costs": {
            lvl: {"params": 100 * (i + 1), "macs": 1000, "fedhm_params": 99} for i, lvl in enumerate(levels or {})
        },
    }
    for lvl, extra in (levels or {}).items():
        summary[f"final_acc/level_{lvl}"] = accs[-1] + extra
    (folder / "summary.json").write_text(json.dumps(summary))


FINAL = {"fedhm": [0.845, 0.863, 0.849], "heterofl": [0.850, 0.861, 0.848]}


def _sweep(tmp_path, alphas=(0.5,)):
    job = 0
    for alpha in alphas:
        for method, finals in FINAL.items():
            for seed, final in enumerate(finals):
                _run(tmp_path / f"job{job}", method, seed, [0.5] * 9 + [final], alpha, levels={"1": 0.0, "0.5": -0.1})
                job += 1
    return find_runs([tmp_path])


def test_statistics_group_by_configuration_without_the_seed(tmp_path):
    swept, rows = collect(_sweep(tmp_path, alphas=(0.5, 0.1)))
    stats = seed_statistics(swept, rows)
    glob = [s for s in stats if s["model"] == "global"]
    assert len(glob) == 4 and all(s["n"] == 3 and s["seeds"] == "0,1,2" for s in glob)
    fedhm = next(s for s in glob if s["method"] == "fedhm" and s["partition.alpha"] == 0.1)
    est = mean_ci(FINAL["fedhm"])
    assert fedhm["final_mean"] == pytest.approx(est.mean) and fedhm["final_ci_low"] == pytest.approx(est.low)
    # 10 rounds: the last 10 % is the last round alone
    assert fedhm["tail_mean"] == pytest.approx(est.mean)
    level = next(
        s for s in stats if s["method"] == "fedhm" and s["model"] == "level_0.5" and s["partition.alpha"] == 0.1
    )
    assert level["final_mean"] == pytest.approx(est.mean - 0.1) and level["params"] == 200
    assert level["fedhm_params"] == 99


def test_paired_differences_pair_by_seed_within_a_setting(tmp_path):
    swept, rows = collect(_sweep(tmp_path, alphas=(0.5, 0.1)))
    paired = paired_differences(swept, rows, reference="fedhm")
    glob = [p for p in paired if p["model"] == "global" and p["metric"] == "final"]
    assert len(glob) == 2 and {p["partition.alpha"] for p in glob} == {0.5, 0.1}
    diffs = [h - f for h, f in zip(FINAL["heterofl"], FINAL["fedhm"])]  # +0.005, -0.002, -0.001
    est = mean_ci(diffs)
    for p in glob:
        assert p["method"] == "heterofl" and p["n"] == 3
        assert p["mean"] == pytest.approx(est.mean) and p["ci_high"] == pytest.approx(est.high)
        assert p["per_seed"] == "0:+0.0050 1:-0.0020 2:-0.0010"
    # the reference itself is never paired with itself, and an unknown reference gives no pairs
    assert all(p["method"] != "fedhm" for p in paired)
    assert paired_differences(swept, rows, reference="prism") == []


def test_a_seed_only_one_side_ran_is_left_out(tmp_path):
    _sweep(tmp_path)
    _run(tmp_path / "job99", "heterofl", 7, [0.9], levels={"1": 0.0})
    swept, rows = collect(find_runs([tmp_path]))
    glob = next(p for p in paired_differences(swept, rows) if p["model"] == "global" and p["metric"] == "final")
    assert glob["n"] == 3 and "7:" not in glob["per_seed"]


def test_write_summary_writes_tables_and_plots(tmp_path):
    _sweep(tmp_path / "runs")
    write_summary([tmp_path / "runs"], tmp_path / "out", reference="fedhm")
    out = tmp_path / "out"
    for name in (
        "summary.md",
        "summary.csv",
        "statistics.md",
        "statistics.csv",
        "paired.csv",
        "accuracy_by_round.png",
        "accuracy_vs_bytes.png",
        "accuracy_vs_params.png",
        "accuracy_vs_macs.png",
    ):
        assert (out / name).stat().st_size > 0, name
    with (out / "statistics.csv").open() as fh:
        stats = list(csv.DictReader(fh))
    assert {(s["method"], s["model"]) for s in stats} == {
        (m, x) for m in FINAL for x in ("global", "level_1", "level_0.5")
    }
    text = (out / "statistics.md").read_text()
    assert "Paired differences against fedhm" in text and "0:+0.0050 1:-0.0020 2:-0.0010" in text


def test_an_ablation_sweep_is_paired_with_the_plain_method(tmp_path):
    """`make compare` runs ablations as separate sweeps (one option on): the option names the
    method, and the ablation is paired with plain FedHM on the same seeds."""
    _sweep(tmp_path / "methods")
    for seed, acc in enumerate([0.85, 0.87, 0.86]):
        _run(tmp_path / "distill" / f"job{seed}", "fedhm", seed, [acc], distill=True)
    swept, rows = collect(find_runs([tmp_path]))
    assert {r["method"] for r in rows} == {"fedhm", "heterofl", "fedhm train.distill.enabled=True"}
    paired = {
        p["method"]: p for p in paired_differences(swept, rows) if p["model"] == "global" and p["metric"] == "final"
    }
    assert set(paired) == {"heterofl", "fedhm train.distill.enabled=True"}
    diffs = [a - b for a, b in zip([0.85, 0.87, 0.86], FINAL["fedhm"])]
    assert paired["fedhm train.distill.enabled=True"]["mean"] == pytest.approx(sum(diffs) / 3)


def test_resolution_p_is_the_alpha_at_which_the_interval_resolves_the_claim():
    from fedhm_flwr.math.stats import resolution_p

    # differences 1, 2, 3: t = 2 / (1 / sqrt 3); df 2: F(t) = 1/2 + t / (2 sqrt(2 + t²)), two-sided p by hand
    t = 2 * math.sqrt(3)
    est = mean_ci([1.0, 2.0, 3.0])
    assert resolution_p(est) == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-12)
    # at that alpha the 1 − alpha interval just touches 0 (resolved below it, not above it)
    p = resolution_p(est)
    assert mean_ci([1.0, 2.0, 3.0], 1 - p * 1.001).low > 0 > mean_ci([1.0, 2.0, 3.0], 1 - p * 0.999).low
    # within a margin: the interval inside (−m, m) at 1 − p, and wholly outside it for a far mean
    near, far = mean_ci([0.1, 0.2, 0.3]), mean_ci([5.0, 6.0, 7.0])
    q = resolution_p(near, margin=1.0)
    assert -1 < mean_ci([0.1, 0.2, 0.3], 1 - q * 1.001).low and mean_ci([0.1, 0.2, 0.3], 1 - q * 1.001).high < 1
    assert mean_ci([0.1, 0.2, 0.3], 1 - q * 0.999).high > 1
    assert mean_ci([5.0, 6.0, 7.0], 1 - resolution_p(far, 1.0) * 1.001).low > 1
    assert math.isnan(resolution_p(mean_ci([1.0])))


def test_holm_steps_down_and_stops_at_the_first_kept_hypothesis():
    from fedhm_flwr.math.stats import holm

    # sorted 0.005, 0.01, 0.03, 0.04 of m = 4: 0.02, 0.03, 0.06, 0.06 (a running maximum of (m − i) · p)
    out = holm([0.04, 0.005, 0.03, math.nan, 0.01])
    assert [round(a, 12) if not math.isnan(a) else a for a, _ in out[:3]] == [0.06, 0.02, 0.06]
    assert [r for _, r in out] == [False, True, False, False, True]
    assert math.isnan(out[3][0])  # no test: left out of the family, never rejected
    assert holm([0.01] * 5) == [(0.05, False)] * 5  # 5 × 0.01 is not below 0.05
    assert holm([]) == []


def test_last_evaluations_average_the_last_k_evaluated_rounds():
    from fedhm_flwr.reporting.summary_stats import last_evaluations

    metrics = [{"round": r, "loss": 1.0} for r in range(1, 11)]
    for r in (5, 10):  # evaluated rounds only; the level is evaluated at round 10 alone
        metrics[r - 1]["acc/global"] = r / 10
    metrics[9]["acc/level_0.5"] = 0.7
    metrics.append({"round": 11, "acc/global": 0.2})
    out = last_evaluations(metrics, 2)
    assert out == {"lastk_acc/global": pytest.approx(0.6), "lastk_rounds": [10, 11], "lastk_acc/level_0.5": 0.7}
    assert last_evaluations(metrics, 3)["lastk_rounds"] == [5, 10, 11]
    with pytest.raises(ValueError, match="k must be >= 1"):
        last_evaluations(metrics, 0)


def test_the_t_quantile_is_computed_once_per_argument_and_is_the_same_value():
    t_quantile.cache_clear()
    first = t_quantile(0.975, 7)
    assert t_quantile(0.975, 7) == first and t_quantile.cache_info().hits == 1
    assert t_quantile(0.975, 7) == t_quantile.__wrapped__(0.975, 7)  # the cache changes no value


def test_a_runs_saved_config_is_parsed_once_per_version_of_the_file_and_cannot_be_changed(tmp_path):
    from omegaconf.errors import ReadonlyConfigError

    from fedhm_flwr.reporting.summary import saved_config

    (tmp_path / "config.yaml").write_text("seed: 1\nmethod:\n  name: fedhm\n")
    first = saved_config(tmp_path)
    assert saved_config(tmp_path) is first and first.method.name == "fedhm"
    with pytest.raises(ReadonlyConfigError):
        first.seed = 2
    (tmp_path / "config.yaml").write_text("seed: 22\nmethod:\n  name: heterofl\n")  # rewritten: read again
    assert saved_config(tmp_path).seed == 22 and saved_config(tmp_path).method.name == "heterofl"
