"""The benchmarks' stopwatch: wall seconds of one call, and what it returned."""

from __future__ import annotations

import time
from typing import Any, Callable


def timed(call: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """Seconds `call(*args)` took (perf_counter), and its result."""
    start = time.perf_counter()
    result = call(*args)
    return time.perf_counter() - start, result
