"""tools/bench_isps_client.py runs a small workload end to end: every span prefill and final
prompt leaves, and the first well before the run ends."""

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_isps_client.py"


def test_a_small_workload_reports_when_requests_left():
    done = subprocess.run([sys.executable, str(TOOL), "--samples", "40", "--slots", "16",
                           "--answer-ms", "5"],
                          capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # each sample's final prompt, and one prefill per distinct document
    assert result["requests_sent"] > 40
    assert result["first_sent_ms"] <= result["sent_16_ms"] < result["all_answered_ms"]
