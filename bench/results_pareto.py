"""The results page's part on the resource a comparison is matched on (#42): per study and setting,
each method's per-level accuracy against parameters, MACs and training memory (plots with their
units), FedHM's costs beside the matched baselines', and a verdict per resource
(:func:`fedhm_flwr.reporting.pareto.resource_verdicts`: FedHM's level against the baseline at equal cost).

Costs are what the runs recorded (``summary.json``'s ``level_costs``, ``<cost>/level_<g>`` in a row);
where a run lacks one, it is counted from the run's saved ``config.yaml`` the way the run counts it
(:func:`config_costs`: the method's own :meth:`~fedhm_flwr.server.methods.method.Method.level_cost`,
i.e. :func:`fedhm_flwr.models.costs.model_costs` on the level's model).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.page_notes import SHOWN
from bench.results_verdicts import RULE_K, resource_table
from bench.studies import LABELS, TITLES, VARIANTS
from fedhm_flwr.core.errors import ConfigError
from fedhm_flwr.math.stats import mean_ci
from fedhm_flwr.reporting.pareto import RESOURCES, level_costs, levels_of
from fedhm_flwr.reporting.summary import saved_config
from fedhm_flwr.reporting.verdicts import matched_label

BASELINES = ("heterofl", "heterofl_memory", "fedrolex", "fedrolex_memory", "fjord")
#: resource -> (the plots' axis, the value shown from the recorded cost, the unit in tables)
AXES: dict[str, tuple[str, Callable[[float], float], str]] = {
    "params": (
        "parameters sent to a device per round: float32 bytes (4 × parameters), kB (log)",
        lambda p: 4 * p / 1e3,
        "kB",
    ),
    "macs": ("MACs of one forward pass of one example, millions (log)", lambda m: m / 1e6, "M MACs"),
    "memory": ("estimated peak training memory, MiB = 2²⁰ bytes (log)", lambda b: b / 2**20, "MiB"),
}
INTERPOLATION = (
    "at each FedHM level, the baseline's accuracy at FedHM's cost on that resource is interpolated linearly in "
    "log-cost between the baseline's two neighbouring levels (an assumption: accuracy between measured widths "
    "was not measured), seed by seed from that seed's own runs; outside the baseline's measured range of costs "
    "the level is *not comparable*. Per seed d = FedHM's accuracy − the baseline's interpolated accuracy; "
    "the verdict is the page's paired rule on the 95 % Student-t interval of the mean d: *above* when it lies "
    "above 0, *below* when it lies below 0, otherwise *not resolved at n seeds* "
    "(`fedhm_flwr/reporting/pareto.py`)."
)


def config_costs(run_dir: Path) -> dict[str, dict[str, float]]:
    """Level (``"0.125"``) -> its costs, counted from the run's saved ``config.yaml`` as the run counts them
    (today's code; counted once per config, the seed aside: costs do not depend on it)."""
    saved = (Path(run_dir) / "config.yaml").read_text()
    key = re.sub(r"(?m)^seed: .*$", "", saved)
    if key not in _COUNTED:
        from fedhm_flwr.config import model_spec, run_options
        from fedhm_flwr.server.registry import METHODS

        cfg = _cost_config(Path(run_dir))
        method = METHODS[cfg.method.name](run_options(cfg), model_spec(cfg))
        _COUNTED[key] = {f"{level:g}": method.level_cost(i) for i, level in enumerate(method.levels)}
    return {k: dict(v) for k, v in _COUNTED[key].items()}


_COUNTED: dict[str, dict[str, dict[str, float]]] = {}
#: the sections a level's costs depend on
_COST_SECTIONS = ("model", "dataset", "levels", "method", "train")


def _cost_config(run_dir: Path) -> Any:
    """The run's saved config reduced to what its costs depend on, over today's defaults: a key removed
    since the run was saved (today's config check refuses it) changes no cost and is left out."""
    from omegaconf import OmegaConf

    from fedhm_flwr.config import base_defaults, method_defaults, validate

    saved = saved_config(run_dir)
    today = OmegaConf.merge(base_defaults(), {"method": method_defaults(str(saved.method.name))})
    kept: dict[str, Any] = {}
    for section in _COST_SECTIONS:
        if section in saved:
            values = OmegaConf.to_container(saved[section])
            assert isinstance(values, dict)
            known = values if section in ("model", "dataset") else today[section]  # a group's keys: its own
            kept[section] = {k: v for k, v in values.items() if k in known}
    cfg = OmegaConf.merge(today, kept)
    validate(cfg)
    return cfg


def recount(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Resource -> how many of ``rows``' runs recorded a cost on it that today's count from their config
    (:func:`config_costs`) does not reproduce (a run counted by older code); ``refused``: runs whose
    saved config today's config check refuses (not recounted)."""
    out = dict.fromkeys([*RESOURCES, "refused"], 0)
    for row in rows:
        try:
            counted = config_costs(Path(row["dir"]))
        except ConfigError:
            out["refused"] += 1
            continue
        for resource in RESOURCES:
            out[resource] += any(
                row.get(f"{resource}/level_{g}") != int(counted[g][resource]) for g in levels_of([row], row["method"])
            )
    return out


def add_costs(rows: list[dict[str, Any]]) -> int:
    """Give every row its ``levels.match``, ``train.batch_size`` and ``train.momentum`` (from its
    ``config.yaml``) and every level's ``params``, ``macs`` and ``memory`` that the run did not record
    (from :func:`config_costs`; listed in ``costs_from_config``); returns how many costs were counted."""
    from omegaconf import OmegaConf

    counted = 0
    for row in rows:
        cfg = saved_config(Path(row["dir"]))
        for key in ("levels.match", "train.batch_size", "train.momentum"):
            row.setdefault(key, OmegaConf.select(cfg, key))
        lacking = [
            f"{r}/level_{g}"
            for g in levels_of([row], row["method"])
            for r in RESOURCES
            if row.get(f"{r}/level_{g}") is None
        ]
        if lacking:
            costs = config_costs(Path(row["dir"]))
            for key in lacking:
                resource, level = key.split("/level_")
                row[key] = int(costs[level][resource])
            row["costs_from_config"] = lacking
            counted += len(lacking)
    return counted


def _cost(resource: str, value: float) -> str:
    """A cost in the plots' unit, to 3 significant digits (parameters: the count, then the kB)."""
    shown = AXES[resource][1](value)
    return f"{value:,.0f} ({shown:#.3g} kB)" if resource == "params" else f"{shown:#.3g} {AXES[resource][2]}"


def accuracy_label(rows: list[dict[str, Any]]) -> str:
    if rows and all(r.get(SHOWN) == "deployable" for r in rows):
        return "deployable accuracy: with the batch-norm statistics the exported model carries"
    return "test-batch accuracy: each test batch normalised with its own batch-norm statistics"


def write_pareto_plots(rows: list[dict[str, Any]], title: str, out: Path) -> list[str]:
    """``pareto_<resource>.png`` under ``out``: per method, each level's final accuracy (mean over seeds,
    ± one sample standard deviation as error bars) against its cost; returns the file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedhm_flwr.reporting.summary_plots import save_figure

    names = []
    for resource, (axis, scale, _) in AXES.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, variant in enumerate(v for v in VARIANTS if any(r["method"] == v for r in rows)):
            costs = level_costs(rows, variant, resource)
            points = []
            for level, cost in costs.items():
                est = mean_ci(
                    [
                        float(r[f"final_acc/level_{level}"])
                        for r in rows
                        if r["method"] == variant and r.get(f"final_acc/level_{level}") is not None
                    ]
                )
                points.append((scale(cost), est.mean * 100, 0.0 if est.n < 2 else est.std * 100))
            points.sort()
            if points:
                ax.errorbar(*zip(*points), fmt="os^vDP"[i % 6] + "-", ms=5, capsize=3, label=LABELS[variant])
        ax.set_xscale("log")
        for axis_ticks in (ax.xaxis.set_major_formatter, ax.xaxis.set_minor_formatter):
            axis_ticks(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel(axis)
        ax.set_ylabel(f"final {accuracy_label(rows).split(':')[0]} (%)\nper level, mean ± sd over seeds")
        ax.set_title(f"{title}: accuracy against {RESOURCES[resource]}", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        save_figure(fig, out / f"pareto_{resource}.png")
        names.append(f"pareto_{resource}.png")
    return names


def cost_table(rows: list[dict[str, Any]]) -> list[str]:
    """Per FedHM level and resource: FedHM's cost, each matched baseline's at the same level, the ratio."""
    present = [b for b in BASELINES if any(r["method"] == b for r in rows)]
    lines = [
        "| level γ | resource | FedHM | "
        + " | ".join(f"{LABELS[b]} | FedHM ÷ {LABELS[b].split()[0]}" for b in present)
        + " |",
        "|---|---|---|" + "---|---|" * len(present),
    ]
    for level in levels_of(rows, "fedhm"):
        for resource in RESOURCES:
            own = level_costs(rows, "fedhm", resource).get(level)
            if own is None:
                continue
            cells = []
            for b in present:
                theirs = level_costs(rows, b, resource).get(level)
                cells += ["", ""] if theirs is None else [_cost(resource, theirs), f"{own / theirs:.2f}×"]
            lines.append(f"| {level} | {RESOURCES[resource]} | {_cost(resource, own)} | " + " | ".join(cells) + " |")
    return lines


def resources_text(rows: list[dict[str, Any]]) -> str:
    """What each resource means and in which unit, with the runs' batch size and momentum."""
    batch = sorted({str(r.get("train.batch_size")) for r in rows})
    momentum = sorted({str(r.get("train.momentum")) for r in rows})
    return (
        "The resources (`fedhm_flwr/models/costs.py`; each level's figure as its runs recorded it): "
        "**parameters**: the trainable parameters of the level's model, on the plots as the bytes sent to a device "
        "per round at float32 (4 bytes × parameters, kB = 1,000 bytes; the message's framing not counted); "
        "**MACs**: multiply-accumulates of one forward pass of one example (convolutions: outputs × inputs per "
        "group × kernel height × width; linear layers: inputs × outputs; normalisation, pooling and activations "
        "not counted), in millions; **training memory**: the estimated peak memory of local training, in MiB "
        "(2²⁰ bytes): "
        "4 bytes × ((2 + optimizer slots) × parameters + batch size × activations per example), i.e. weights, "
        "gradients and one momentum buffer (SGD with momentum), plus every leaf module's outputs kept for the "
        f"backward pass, at batch size {', '.join(batch)} and momentum {', '.join(momentum)} (the runs' "
        "`train.batch_size`, `train.momentum`); not counted: the framework itself, the data set, the input batch "
        "and temporary workspaces."
    )


def _and(words: list[str]) -> str:
    return ", ".join(words[:-1]) + " and " + words[-1] if len(words) > 1 else "".join(words)


def recount_line(rows: list[dict[str, Any]]) -> str:
    """Whether today's count from each run's config reproduces what the runs recorded."""
    differ = recount(rows)
    refused = differ.pop("refused")
    agree = [RESOURCES[r] for r, n in differ.items() if n == 0]
    parts = [f"{RESOURCES[r]} differs in {n} of {len(rows)} runs" for r, n in differ.items() if n]
    return (
        "Recounted from each run's saved config with today's code (`bench/results_pareto.py`): "
        + (f"{_and(agree)} agree in every {'recounted ' if refused else ''}run" if agree else "")
        + ("; " if agree and parts else "")
        + "; ".join(parts)
        + (
            " (counted by older code, see the runs' code versions; the table, plots and verdicts use what the "
            "runs recorded)"
            if parts
            else ""
        )
        + (f"; {refused} run(s) not recounted: today's config check refuses their saved config" if refused else "")
        + "."
    )


def pareto_section(rows: list[dict[str, Any]], key: tuple[str, str], out: Path, page: Path) -> list[str]:
    """The section of study and setting ``key``: what the baselines were matched on, the costs, the plots,
    the verdicts."""
    title = TITLES[key[1]]
    if not any(r["method"] == "fedhm" for r in rows):
        return []
    names = write_pareto_plots(rows, title, out)
    rel = os.path.relpath(out, page.parent)
    computed = sum(len(r.get("costs_from_config", [])) for r in rows)
    matched = "; ".join(
        f"{LABELS[b]}: **{matched_label(rows, b)}** (`levels.match` in its runs' configs)"
        for b in BASELINES
        if any(r["method"] == b for r in rows)
    )
    return [
        "#### Matched on which resource: accuracy per level against parameters, MACs and training memory",
        "",
        f'Widths of the baselines — {matched}. On the other resources the "matched" models differ from '
        f"FedHM's: the table gives FedHM's cost at each level beside theirs. {resources_text(rows)} "
        + (
            f"{computed} of these costs were not recorded by their runs and are counted from the runs' saved "
            "configs (`bench/results_pareto.py`)."
            if computed
            else "Every cost here was recorded by its run."
        )
        + " "
        + recount_line(rows),
        "",
        *cost_table(rows),
        "",
        f"Accuracy per level against each resource ({accuracy_label(rows)}; one point per method and level, the "
        "mean over seeds with ± one sample standard deviation as error bars; a curve further up and to the left "
        "is better):",
        "",
        " ".join(f"![accuracy per level against {RESOURCES[n[7:-4]]}]({rel}/{n})" for n in names),
        "",
        f"Per resource, FedHM's level against each baseline family at equal cost: against the family's runs "
        f"matched on that resource, level by level; where none was, *interpolated*: {INTERPOLATION} {RULE_K}",
        "",
        *resource_table({key: rows}, _cost, smallest_only=False),
        "",
    ]
