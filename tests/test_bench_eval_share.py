"""Figure 11 (bench/eval_share.py): level evaluation's share of a round, computed from made-up rows (nothing
timed here), and its section of the report."""

from __future__ import annotations

import pytest

from bench import eval_share
from bench.run import FIGURES, markdown

#: rounds of 8 s with 1, 2 and 0.5 s of evaluation, and a round not evaluated
ROWS = [
    {"round": 1, "seconds": 8.0, "eval_seconds": 1.0},
    {"round": 2, "seconds": 8.0, "eval_seconds": 2.0},
    {"round": 3, "seconds": 5.0},
    {"round": 4, "seconds": 10.0, "eval_seconds": 0.5},
]


def test_the_share_is_each_evaluated_rounds_eval_seconds_over_its_seconds_and_their_median():
    figure = eval_share.eval_shares(ROWS)
    assert [(r["round"], r["share"]) for r in figure["rounds"]] == [(1, 0.125), (2, 0.25), (4, 0.05)]
    assert figure["median_share"] == 0.125 and figure["target"] == 0.12
    assert eval_share.eval_shares([{"round": 1, "seconds": 3.0}])["median_share"] is None


@pytest.mark.parametrize("rows,verdict", [(ROWS, "(**missed**)"), (ROWS[3:], "(met)")])
def test_the_report_section_gives_the_median_against_the_target(rows, verdict):
    figure = {"quick": False, "overrides": [], **eval_share.eval_shares(rows)}
    section = eval_share.eval_share_markdown(figure)
    assert section[0] == "## 11. Level evaluation's share of a round"
    text = "\n".join(section)
    assert verdict in text and "target ≤ 12 %" in text
    assert f"**{100 * figure['median_share']:.1f} %**" in text
    assert "| 4 | 0.50 | 10.00 | 5.0 % |" in text
    assert FIGURES["11"][0] == "11_eval_share"
    assert "## 11." in markdown({"machine": "m", "figures": {"11_eval_share": figure}})
