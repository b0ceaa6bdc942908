"""Python's garbage collector pauses in every vLLM process: which timed requests they hit.

A collection stops every thread of its process. With `MINIPIC_GC_PAUSES=<folder>` set,
minipic's plugin entry point registers a `gc.callbacks` hook in each process vLLM starts
(forked engine cores included) that appends every collection of MIN_PAUSE_S or more to
`<folder>/<pid>.gc.jsonl` as `[start, seconds, generation, collected]` (time.monotonic(),
one clock for every process of the host), each line written and flushed as it ends.
`pauses_within` sums them inside a request's [begin, end] (tools/bench_ttft.py reports
them per timed request). Unsampled: the hook costs two clock reads a collection.
"""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

from minipic.devtools.process_logs import read_records, this_process_log

ENV_FOLDER = "MINIPIC_GC_PAUSES"
SUFFIX = ".gc.jsonl"
MIN_PAUSE_S = 0.0002  # young collections take microseconds; these are the ones that count

_started = False
_log = None  # this process's open log (a forked child opens its own)
_start = 0.0


def start_from_env() -> None:
    """Record this process's collections if MINIPIC_GC_PAUSES names a folder (once), and
    those of any process forked from it."""
    global _started
    if os.environ.get(ENV_FOLDER) and not _started:
        _started = True
        _open_log()
        os.register_at_fork(after_in_child=_open_log)
        gc.callbacks.append(_on_collection)


def _open_log() -> None:
    global _log
    path = this_process_log(ENV_FOLDER, SUFFIX)
    _log = None if path is None else open(path, "a", buffering=1)


def _on_collection(phase: str, info: dict) -> None:
    global _start
    if phase == "start":
        _start = time.monotonic()
        return
    seconds = time.monotonic() - _start
    if _log is not None and seconds >= MIN_PAUSE_S:
        _log.write(json.dumps([_start, seconds, info["generation"], info["collected"]]) + "\n")


def read_pauses(folder: Path) -> list[tuple[float, float, int, int]]:
    """Every recorded collection of every process, by start time."""
    return sorted(read_records(folder, SUFFIX))


def pauses_within(pauses: list[tuple], begin: float, end: float) -> float:
    """Seconds of collections that started inside [begin, end] (any process)."""
    return sum(seconds for start, seconds, *_ in pauses if begin <= start <= end)
