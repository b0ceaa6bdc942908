"""tools/trace_summary.py on a small Chrome trace written as vLLM's profiler writes it
(gzip JSON): the totals, and with --steps one row per engine step, minipic's turn and
merge a class of their own."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "trace_summary.py"


def kernel(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": 7}


def step(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "gpu_user_annotation", "name": name, "ts": ts, "dur": dur,
            "tid": 7}


def test_steps_table_splits_each_step_by_kernel_class(tmp_path):
    events = [
        step("execute_context_2(64)_generation_0(0)", 0, 1000),
        kernel("nvjet_sm90_gemm", 0, 600),
        kernel("void cutlass::device_kernel<flash::FlashAttnFwdSm90>", 600, 100),
        step("execute_context_9(32)_generation_0(0)", 2000, 3000),
        kernel("nvjet_sm90_gemm", 2000, 500),
        kernel("_turn_rows_kernel", 2500, 200),
        kernel("void cutlass::device_kernel<flash::FlashAttnFwdSm90>", 2700, 300),
        kernel("_merge_rows_kernel", 3000, 250),
        kernel("void vllm::act_and_mul_kernel", 3250, 50),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 3300, "dur": 100,
         "tid": 7},
    ]
    with gzip.open(tmp_path / "rank0.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    done = subprocess.run([sys.executable, str(TOOL), str(tmp_path), "--steps"],
                          capture_output=True, text=True, timeout=120, check=True)
    out = done.stdout
    assert "GPU: 3.40 ms from first to last GPU event, 2.10 ms busy" in out
    header = ("| step (requests, tokens) | span ms | busy ms | turn + merge | KV cache write | "
              "attention | GEMM | other | copy / memset |")
    assert header in out
    assert "| 2(64) | 1.0 | 0.7 | 0.0 | 0.0 | 0.1 | 0.6 | 0.0 | 0.0 |" in out
    assert "| 9(32) | 3.0 | 1.4 | 0.5 | 0.0 | 0.3 | 0.5 | 0.1 | 0.1 |" in out
    plain = subprocess.run([sys.executable, str(TOOL), str(tmp_path)], capture_output=True,
                           text=True, timeout=120, check=True).stdout
    assert "Engine steps" not in plain
