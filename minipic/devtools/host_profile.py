"""cProfile of some engine steps: where the host's time goes, by function.

cProfile sees only the thread that starts it, so the engine core must run in it
(`run_engine_core_here()` before the engine starts); such an engine's timings are not
a benchmark's (no front end / engine core overlap, the profiler's own cost)."""

from __future__ import annotations

import contextlib
import cProfile
import io
import os
import pstats
from pathlib import Path


def run_engine_core_here() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


@contextlib.contextmanager
def host_profile(path: Path, title: str):
    """Profile the block; its stats to `path`: `title`, then by own time and cumulative;
    the raw stats beside it (`.prof`, for pstats' callers and callees)."""
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        text = io.StringIO()
        text.write(f"{title}\n")
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("tottime").print_stats(60)
        stats.sort_stats("cumulative").print_stats(80)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.getvalue())
        profile.dump_stats(path.with_suffix(".prof"))
