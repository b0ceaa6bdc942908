"""tools/step_phases_summary.py on step-phase logs written as minipic.devtools.step_phases
writes them (one JSON-lines file a process) and a bench_rag table1.json naming the pass:
only the pass's calls count, and each engine step gets the calls made inside it, by any
process."""

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "step_phases_summary.py"


def write_log(folder: Path, pid: int, calls: list) -> None:
    lines = [json.dumps(call) for call in calls]
    (folder / f"{pid}.phases.jsonl").write_text("\n".join(lines) + "\n{\"cut short")


def test_each_step_of_the_pass_gets_its_own_calls(tmp_path):
    logs = tmp_path / "phases"
    logs.mkdir()
    write_log(logs, 11, [  # the engine core
        ["EngineCore.step_with_batch_queue", 5.0, 0.1],  # warm-up: before the pass
        ["Scheduler.schedule", 5.01, 0.05],
        ["EngineCore.step_with_batch_queue", 10.0, 0.5],
        ["Scheduler.schedule", 10.01, 0.02],
        ["KVCacheManager.get_computed_blocks", 10.012, 0.001],
        ["KVCacheManager.get_computed_blocks", 10.014, 0.001],
        ["EngineCore.step_with_batch_queue", 10.6, 0.03],
        ["Scheduler.schedule", 10.6, 0.01],
        ["EngineCore.step_with_batch_queue", 11.5, 0.03],  # after the pass
    ])
    write_log(logs, 12, [["InputProcessor.process_inputs", 9.99, 0.004]])  # front end
    write_log(logs, 13, [  # a worker process of its own (vLLM's multiprocess executor)
        ["GPUModelRunner.execute_model", 10.03, 0.2],
        ["SpanBatchBuilder._add_spans", 10.04, 0.05],
        ["Attention.forward", 10.1, 0.001],
        ["Attention.forward", 10.11, 0.003],
        ["GPUModelRunner.sample_tokens", 10.23, 0.25],
    ])
    table1 = tmp_path / "table1.json"
    table1.write_text(json.dumps({"results": [
        {"name": "2@1024/r0.9", "pass_monotonic": [1.0, 4.0]},
        {"name": "5@1024/r0.9", "pass_monotonic": [9.9, 11.0]}]}))

    out = subprocess.run([sys.executable, str(TOOL), str(logs), "--table1", str(table1),
                          "--run", "5@1024/r0.9"], capture_output=True, text=True, check=True)

    text = out.stdout
    assert "5@1024/r0.9: measured pass of 1.10 s" in text
    engine = text.split("process 11 (engine core)")[1].split("process")[0]
    assert "Scheduler.schedule" in engine and "30.0 ms  calls 2" in engine  # not the warm-up's
    assert "InputProcessor.process_inputs" in text.split("process 12 (front end)")[1]
    assert "Attention.forward" in text.split("process 13 (worker)")[1]
    rows = [line for line in text.splitlines() if line.startswith("| 1") or line.startswith("| 7")]
    # start, step, schedule, execute, add_requests, prepare_inputs, add_spans, layout, plan,
    # attention, sample_tokens | looked up
    assert rows == ["| 100.0 | 500.0 | 20.0 | 200.0 | 0.0 | 0.0 | 50.0 | 0.0 | 0.0 | 4.0 | "
                    "250.0 | 2 |",
                    "| 700.0 | 30.0 | 10.0 | 0.0 | 0.0 | 0.0 | 0.0 | 0.0 | 0.0 | 0.0 | 0.0 | 0 |"]


def test_a_table_with_several_windows_needs_a_run_named(tmp_path):
    (tmp_path / "phases").mkdir()
    table1 = tmp_path / "table1.json"
    table1.write_text(json.dumps({"results": [{"name": "a", "pass_monotonic": [0, 1]},
                                              {"name": "b", "pass_monotonic": [2, 3]}]}))
    out = subprocess.run([sys.executable, str(TOOL), str(tmp_path / "phases"),
                          "--table1", str(table1)], capture_output=True, text=True)
    assert out.returncode != 0 and "runs with a pass window: a, b" in out.stderr


def test_a_folder_without_logs_is_an_error(tmp_path):
    table1 = tmp_path / "table1.json"
    table1.write_text(json.dumps({"results": [{"name": "a", "pass_monotonic": [0, 1]}]}))
    out = subprocess.run([sys.executable, str(TOOL), str(tmp_path), "--table1", str(table1)],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "no step-phase logs" in out.stderr
