"""The benchmarks' stopwatch: wall seconds of one call, and CPU seconds of the processes."""

from __future__ import annotations

import time
from typing import Any, Callable


def timed(call: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """Seconds `call(*args)` took (perf_counter), and its result."""
    start = time.perf_counter()
    result = call(*args)
    return time.perf_counter() - start, result


def cpu_seconds() -> tuple[float, dict[int, float]]:
    """CPU seconds (user + system) used so far by this process (the front end, and the
    engine core too when it runs in-process) and, by pid, by its children (the engine
    core, else only helpers such as compile workers)."""
    import psutil

    def used(process) -> float:
        times = process.cpu_times()
        return times.user + times.system

    me, children = psutil.Process(), {}
    for child in me.children(recursive=True):
        try:
            children[child.pid] = used(child)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass  # ended since it was listed
    return used(me), children


def cpu_shares(began: tuple[float, dict[int, float]], wall: float) -> dict:
    """CPU seconds per wall second since `began` (cpu_seconds()): near 1 for a process that
    was never idle, a host-bound one. A child that ended in between counts for nothing
    after its last reading."""
    own, children = cpu_seconds()
    child_seconds = sum(seconds - began[1].get(pid, 0.0) for pid, seconds in children.items())
    return {"cpu_share_front_end": round((own - began[0]) / wall, 3),
            "cpu_share_engine_core": round(child_seconds / wall, 3)}


def gpu_ms(call: Callable[[], Any], rep_ms: int = 100) -> tuple[float, bool]:
    """Median GPU milliseconds of `call` replayed from a CUDA graph (no launch gaps:
    the GPU's time alone), and whether it was: a call that cannot be captured is timed
    eagerly, its launches included."""
    import torch
    import triton

    call()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        run, graphed = graph.replay, True
    except Exception:  # noqa: BLE001 - timed eagerly instead, and said so
        torch.cuda.synchronize()
        run, graphed = call, False
    ms = triton.testing.do_bench(run, warmup=max(10, rep_ms // 4), rep=rep_ms,
                                 return_mode="median")
    return ms, graphed
