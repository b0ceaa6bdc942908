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
