"""The benchmarks' stopwatch: wall seconds of one call, and CPU seconds of the processes."""

from __future__ import annotations

import time
from typing import Any, Callable


def timed(call: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """Seconds `call(*args)` took (perf_counter), and its result."""
    start = time.perf_counter()
    result = call(*args)
    return time.perf_counter() - start, result


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds (user + system) used so far by this process (the front end, and the
    engine core too when it runs in-process) and by its children (the engine core, else
    only helpers such as compile workers)."""
    import psutil

    def used(process) -> float:
        times = process.cpu_times()
        return times.user + times.system

    me = psutil.Process()
    return used(me), sum(used(child) for child in me.children(recursive=True))


def cpu_shares(began: tuple[float, float], wall: float) -> dict:
    """CPU seconds per wall second since `began` (cpu_seconds()): near 1 for a process that
    was never idle, a host-bound one."""
    now = cpu_seconds()
    return {"cpu_share_front_end": round((now[0] - began[0]) / wall, 3),
            "cpu_share_engine_core": round((now[1] - began[1]) / wall, 3)}
