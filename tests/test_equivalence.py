"""bench/equivalence.py: a later commit's runs join a study only when it trains what the study's commit
trains, and the page says so (bench/page_notes.py)."""

from __future__ import annotations

import hashlib
import subprocess

import torch
from safetensors.torch import load_file

from bench import equivalence, page_notes
from fedhm_flwr.config import load_config
from fedhm_flwr.ops.apps.local_grid import LocalGrid, client_handlers
from fedhm_flwr.ops.apps.server_app import run

BASE, LATER = "e59c115", "abc1234"


def _rows(later_runs: int = 2) -> list[dict]:
    return [{"code_commit": BASE, "code_dirty": False}] * 6 + [{"code_commit": LATER, "code_dirty": False}] * later_runs


def test_a_record_certifies_only_when_every_shared_method_is_identical():
    same = equivalence.compare(
        BASE, LATER, {"fedhm": "a", "heterofl": "b"}, {"fedhm": "a", "heterofl": "b", "fiarse": "c"}
    )
    assert same["identical"] == ["fedhm", "heterofl"] and same["only_later"] == ["fiarse"] and same["differ"] == []
    assert equivalence.certified(same)
    differ = equivalence.compare(BASE, LATER, {"fedhm": "a", "heterofl": "b"}, {"fedhm": "a", "heterofl": "x"})
    assert differ["differ"] == ["heterofl"] and not equivalence.certified(differ)
    assert not equivalence.certified(equivalence.compare(BASE, LATER, {"fedhm": "a"}, {"fiarse": "c"}))  # none shared


def test_the_page_counts_a_certified_later_commit_as_the_studys_and_nothing_else():
    certified = {(BASE, LATER): equivalence.compare(BASE, LATER, {"fedhm": "a"}, {"fedhm": "a", "fiarse": "c"})}
    differ = {(BASE, LATER): equivalence.compare(BASE, LATER, {"fedhm": "a"}, {"fedhm": "b"})}
    for known in ({}, differ, {(LATER, BASE): certified[(BASE, LATER)]}):  # none, a failed one, the wrong way round
        lines, flagged = page_notes.code_lines(_rows(), known)
        assert flagged and "2 commits" in lines[0], known
    lines, flagged = page_notes.code_lines(_rows(), certified)
    assert not flagged and f"results/equivalence/{BASE}-{LATER}.json" in lines[0] and "certified" in lines[0]
    assert page_notes.archive_reasons([{**r, "final_deployable_acc/global": 0.8} for r in _rows()]) != []  # no record
    dirty = [*_rows(), {"code_commit": LATER, "code_dirty": True}]
    assert "1 run(s) on uncommitted code" in page_notes.code_problems(dirty, certified)
    # the study's commit is the one most runs ran on: a certificate from the minority commit counts for nothing
    assert page_notes.code_problems(_rows(later_runs=9), certified) == ["2 commits"]


def test_each_commit_runs_the_methods_it_has():
    assert "fiarse" not in equivalence.methods_at(BASE)  # FIARSE came after the full study's commit
    assert {"fedhm", "heterofl", "fjord"} <= set(equivalence.methods_at(BASE))
    assert "fiarse" in equivalence.methods_at("HEAD") and set(equivalence.methods_at("HEAD")) == set(equivalence.CASES)


def test_a_commits_digest_is_the_final_model_its_run_trains(tmp_path):
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout
    got = equivalence.digests_at(head.strip(), ["fedavg"], tmp_path / "work")
    # the same run in this process, hashed here: tensors by name, key then bytes
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the command's runs
    try:
        cfg = load_config(f"{equivalence.COMMON} {equivalence.CASES['fedavg']}")
        run(LocalGrid(int(cfg.num_clients), client_handlers()), cfg, tmp_path / "here")
    finally:
        torch.set_num_threads(threads)
    tensors = load_file(str(tmp_path / "here" / "checkpoint" / "global_model.safetensors"))
    h = hashlib.sha256()
    for key in sorted(tensors):
        h.update(key.encode() + tensors[key].numpy().tobytes())
    assert got == {"fedavg": h.hexdigest()}
