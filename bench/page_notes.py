"""What a results page owes its reader besides the numbers, read from the runs and the configs:

* :func:`use_deployable` / :func:`statistics_line`: which batch-norm statistics the accuracies on
  the page were measured with. A run that recorded its deployable accuracy (``summary.json``'s
  ``final_deployable_acc/*``: the statistics its exported model carries) is shown with it, and its
  test-batch figure is kept as ``test_batch_acc/*``; a study any of whose runs lacks it is shown
  with the test-batch figures, and the page says so and that a re-run gives the deployable ones.
* :func:`code_lines`: the code versions of a study's runs (``code_commit``/``code_dirty``
  recorded when the run started; older runs: the ``commit`` recorded when they finished), flagged
  when they span several versions or uncommitted code. A later commit counts as the study's when a
  :mod:`bench.equivalence` record certifies it (a method added after the study's commit runs there).
* :func:`archive_reasons`: why a study does not meet the main results page's standard (a run
  without its deployable accuracy, runs not all on one clean commit); such a study goes to the
  archive page (:mod:`bench.results_archive`).
* :func:`recipe_lines`: the training options each method's clients get that differ from the
  common recipe (``train.*``), from the composed configs through the server's own task options.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Mapping
from typing import Any

from fedhm_flwr.reporting.provenance import version_label
from fedhm_flwr.reporting.summary import saved_config

DEPLOYABLE, TEST_BATCH = "final_deployable_acc/", "test_batch_acc/"
SHOWN = "shown_accuracy"  # a row's mark: "deployable" once use_deployable moved its figures
#: why a method's clients train with an option other than the common recipe's (docs/METHODS.md)
REASONS = {
    "grad_clip": "HeteroFL's recipe (`method.grad_clip`, its official code clips the gradient norm at 1.0; "
    "docs/METHODS.md#heterofl), kept by FedRolex and FedAvg of HeteroFL's family; the other methods "
    "use `train.grad_clip`",
    "frobenius_decay": "FedHM's: decay on each factorized pair's product instead of weight decay on its factors "
    "(`method.frobenius_decay`, docs/METHODS.md#client-training)",
    "distill": "the ablation itself: self-distillation towards the received model (`train.distill`)",
}
#: why a method's clients train through a client hook (``hook``, ``hook_options``), by the hook's name
HOOK_REASONS = {
    "fjord": "FjORD's ordered dropout: each batch trains a width drawn from the client's nested widths up to its "
    "p_max (the client hook `fedhm_flwr.math.fjord`, docs/METHODS.md#fjord)",
    "fiarse": "FIARSE's masked training: the forward uses w·1[|w| ≥ θ] with the level's threshold θ, taken again "
    "on the current weights at every forward (the client hook `fedhm_flwr.math.fiarse`, docs/METHODS.md#fiarse)",
}
#: ``hook_options`` is too long for a table cell: the table names what it holds, by the hook's name
HOOK_OPTIONS = {
    "fjord": "per level: the widths drawn per batch and each width's layer shapes",
    "fiarse": "per level: its threshold θ and the gradient rule of the masked weights",
}


def use_deployable(rows: list[dict[str, Any]]) -> bool:
    """When every run of ``rows`` recorded its deployable accuracy, put it in ``final_acc/*`` (what
    the tables, plots and verdicts read) and keep the test-batch figure as ``test_batch_acc/*``;
    returns whether it did (a study is shown with one kind of figure, never a mix)."""
    if not rows or not all(f"{DEPLOYABLE}global" in r for r in rows):
        return False
    for row in rows:
        row[SHOWN] = "deployable"
        for key in [k for k in row if k.startswith(DEPLOYABLE)]:
            suffix = key[len(DEPLOYABLE) :]
            row[f"{TEST_BATCH}{suffix}"] = row.get(f"final_acc/{suffix}")
            row[f"final_acc/{suffix}"] = row[key]
    return True


def statistics_line(rows: list[dict[str, Any]]) -> str:
    """The page's sentence on the batch-norm statistics behind the accuracies of ``rows`` (after
    :func:`use_deployable`)."""
    deployable = bool(rows) and all(r.get(SHOWN) == "deployable" for r in rows)
    if not rows:
        return "- batch-norm statistics: no finished run yet"
    if deployable:
        kinds = Counter(str(r.get("deployable_bn_stats")) for r in rows)
        return (
            "- batch-norm statistics: every accuracy below is **deployable**: each model scored on the test set "
            "with the fixed statistics its exported model carries (`fedhm export`; "
            + ", ".join(f"`{k}`: {n} run(s)" for k, n in sorted(kinds.items()))
            + ", `federated`: the clients' sBN sums over their training data). The test-batch figures "
            "(each test batch normalised with its own statistics, which a deployed model cannot do) stay in "
            "each run's `summary.json` (`final_acc/*`); the last-10 %-of-rounds column is test-batch (the "
            "deployable figure is measured once, after the last round)"
        )
    kinds = Counter(str(r.get("bn_stats") or "test_batch (not recorded)") for r in rows)
    have = sum(1 for r in rows if f"{DEPLOYABLE}global" in r)
    return (
        "- batch-norm statistics: **every accuracy below normalises batch norm with each test batch's own "
        "statistics** ("
        + ", ".join(f"`{k}`: {n} run(s)" for k, n in sorted(kinds.items()))
        + "), which a deployed model cannot do: its exported model carries fixed statistics (the clients' "
        f"sBN sums) and scores otherwise. {have} of these {len(rows)} runs recorded the deployable figure "
        "(`final_deployable_acc/*`); **deployable figures need a re-run of the study's runs**"
    )


def run_version(row: Mapping[str, Any]) -> str:
    """A run's code: the version it started with, else the one recorded when it finished."""
    if "code_commit" in row:
        return version_label(row["code_commit"], row.get("code_dirty"))
    return f"{row.get('commit') or 'unknown'} (recorded when the run finished)"


def certified_later(rows: list[dict[str, Any]], known: Mapping[tuple[str, str], Any] | None = None) -> dict[str, str]:
    """The later commits of ``rows`` certified to train what the study's commit trains (later -> the
    record's path): the study's commit is the one most of its clean runs ran on, and a later one is
    certified by a kept :mod:`bench.equivalence` record in which every method both commits have gives
    the same final model bit for bit."""
    from bench import equivalence

    clean = Counter(str(r["code_commit"]) for r in rows if r.get("code_dirty") is False)
    if len(clean) < 2:
        return {}
    base = clean.most_common(1)[0][0]
    known = equivalence.records() if known is None else known
    return {
        later: f"results/equivalence/{base}-{later}.json"
        for later in clean
        if later != base and (record := known.get((base, later))) is not None and equivalence.certified(record)
    }


def code_problems(rows: list[dict[str, Any]], known: Mapping[tuple[str, str], Any] | None = None) -> list[str]:
    """What keeps the runs of ``rows`` off one clean commit: several commits (a later commit certified
    equal to the study's, :func:`certified_later`, counts as the study's), uncommitted or unknown code
    (empty: one clean commit, or no run)."""
    versions = Counter(run_version(r) for r in rows)
    commits = {v.split()[0] for v in versions} - set(certified_later(rows, known))
    dirty = sum(n for v, n in versions.items() if "uncommitted" in v)
    unknown = sum(n for v, n in versions.items() if v.startswith("unknown"))
    why = [
        f"{len(commits)} commits" if len(commits) > 1 else "",
        f"{dirty} run(s) on uncommitted code" if dirty else "",
        f"{unknown} run(s) of unknown code" if unknown else "",
    ]
    return [w for w in why if w]


def code_lines(
    rows: list[dict[str, Any]], known: Mapping[tuple[str, str], Any] | None = None
) -> tuple[list[str], bool]:
    """(the page's lines on the code versions of ``rows``, whether the study is flagged: its runs
    span several commits not certified equal, or uncommitted or unknown code)."""
    versions = Counter(run_version(r) for r in rows)
    later = certified_later(rows, known)

    def shown(version: str, n: int) -> str:
        commit = version.split()[0]
        if commit not in later:
            return f"`{version}`: {n} run(s)"
        return (
            f"`{version}`: {n} run(s), certified to train what the study's commit trains (every method both "
            f"commits have gives the same final model bit for bit: `{later[commit]}`, `python -m bench.equivalence`)"
        )

    line = "- code versions: " + ("; ".join(shown(v, n) for v, n in sorted(versions.items())) or "–")
    if problems := code_problems(rows, known):
        line += (
            " — **flagged: the runs span " + ", ".join(problems) + "; their outputs may differ for "
            "that reason alone, so this study is to be re-run on one clean commit**"
        )
    return [line], bool(problems)


def archive_reasons(rows: list[dict[str, Any]]) -> list[str]:
    """Why a study whose finished runs' ``summary.json`` are ``rows`` does not meet the main results
    page's standard (every run recorded its deployable accuracy, all on one clean commit); empty when
    it does (a study without a finished run does too)."""
    lacking = sum(1 for r in rows if f"{DEPLOYABLE}global" not in r)
    reasons = (
        [
            f"{lacking} of its {len(rows)} runs recorded no deployable accuracy (`{DEPLOYABLE}*`), so its "
            "accuracies normalise batch norm with each test batch's own statistics, which a deployed model cannot do"
        ]
        if lacking
        else []
    )
    if problems := code_problems(rows):
        reasons.append("its runs span " + ", ".join(problems))
    return reasons


def bn_sample_line(rows: list[dict[str, Any]]) -> str:
    """Which clients and how many examples each summed the deployable statistics of ``rows`` (their saved
    configs' ``evaluation.bn_clients`` and ``evaluation.bn_examples``), beside today's defaults."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from fedhm_flwr.config import base_defaults

    def sample(cfg: Any) -> str:
        clients, examples = (
            OmegaConf.select(cfg, "evaluation.bn_clients"),
            OmegaConf.select(cfg, "evaluation.bn_examples"),
        )
        return (
            f"{'every connected client' if not clients else f'a seeded sample of {clients} clients'} × "
            f"{'all their training examples' if not examples else f'at most {examples} training examples each'}"
        )

    used = Counter(sample(saved_config(Path(r["dir"]))) for r in rows if r.get("dir"))
    return (
        "- deployable statistics' sample: "
        + "; ".join(f"{what}: {n} run(s)" for what, n in sorted(used.items()))
        + f" (`evaluation.bn_clients`, `evaluation.bn_examples` in each run's config; today's default: "
        f"{sample(base_defaults())})"
    )


def aggregation_lines(methods: Mapping[str, str]) -> list[str]:
    """How each method weighs its clients' replies when it aggregates, and whether it uses HeteroFL's
    Scaler, read from the method the server builds under each method's overrides (label -> overrides)."""
    rows = []
    for label, overrides in methods.items():
        weights, scaler = _aggregation(overrides)
        rows.append(f"| {label} | {weights} | {scaler} |")
    return [
        "How each method weighs its clients' replies and whether it rescales activations by the width "
        "(HeteroFL's Scaler), read from the method the server builds (`bench/page_notes.py`; "
        "docs/METHODS.md):",
        "",
        "| method | a reply's weight in the aggregate | Scaler |",
        "|---|---|---|",
        *rows,
    ]


@functools.lru_cache(maxsize=64)
def _strategy(overrides: str) -> tuple[Any, Any]:
    """(config, the strategy the server builds) under ``overrides``, composed once for the page's tables."""
    from fedhm_flwr.config import load_config, model_spec, run_options
    from fedhm_flwr.server.registry import STRATEGIES

    cfg = load_config(overrides)
    return cfg, STRATEGIES[cfg.method.name](run_options(cfg), model_spec(cfg))


@functools.lru_cache(maxsize=64)
def _aggregation(overrides: str) -> tuple[str, str]:
    import math

    method = _strategy(overrides)[1].method
    by_samples = bool(getattr(method, "weight_by_samples", False))
    tau, server_lr = getattr(method, "tau", None), getattr(method, "server_lr", None)
    if server_lr is not None:  # FIARSE: w - server_lr * (sum of the updates) / (clients whose update is non-zero)
        weights = (
            f"1 (a mean over the clients whose update of each element is non-zero, × the server's learning "
            f"rate {server_lr:g})"
        )
    elif tau is None:
        weights = "its sample count" if by_samples else "1 (a plain mean over the clients holding each element)"
    elif math.isinf(tau):
        weights = "its sample count" if by_samples else "1 (uniform)"
    else:
        weights = f"softmax(γ/τ) over the round's clients, τ = {tau:g}" + (", × its sample count" if by_samples else "")
    scaler = getattr(method, "scaler", None)
    return weights, "–" if scaler is None else "yes" if scaler else "no"


def client_options(overrides: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the common recipe: the ``train.*`` options the server sends every client, the learning rate
    aside; the options the clients of each level get, the method's own on top) under ``overrides``:
    the composed config through the server's own task options."""
    common, levels = _client_options(overrides)
    return dict(common), [dict(x) for x in levels]


@functools.lru_cache(maxsize=64)
def _client_options(overrides: str) -> tuple[dict[str, Any], tuple[dict[str, Any], ...]]:
    from fedhm_flwr.config import model_spec
    from fedhm_flwr.ops.apps.server_app import initial_state

    cfg, strategy = _strategy(overrides)
    state = strategy.method.initial_state(int(cfg.seed)) or initial_state(cfg.seed, model_spec(cfg))
    common = {k: v for k, v in strategy.wire.round_train_options(1).items() if k not in ("lr", "threads")}
    return common, tuple({**common, **strategy.method.level_cut(i, state).train} for i in range(len(strategy.levels)))


def recipe_lines(methods: Mapping[str, str]) -> list[str]:
    """A table of every training option some method's clients get other than the common recipe
    (the first method's ``train.*`` options as the server sends them), per method; ``methods``:
    label -> the overrides of its runs."""
    base = client_options(next(iter(methods.values())))[0] if methods else {}
    rows = []
    for label, overrides in methods.items():
        differ: dict[str, set[str]] = {}
        hook = ""
        for options in client_options(overrides)[1]:
            hook = str(options.get("hook", hook))
            for key, value in options.items():
                if key not in base or base[key] != value:
                    shown = HOOK_OPTIONS.get(hook, repr(value)) if key == "hook_options" else repr(value)
                    differ.setdefault(key, set()).add(shown)
        for key, values in sorted(differ.items()):
            common_value = repr(base[key]) if key in base else "(not in the common recipe)"
            reasons = {**REASONS, "hook": HOOK_REASONS.get(hook, "")}
            reason = next((r for k, r in reasons.items() if key.startswith(k)), "")
            rows.append(f"| {label} | `{key}` | {', '.join(sorted(values))} | {common_value} | {reason} |")
    shared = ", ".join(f"`{k}` = {v!r}" for k, v in sorted(base.items()))
    return [
        f"Every method's clients train with the common recipe ({shared}; the learning rate of each round from "
        "`train.lr` and `train.lr_schedule`) except where this table says; read from the composed configs "
        "through the options the server sends (`bench/page_notes.py`):",
        "",
        "| method | option | its value | common recipe | why |",
        "|---|---|---|---|---|",
        *(rows or ["| – | – | – | – | every method trains with the common recipe |"]),
    ]
