"""tools/bench_rag.py's run plan (no engine): --configs and --repeat-rate as runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bench_rag  # noqa: E402


def test_plan_runs_expands_isps_and_rates():
    args = argparse.Namespace(configs="1,5,5:64", repeat_rate=[0.3, 0.9], isps_seqs=[64, 1024],
                              max_num_seqs=1024)
    names = [run.name for run in bench_rag.plan_runs(args)]
    assert names == ["1@1024/r0.3", "5@64/r0.3", "5@1024/r0.3", "5@64/r0.3",
                     "1@1024/r0.9", "5@64/r0.9", "5@1024/r0.9", "5@64/r0.9"]


def test_table1_gives_each_row_its_computed_token_bound():
    """ISPS computes 711 tokens a sample where stock computes 988: 1.39x is its bound, and
    53.79 against 42.31 samples/s is 0.91 of it (docs/benchmarks.md's a0b8549 run)."""
    row = lambda config, per_s, computed: {
        "config": config, "label": config, "strategy": "s", "max_num_seqs": 1024,
        "attention": "a", "samples_per_s": per_s, "cached_tokens": 0, "prompt_tokens": 0,
        "samples": 1000, "computed_tokens": computed * 1000, "failed": 0, "repeat_rate": 0.3,
        "measured_repeat_rate": 0.3}
    text = bench_rag.table1_markdown([row("2", 42.31, 988), row("5", 53.79, 711)], {})
    isps = next(line for line in text.splitlines() if line.startswith("| 5 |"))
    assert "| 1.39x | 0.91 |" in isps
    stock = next(line for line in text.splitlines() if line.startswith("| 2 |"))
    assert "| 1.00x | 1.00 |" in stock
