"""What a finished run learned, judged from what it recorded (``metrics.jsonl``, ``config.yaml``):
the last line a command prints and its exit code.

* **diverged** (exit 1): a recorded loss is not finite (``metrics.jsonl`` writes NaN/inf as null),
  or a round in which every reply was refused as non-finite or oversized (the reply checks refuse a
  NaN training loss, NaN/inf tensors and norms above ``aggregation.max_norm``): the global model
  stopped learning there;
* **nothing accepted** (exit 1): not one reply of the whole run was accepted (every one failed or
  was refused), so the global model is the initial one;
* **a round without training** (exit 1): a round in which no node trained (no reply accepted: every
  node sat out, failed, was late or was refused), so the global model skipped that round; said with
  the round's first client error;
* **collapsed** (exit 0, said in the last line): the final test loss is ``ln C`` (uniform outputs
  over ``C`` classes) or the final accuracy is at chance (``1/C``, what predicting one class
  everywhere gives on the built-in balanced test sets).

With ``failures.attack`` configured, refused replies are the attack's and the defence's doing: a
round whose replies were all refused is not judged (the losses and the collapse are). The ServerApp
judges its run here too: a run ending in a failure is ``failed`` in ``status.json``
(``fedhm status``). Nothing here needs torch.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from fedhm_flwr.config import base_defaults, data_spec
from fedhm_flwr.data.sources import dataset_info
from fedhm_flwr.reporting.results import CONFIG_FILE, METRICS_JSONL

#: a final test loss this close to ln C is "uniform outputs"
LOSS_TOLERANCE = 0.01
#: a final accuracy at most this much above 1/C is "at chance"
CHANCE_MARGIN = 0.01
#: words of a refusal reason that mean the client's training blew up (the reply checks' wording)
NON_FINITE = ("not finite", "NaN", "Inf", "above the bound")
#: recorded losses judged finite or not (the training replies', the server's and the clients' test figures)
LOSSES = ("train_loss", "loss/", "fed_loss/")
#: the client's own message inside a simulated node's wrapped error (Ray's actor error and traceback)
CLIENT_MESSAGE = re.compile(r"Exception \w+ occurred\. Message: (.+?)'?>?\s*$", re.S)
#: a traceback line naming an exception with a message: ``ValueError: ...``, ``flwr.x.Error: ...``
RAISED_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception)\b: \S.*$", re.M)


@dataclass(frozen=True)
class Health:
    """``code``: the exit code (0 or 1); ``problem``: one sentence, None for a healthy run; ``fatal``:
    whether the problem makes the run a failure (diverged, nothing accepted) or a warning (collapsed)."""

    code: int = 0
    problem: str | None = None
    fatal: bool = False

    @property
    def error(self) -> str:
        """The failure in one line, as ``error:`` lines and ``status.json`` say it."""
        return f"the run ended, but {self.problem}"


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in (run_dir / METRICS_JSONL).read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def _config(run_dir: Path) -> Any:
    try:
        return OmegaConf.merge(base_defaults(), OmegaConf.load(run_dir / CONFIG_FILE))
    except Exception:  # noqa: BLE001 - a run without a readable config is judged on its rows alone
        return None


def _num_classes(cfg: Any) -> int | None:
    try:
        return int(dataset_info(str(cfg.dataset.name), data_spec(cfg))["num_classes"])
    except Exception:  # noqa: BLE001 - classes unknown (data gone): no collapse verdict
        return None


def _lr_hint(cfg: Any) -> str:
    lr = None if cfg is None else OmegaConf.select(cfg, "train.lr")
    clip = None if cfg is None else OmegaConf.select(cfg, "train.grad_clip")
    lower = (
        f"lower train.lr (it is {lr:g}; e.g. train.lr={lr / 4:g})" if isinstance(lr, (int, float)) else "lower train.lr"
    )
    return lower + ("" if clip else " or clip gradients (e.g. train.grad_clip=1.0)")


def _non_finite_loss(rows: list[dict[str, Any]]) -> tuple[int, str] | None:
    for row in rows:
        for key, value in row.items():
            if key.startswith(LOSSES) and (value is None or (isinstance(value, float) and not math.isfinite(value))):
                return int(row.get("round", 0)), key
    return None


def _all_refused_non_finite(rows: list[dict[str, Any]]) -> tuple[int, int, str] | None:
    """(round, refusals, first reason) of the first round whose every reply was refused as non-finite."""
    for row in rows:
        if row.get("replies", 0) or not row.get("rejected", 0):
            continue
        try:
            reasons = [str(why) for _, why in json.loads(row.get("failure_reasons") or "[]")]
        except (ValueError, TypeError):
            continue
        refused = [why for why in reasons if any(word in why for word in NON_FINITE)]
        if refused and len(refused) == len(reasons):
            return int(row.get("round", 0)), len(refused), refused[0]
    return None


def _collapse(rows: list[dict[str, Any]], classes: int | None) -> str | None:
    if not classes or classes < 2:
        return None
    for acc_key, loss_key in (("acc/global", "loss/global"), ("fed_acc/all", "fed_loss/all")):
        evaluated = [r for r in rows if isinstance(r.get(acc_key), (int, float))]
        if not evaluated:
            continue
        last = evaluated[-1]
        acc, loss = float(last[acc_key]), last.get(loss_key)
        said = []
        if isinstance(loss, (int, float)) and abs(loss - math.log(classes)) <= LOSS_TOLERANCE:
            said.append(f"its test loss {loss:.4f} is ln {classes} (the same output for every input)")
        if acc <= 1.0 / classes + CHANCE_MARGIN:
            said.append(
                f"its accuracy {acc:.4f} is chance for {classes} classes (what predicting one class everywhere gives)"
            )
        return " and ".join(said) or None
    return None


def _one_line(reason: str) -> str:
    """A recorded client error in one line: the client's own message out of a simulated node's
    wrapped error (Ray's actor error with its traceback), else the last exception line, else the text."""
    text = str(reason)
    found = CLIENT_MESSAGE.search(text)
    if found is None:
        lines = RAISED_LINE.findall(text)
        found_text = lines[-1] if lines else text
    else:
        found_text = found.group(1)
    return " ".join(found_text.split())[:400]


def _reasons(row: Mapping[str, Any]) -> list[str]:
    """The round's recorded client errors: the failures and refusals, then the nodes that sat out."""
    out: list[str] = []
    with contextlib.suppress(ValueError, TypeError):
        out += [str(why) for _, why in json.loads(row.get("failure_reasons") or "[]")]
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        out += [str(why) for why in json.loads(row.get("excluded") or "{}").values()]
    return out


def _first_error(rows: list[dict[str, Any]]) -> str:
    """``; the first client error: ...`` of the first row that recorded one ("" when none did)."""
    for row in rows:
        reasons = _reasons(row)
        if reasons:
            return f"; the first client error: {_one_line(reasons[0])}"
    return ""


def _round_without_training(rows: list[dict[str, Any]], attacked: bool) -> str | None:
    """The problem of the first round in which no node trained (no reply accepted), None if none.
    Under an attack, a round whose replies came back and were all refused is the defence's doing."""
    for row in rows:
        if row.get("replies", 0):
            continue
        if attacked and row.get("rejected", 0):
            continue
        counts = {
            "sampled": int(row.get("sampled", 0)),
            "failed": int(row.get("failures", 0)),
            "refused": int(row.get("rejected", 0)),
            "late": int(row.get("late", 0)),
        }
        sat_out = len(json.loads(row["excluded"])) if row.get("excluded") else 0
        if not counts["sampled"] and not sat_out and not counts["failed"]:
            continue  # nothing was asked to train: a DP round's Poisson sample may be empty
        said = ", ".join(f"{n} {what}" for what, n in counts.items() if n or what == "sampled")
        said += f"; {sat_out} sat out after a failed node-info query" if sat_out else ""
        never = not any(r.get("replies", 0) for r in rows)
        return (
            f"no node trained in round {int(row.get('round', 0))} ({said}), so the global model "
            + ("is the initial one" if never else "was not updated there")
            + (_first_error([row]) or "; no client error was recorded")
        )
    return None


def judge(run_dir: str | Path) -> Health:
    """The :class:`Health` of the finished run in ``run_dir`` (see the module docstring)."""
    run_dir = Path(run_dir)
    rows, cfg = _rows(run_dir), _config(run_dir)
    if not rows:
        return Health()
    attacked = cfg is not None and str(OmegaConf.select(cfg, "failures.attack.kind", default="none")) != "none"
    bad_loss = _non_finite_loss(rows)
    if bad_loss is not None:
        round_, key = bad_loss
        return Health(1, f"the model diverged: {key} is not finite in round {round_}; {_lr_hint(cfg)}", True)
    refused = None if attacked else _all_refused_non_finite(rows)
    if refused is not None:
        round_, count, why = refused
        return Health(
            1,
            f"the model diverged: every reply of round {round_} ({count}) was refused as non-finite "
            f"or oversized ({why}), so the global model stopped learning there; {_lr_hint(cfg)}",
            True,
        )
    sent = sum(int(r.get("replies", 0)) + int(r.get("failures", 0)) + int(r.get("rejected", 0)) for r in rows)
    if not attacked and sent and not any(r.get("replies", 0) for r in rows):
        return Health(
            1,
            f"no reply of the whole run was accepted ({sent} failed or refused; metrics.jsonl's "
            f"failure_reasons say why{_first_error(rows)}), so the global model is the initial one",
            True,
        )
    idle = _round_without_training(rows, attacked)
    if idle is not None:
        return Health(1, idle, True)
    collapsed = _collapse(rows, None if cfg is None else _num_classes(cfg))
    if collapsed:
        return Health(0, f"the model collapsed: {collapsed}; {_lr_hint(cfg)}, or check the data and the model")
    return Health()


def final_line(summary: Mapping[str, Any]) -> tuple[int, str]:
    """(exit code, the last line) of a finished run: ``run complete: final global accuracy ...;
    outputs in DIR``, with the collapse said after it; a diverged run or one that accepted no reply
    ends ``error: ...`` (exit 1)."""
    acc = summary.get("final_acc/global")
    out = summary.get("output_dir")
    line = f"run complete: final global accuracy {acc if acc is None else f'{acc:.4f}'}; outputs in {out}"
    health = judge(out) if out else Health()
    if health.problem is None:
        return 0, line
    if health.fatal:
        return health.code, f"error: {health.error}; outputs in {out}"
    return health.code, f"{line}; but {health.problem}"
