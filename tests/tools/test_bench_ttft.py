"""tools/bench_ttft.py's argument checks, on this CPU machine (no engine starts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
torch = pytest.importorskip("torch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_paired_without_a_gpu_is_refused_before_any_engine_starts():
    proc = subprocess.run([sys.executable, str(REPO / "tools/bench_ttft.py"), "--arch", "tiny",
                           "--docs", "2", "--paired"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--paired needs a CUDA GPU" in proc.stderr
    assert "Traceback" not in proc.stderr
