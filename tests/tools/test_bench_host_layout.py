"""tools/bench_host_layout.py runs end to end on a small batch and reports both times."""

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_host_layout.py"


def test_a_small_batch_reports_the_add_and_layout_times():
    done = subprocess.run([sys.executable, str(TOOL), "--rows", "32", "--new", "16",
                           "--steps", "3", "--pool", "20"],
                          capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["rows"] == 32 and result["new_per_step"] == 16 and result["steps"] == 3
    assert result["median_add_ms"] > 0 and result["median_layout_ms"] > 0


def test_a_busy_thread_beside_the_step_at_a_set_switch_interval():
    done = subprocess.run([sys.executable, str(TOOL), "--rows", "32", "--new", "16",
                           "--steps", "3", "--pool", "20", "--busy-thread",
                           "--switch-interval-ms", "0.2"],
                          capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["busy_thread"] is True and result["switch_interval_ms"] == 0.2
    assert result["median_layout_ms"] > 0
