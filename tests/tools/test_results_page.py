"""docs/results.md is generated from docs/results/scoreboard.json (tools/results_page.py):
the committed page must be what the scoreboard generates, and goals are judged right."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import results_page  # noqa: E402


def test_the_committed_page_is_what_the_scoreboard_generates():
    problem = results_page.check(results_page.SCOREBOARD, results_page.PAGE)
    assert problem is None, problem


@pytest.mark.parametrize("goal, value, expected", [
    (">= 0.995", 0.962, "missed"),
    (">= 0.8", 0.833, "met"),
    ("<= 1.2", 1.2, "met"),
    ("<= 1.2", 1.21, "missed"),
    ("> 0", 0, "missed"),
    (">= -0.02 (n >= 500)", -0.16, "missed"),
    (">= -0.02 (n >= 500)", 0.0, "met on value (n >= 500 not checked)"),
    ("reported", -0.24, "reported"),
    ("within bf16 tolerance (no number set)", 0.156, "reported"),
    (">= 0.8 and fast", 0.9, "reported"),
    (">= 0.8", "n/a", "reported"),
    (None, 1.0, "reported"),
])
def test_goal_verdicts(goal, value, expected):
    assert results_page.verdict({"goal": goal, "value": value}) == expected


def test_parse_goal_reads_comparison_threshold_and_condition():
    assert results_page.parse_goal(">= -0.02 (n >= 500)") == results_page.Goal(
        ">=", -0.02, "n >= 500")
    assert results_page.parse_goal("<=1.2") == results_page.Goal("<=", 1.2)
    assert results_page.parse_goal("reported") is None


def test_check_fails_on_a_stale_or_missing_page(tmp_path):
    scoreboard = tmp_path / "scoreboard.json"
    page = tmp_path / "results.md"
    metric = {"value": 1.0, "goal": ">= 0.5", "unit": "x | y", "date": "d", "commit": "c",
              "hardware": "h", "command": "run it"}
    scoreboard.write_text(json.dumps({"m": metric}))
    assert "does not exist" in results_page.check(scoreboard, page)
    assert results_page.main(["--scoreboard", str(scoreboard), "--page", str(page)]) == 0
    assert results_page.main(["--check", "--scoreboard", str(scoreboard), "--page", str(page)]) == 0
    assert "| met |" in page.read_text()
    scoreboard.write_text(json.dumps({"m": {**metric, "value": 0.1}}))
    assert results_page.main(["--check", "--scoreboard", str(scoreboard), "--page", str(page)]) == 1
    assert "stale" in results_page.check(scoreboard, page)
