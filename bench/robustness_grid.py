"""The untrusted-clients grid of :mod:`bench.robustness`: its cells (method, condition, defence), each
cell's Hydra overrides, and where a finished run is kept (``results/robustness/<method>/<condition>/
<defence>/seed<k>/summary.json``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "results" / "robustness"

#: the reduced setting every run shares (Hydra overrides of conf/config.yaml)
COMMON = (
    "rounds=20 dataset.max_test_examples=2000 evaluation.levels=false evaluation.every=1000 tracking.tensorboard=false"
)
#: the attack grid's federation: 20 clients, 10 sampled per round
ATTACK_SETTING = "num_clients=20 fraction_train=0.5 dataset.max_train_examples=6000"
#: the DP runs' federation: 500 clients, each in a round with probability q = 0.2 (m = 100 expected),
#: since DP-FedAvg's noise std sigma C / m on each of the CNN's ~99k parameters swamps any model at m = 10
DP_SETTING = "num_clients=500 fraction_train=0.2 dataset.max_train_examples=10000"
DP_EXPECTED = 100
METHODS = {"fedhm": "method=fedhm", "heterofl": "method=heterofl"}
LABELS = {"fedhm": "FedHM", "heterofl": "HeteroFL"}
#: the two attacks of the issue's held-out check (label_flip and gaussian also exist: failures.attack.kind)
ATTACKS = ("scale", "sign_flip")
FRACTIONS = (0.1, 0.3)
DEFENCES = {
    "fedhm": ("none", "clip", "median", "trimmed_mean", "krum"),
    "heterofl": ("none", "clip", "median", "trimmed_mean"),
}
SIGMAS = (0.5, 1.0, 2.0)
#: DP runs: clip bound C (about the median update norm of the clean runs' first rounds)
DP_CLIP = 1.0
SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class Cell:
    """One cell of the grid: a method, a condition (``clean``, ``<attack>-<percent>``,
    ``dp-sigma<σ>``) and a defence (``none`` for DP)."""

    method: str
    condition: str
    defence: str

    @property
    def attack(self) -> str:
        return self.condition.rsplit("-", 1)[0] if self.condition not in ("clean",) and not self.dp else "none"

    @property
    def fraction(self) -> float:
        return int(self.condition.rsplit("-", 1)[1]) / 100 if self.attack != "none" else 0.0

    @property
    def dp(self) -> bool:
        """A run of the DP setting (``dp-off`` is its reference without DP)."""
        return self.condition.startswith("dp-")

    @property
    def sigma(self) -> float:
        return float(self.condition[len("dp-sigma") :])

    def overrides(self, seed: int) -> str:
        out = f"{COMMON} {METHODS[self.method]} seed={seed}"
        if self.dp:
            out = f"{out} {DP_SETTING}"
            return (
                out
                if self.condition == "dp-off"
                else (f"{out} dp.enabled=true dp.clip={DP_CLIP:g} dp.noise_multiplier={self.sigma:g}")
            )
        out += f" {ATTACK_SETTING} aggregation.robust={self.defence}"
        if self.attack != "none":
            out += f" failures.attack.kind={self.attack} failures.attack.fraction={self.fraction:g}"
        return out

    def path(self, seed: int, root: Path = RUNS) -> Path:
        return Path(root) / self.method / self.condition / self.defence / f"seed{seed}"


def condition(attack: str, fraction: float) -> str:
    return f"{attack}-{round(fraction * 100)}"


def cells() -> list[Cell]:
    """Every cell, in the order the missing runs are made (each cell's seeds together, so that an
    unfinished grid has whole cells): FedHM's clean run, DP, the other clean runs, then the
    attacks in the order of :data:`ATTACKS`, FedHM before HeteroFL."""
    out = [Cell("fedhm", "clean", "none")]
    out += [Cell("fedhm", c, "none") for c in ("dp-off", *(f"dp-sigma{s:g}" for s in SIGMAS))]
    out += [Cell(m, "clean", d) for m, defences in DEFENCES.items() for d in defences if (m, d) != ("fedhm", "none")]
    out += [
        Cell(m, condition(a, f), d)
        for a in ATTACKS
        for m, defences in DEFENCES.items()
        for f in FRACTIONS
        for d in defences
    ]
    return out


def finished(path: Path) -> bool:
    return (path / "summary.json").is_file()


def load(root: Path, seeds: tuple[int, ...]) -> dict[Cell, dict[int, dict[str, Any]]]:
    """Cell -> seed -> the finished run's summary."""
    out: dict[Cell, dict[int, dict[str, Any]]] = {}
    for c in cells():
        for k in seeds:
            if finished(c.path(k, root)):
                out.setdefault(c, {})[k] = json.loads((c.path(k, root) / "summary.json").read_text())
    return out
