"""Where a benchmark pass's host time went, engine step by engine step (no GPU needed to read).

`tools/bench_rag.py table1 --step-phases DIR` times vLLM's and minipic's main host functions
in every vLLM process (`minipic/devtools/step_phases.py`, unsampled: two clock reads a call)
and notes each run's measured pass in table1.json (`pass_monotonic`, the clock every process
shares). This prints, for one run's pass: each process's seconds by function, then one line
per engine-core step: when it began (ms from the pass's start), its wall time, and the time of
the functions called inside it. A step's `sample_tokens` is mostly the engine core waiting for
the GPU; `execute_model` is host work (the batch's preparation and the layers' launches).

    python3 tools/step_phases_summary.py DIR --table1 OUT/table1.json --run 5@1024/r0.9
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from minipic.devtools.process_logs import records_by_process  # noqa: E402
from minipic.devtools.step_phases import SUFFIX, calls_within  # noqa: E402

STEP_PREFIX = "EngineCore.step"
# Columns of the step table: (heading, the functions as step_phases names them: Model
# Runner V2's, the V1 runner's). `execute` holds the worker's columns after it.
STEP_COLUMNS = (
    ("schedule", ("Scheduler.schedule",)),
    ("execute", ("GPUModelRunner.execute_model",)),
    ("add_requests", ("GPUModelRunner.add_requests", "GPUModelRunner._update_states")),
    ("prepare_inputs", ("GPUModelRunner.prepare_inputs", "GPUModelRunner._prepare_inputs")),
    ("add_spans", ("SpanBatchBuilder._add_spans",)),
    ("layout", ("span_layout.current_layout",)),
    ("plan", ("segment_plan.segment_plan",)),
    ("attention", ("Attention.forward",)),
    ("sample_tokens", ("GPUModelRunner.sample_tokens",)),
)
# Called once for each waiting request the scheduler looks at (given blocks or not).
LOOKED_UP = "KVCacheManager.get_computed_blocks"


def process_calls(folder: Path) -> dict[str, list[tuple]]:
    """Each process's calls (name, start, seconds), by process id, in start order."""
    found = records_by_process(folder, SUFFIX)
    if not found:
        raise SystemExit(f"{folder}: no step-phase logs (*{SUFFIX})")
    return {pid: sorted(calls, key=lambda call: call[1]) for pid, calls in found.items()}


def engine_steps(calls: list[tuple], begin: float, end: float) -> list[dict]:
    """The engine core's steps that began inside [begin, end] (`calls` in start order, of
    every process): each one's start (s from `begin`), wall seconds, seconds by STEP_COLUMNS
    of the calls that started inside it, and the requests the scheduler looked up."""
    starts = [call[1] for call in calls]
    steps = []
    for name, start, seconds in calls[bisect.bisect_left(starts, begin):
                                      bisect.bisect_right(starts, end)]:
        if not name.startswith(STEP_PREFIX):
            continue
        inside = calls_within(calls[bisect.bisect_left(starts, start):
                                    bisect.bisect_right(starts, start + seconds)],
                              start, start + seconds)
        steps.append({"start": start - begin, "seconds": seconds,
                      **{heading: sum(inside.get(f, (0.0, 0))[0] for f in functions)
                         for heading, functions in STEP_COLUMNS},
                      "looked_up": inside.get(LOOKED_UP, (0.0, 0))[1]})
    return steps


def pass_window(table1: Path, run: str | None) -> tuple[str, float, float]:
    """(run name, begin, end) of a run's measured pass in a bench_rag table1.json: the run
    named, or the only one with a window."""
    results = [r for r in json.loads(table1.read_text())["results"] if r.get("pass_monotonic")]
    chosen = [r for r in results if run is None or r["name"] == run]
    if len(chosen) != 1:
        names = ", ".join(r["name"] for r in results) or "none (run with --step-phases)"
        wanted = f"no pass window for {run}" if run else "name one run with --run"
        raise SystemExit(f"{table1}: {wanted} (runs with a pass window: {names})")
    begin, end = chosen[0]["pass_monotonic"]
    return chosen[0]["name"], begin, end


def role(found: dict) -> str:
    """Which vLLM process made these calls."""
    if any(name.startswith(STEP_PREFIX) for name in found):
        return "engine core"
    if "GPUModelRunner.execute_model" in found:
        return "worker"
    return "front end" if any(name.startswith(("InputProcessor", "OutputProcessor"))
                              for name in found) else "other"


def summary(calls: dict[str, list[tuple]], begin: float, end: float) -> str:
    lines = []
    for pid, process in calls.items():
        found = calls_within(process, begin, end)
        if not found:
            continue
        lines.append(f"process {pid} ({role(found)})")
        for name, (seconds, count) in sorted(found.items(), key=lambda kv: -kv[1][0]):
            lines.append(f"  {name:52s} {seconds * 1e3:9.1f} ms  calls {count}")
    # A worker in its own process (vLLM's multiprocess executor) times on the same clock:
    # its calls count in the step they started in.
    everyone = sorted((call for process in calls.values() for call in process),
                      key=lambda call: call[1])
    headings = ["start", "step"] + [h for h, _ in STEP_COLUMNS]
    lines += ["", "engine steps (ms; execute holds the worker's columns after it, summed over "
              "workers; looked up: waiting requests the scheduler looked at)", "",
              "| " + " | ".join(headings) + " | looked up |",
              "|" + " --- |" * (len(headings) + 1)]
    for step in engine_steps(everyone, begin, end):
        values = [step["start"], step["seconds"]] + [step[h] for h, _ in STEP_COLUMNS]
        lines.append("| " + " | ".join(f"{v * 1e3:.1f}" for v in values)
                     + f" | {step['looked_up']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="the --step-phases folder")
    parser.add_argument("--table1", type=Path, required=True, help="bench_rag's table1.json")
    parser.add_argument("--run", help="a run's name, e.g. 5@1024/r0.9")
    args = parser.parse_args()
    name, begin, end = pass_window(args.table1, args.run)
    print(f"{name}: measured pass of {end - begin:.2f} s\n")
    print(summary(process_calls(args.folder), begin, end))


if __name__ == "__main__":
    main()
