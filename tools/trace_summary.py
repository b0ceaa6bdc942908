"""Summarise torch-profiler traces (vLLM's `--profile-dir` output): where one step's time goes.

    python3 tools/trace_summary.py PROFILE_DIR [--top 15] > summary.md

For each trace file (`*.json` or `*.json.gz`, Chrome trace format): the wall span of GPU work,
busy GPU time, gaps between kernels, copies (host <-> device), and the kernels and CPU ops
that took longest in total. `--steps` adds a table of the engine steps one by one (vLLM's
`execute_context_<requests>(<tokens>)` ranges on the GPU): a step's span, how much of it
the GPU was busy, and its time by kernel class (minipic's turn and merge one of them). Traces are
large; a summary is small enough to keep with the results (docs/connector.md quotes these).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
from pathlib import Path

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}

# Kernel classes by name (first match wins, so the cache writes, whose names say "flash",
# and FA3, a "cutlass" kernel, are not counted as GEMMs): where a step's GPU time goes.
KERNEL_CLASSES = [
    # minipic's own kernels around FlashAttention (minipic/attention/segment_kernels.py)
    ("turn + merge", ("_turn_rows_kernel", "_merge_rows_kernel")),
    ("KV cache write", ("reshape_and_cache", "cache_kernel")),
    ("attention", ("attention", "attn", "flash", "_reduce_segments", "_reduce_splits")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
]


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def busy_time(events: list[dict]) -> float:
    """Union of the events' intervals (overlapping streams count once), microseconds."""
    busy, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e["ts"]):
        start, stop = e["ts"], e["ts"] + e["dur"]
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def top(events: list[dict], n: int) -> list[tuple[str, float, int]]:
    total: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    for e in events:
        total[e["name"]] += e["dur"]
        count[e["name"]] += 1
    return sorted(((name, total[name], count[name]) for name in total), key=lambda r: -r[1])[:n]


def kernel_class(event: dict) -> str:
    if event.get("cat") != "kernel":
        return "copy / memset"
    name = event["name"].lower()
    return next((cls for cls, parts in KERNEL_CLASSES if any(p in name for p in parts)), "other")


def by_class(gpu: list[dict]) -> list[str]:
    total: dict[str, float] = collections.defaultdict(float)
    for e in gpu:
        total[kernel_class(e)] += e["dur"]
    whole = sum(total.values()) or 1.0
    return ["| kernel class | total ms | share |", "| --- | --- | --- |"] + [
        f"| {cls} | {ms / 1e3:.3f} | {ms / whole:.1%} |"
        for cls, ms in sorted(total.items(), key=lambda kv: -kv[1])]


STEP_PREFIX = "execute_context_"


def step_table(gpu: list[dict], steps: list[dict]) -> list[str]:
    """One row per engine step, in order: what the GPU did inside the step's GPU range
    (the classes sum to the busy time where no two kernels overlap)."""
    gpu = sorted(gpu, key=lambda e: e["ts"])
    starts = [e["ts"] for e in gpu]
    classes = [cls for cls, _ in KERNEL_CLASSES] + ["other", "copy / memset"]
    lines = ["| step (requests, tokens) | span ms | busy ms | " + " | ".join(classes) + " |",
             "| --- " * (len(classes) + 3) + "|"]
    for step in sorted(steps, key=lambda e: e["ts"]):
        start, stop = step["ts"], step["ts"] + step["dur"]
        inside = gpu[bisect.bisect_left(starts, start): bisect.bisect_left(starts, stop)]
        total: dict[str, float] = collections.defaultdict(float)
        for e in inside:
            total[kernel_class(e)] += e["dur"]
        name = step["name"][len(STEP_PREFIX):].split("_generation")[0]
        lines.append(f"| {name} | {step['dur'] / 1e3:.1f} | {busy_time(inside) / 1e3:.1f} | "
                     + " | ".join(f"{total[cls] / 1e3:.1f}" for cls in classes) + " |")
    return lines


def summarise(path: Path, n: int, steps: bool = False) -> str:
    events = load_events(path)
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    cpu = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")]
    copies = [e for e in gpu if e.get("cat") == "gpu_memcpy"]
    lines = [f"## {path.name}", ""]
    if gpu:
        span = max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)
        busy = busy_time(gpu)
        lines.append(f"GPU: {span / 1e3:.2f} ms from first to last GPU event, {busy / 1e3:.2f} ms "
                     f"busy ({len(gpu)} events); copies {busy_time(copies) / 1e3:.2f} ms busy "
                     f"({sum(e['dur'] for e in copies) / 1e3:.2f} ms summed, {len(copies)})")
    if gpu:
        lines += [""] + by_class(gpu)
    lines += ["", "| GPU kernel / copy | total ms | calls |", "| --- | --- | --- |"]
    lines += [f"| {name[:90]} | {dur / 1e3:.3f} | {calls} |" for name, dur, calls in top(gpu, n)]
    lines += ["", "| CPU op / annotation | total ms | calls |", "| --- | --- | --- |"]
    lines += [f"| {name[:90]} | {dur / 1e3:.3f} | {calls} |" for name, dur, calls in top(cpu, n)]
    gpu_steps = [e for e in events if e.get("cat") == "gpu_user_annotation"
                 and e["name"].startswith(STEP_PREFIX)]
    if steps and gpu_steps:
        lines += ["", "Engine steps, in order (GPU time inside each step's GPU range, ms):", ""]
        lines += step_table(gpu, gpu_steps)
    python = [e for e in events if e.get("cat") == "python_function"]
    if python:  # traces taken with stacks (bench_ttft.py --profile-stack)
        lines += ["", "| Python function (inclusive: callers count their callees) | total ms | "
                  "calls |", "| --- | --- | --- |"]
        lines += [f"| {name[:90]} | {dur / 1e3:.3f} | {calls} |"
                  for name, dur, calls in top(python, 4 * n)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--steps", action="store_true",
                        help="a table of the engine steps one by one")
    args = parser.parse_args()
    paths = sorted(p for p in args.dir.rglob("*") if p.name.endswith((".json", ".json.gz")))
    if not paths:
        raise SystemExit(f"no trace files under {args.dir}")
    for path in paths:
        print(summarise(path, args.top, args.steps))


if __name__ == "__main__":
    main()
