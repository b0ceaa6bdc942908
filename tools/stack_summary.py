"""Summarise stack samples (minipic.devtools.stack_sampler): where each thread of each process
spent the sampled windows, e.g. one timed request.

    python3 tools/bench_ttft.py ... --stack-samples /tmp/samples   # or MINIPIC_STACK_SAMPLES=...
    python3 tools/stack_summary.py /tmp/samples > summary.txt

Windows are grouped by name (`gpu-hit docs=40`): for each group, each process and thread, the
share of its samples whose innermost frame is a line (`self`) and whose stack passes through a
function (`inclusive`); a thread's time is its share of its process's sampler ticks times the
windows' wall time. A thread blocked in C (a poll, a CUDA sync) counts as the line that called
it; so does one waiting for the GIL after such a call.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
from pathlib import Path


def read_windows(folder: Path) -> dict[str, list[tuple[float, float]]]:
    groups: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for line in (folder / "windows.jsonl").read_text().splitlines():
        window = json.loads(line)
        groups[window["name"]].append((window["start"], window["end"]))
    return groups


def read_process(path: Path) -> tuple[str, dict[int, list[str]], list[dict]]:
    """(process title, stacks by id, samples) of one process's file; a torn last line
    (the process was killed mid-write) is skipped."""
    title, stacks, samples = path.stem, {}, []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "process" in record:
            title = record["process"]
        elif "frames" in record:
            stacks[record["stack_id"]] = record["frames"]
        else:
            samples.append(record)
    return title, stacks, samples


def in_windows(samples: list[dict], windows: list[tuple[float, float]]) -> list[dict]:
    ordered = sorted(windows)
    starts, ends = [start for start, _ in ordered], [end for _, end in ordered]
    picked = []
    for sample in samples:
        i = bisect.bisect_right(starts, sample["t"]) - 1
        if i >= 0 and sample["t"] <= ends[i]:
            picked.append(sample)
    return picked


def function_of(frame: str) -> str:
    """`file.py:12 name` -> `file.py name` (every line of a function together)."""
    where, _, name = frame.partition(" ")
    return f"{where.rsplit(':', 1)[0]} {name}"


def common_prefix(stacks: list[list[str]]) -> list[str]:
    first = stacks[0]
    depth = 0
    while depth < len(first) and all(len(s) > depth and s[depth] == first[depth] for s in stacks):
        depth += 1
    return first[:depth]


def thread_report(samples: list[dict], stacks: dict[int, list[str]], top: int) -> list[str]:
    """The frames every sample shares (the tail of them), then the shares below them."""
    sampled = [stacks[s["stack"]] for s in samples]
    shared = common_prefix(sampled)
    lines = [f"    in: {' > '.join(shared[-3:])}"]
    if len(shared) == min(len(stack) for stack in sampled):  # all in one place: idle
        return lines
    own = collections.Counter(stack[-1] for stack in sampled)
    n = len(samples)
    inclusive = collections.Counter()
    for stack in sampled:
        inclusive.update({function_of(frame) for frame in stack[len(shared):]})
    lines.append("    self:")
    lines += [f"      {count / n:6.1%}  {frame}" for frame, count in own.most_common(top)]
    lines.append("    inclusive, below the shared frames:")
    lines += [f"      {count / n:6.1%}  {fn}" for fn, count in inclusive.most_common(2 * top)]
    return lines


def summary(folder: Path, top: int) -> str:
    groups = read_windows(folder)
    processes = [read_process(path) for path in sorted(folder.glob("*.samples.jsonl"))]
    out = []
    for name, windows in groups.items():
        span_ms = sum(end - start for start, end in windows) * 1000
        out.append(f"## {name}: {len(windows)} windows, {span_ms:.1f} ms in all")
        for title, stacks, samples in processes:
            picked = in_windows(samples, windows)
            # The sampler's ticks stretch while other threads hold the GIL: a thread's time
            # is its share of the process's ticks times the windows' wall time.
            ticks = len({sample["t"] for sample in picked})
            by_thread = collections.defaultdict(list)
            for sample in picked:
                by_thread[sample["thread"]].append(sample)
            for thread, thread_samples in sorted(by_thread.items()):
                ms = len(thread_samples) / ticks * span_ms / len(windows)
                out.append(f"  [{title}] thread {thread}: {len(thread_samples)} samples "
                           f"(~{ms:.1f} ms a window)")
                out += thread_report(thread_samples, stacks, top)
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    print(summary(args.folder, args.top))


if __name__ == "__main__":
    main()
