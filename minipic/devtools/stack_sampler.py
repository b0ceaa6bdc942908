"""A sampling profiler of every Python thread of every vLLM process: where wall time goes.

cProfile (host_profile.py) sees one thread of an in-process engine; a request's time also
passes through the front end, the engine core's input and output threads and the offload
threads, each in the usual multiprocess layout. With `MINIPIC_STACK_SAMPLES=<folder>` set,
minipic's plugin entry point starts this sampler in each process vLLM starts: a daemon
thread that, while a window is open (`sample_window`, e.g. around one timed request), every
`MINIPIC_STACK_SAMPLE_MS` (default 1) reads every other thread's stack with
`sys._current_frames()` and appends `(time, thread, stack)` to `<folder>/<pid>.samples.jsonl`,
flushed once a second (an engine core killed at shutdown keeps what it flushed). A thread
blocked in C (a socket poll, a CUDA sync) shows the Python line that called it. Each tick
takes the GIL for tens of microseconds: the sampled requests run a little slower.

tools/stack_summary.py counts the samples inside the windows by process, thread and stack.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path

ENV_FOLDER = "MINIPIC_STACK_SAMPLES"
ENV_INTERVAL_MS = "MINIPIC_STACK_SAMPLE_MS"
OPEN_FLAG = "window-open"  # exists in the folder while a window is open
WINDOWS = "windows.jsonl"
MAX_DEPTH = 48  # frames kept from the leaf up: enough to reach vLLM's entry points
FLUSH_S = 1.0

_started = False
_sampler: "_Sampler | None" = None  # this process's (a forked child replaces its copy)


def start_from_env() -> None:
    """Start sampling this process if MINIPIC_STACK_SAMPLES names a folder (once), and any
    process forked from it (threads do not survive a fork: vLLM forks its engine core on
    CUDA, where the child runs no plugin entry point again)."""
    global _started
    if os.environ.get(ENV_FOLDER) and not _started:
        _started = True
        _start_sampler()
        os.register_at_fork(after_in_child=_start_sampler)
        atexit.register(lambda: _sampler and _sampler.flush())


def _start_sampler() -> None:
    """A sampler for this process; in a forked child it drops the parent's copy (and the
    parent's samples that came with it)."""
    global _sampler
    if not os.environ.get(ENV_FOLDER):  # unset before a fork: the child is not sampled
        _sampler = None
        return
    interval_s = float(os.environ.get(ENV_INTERVAL_MS, "1")) / 1000
    _sampler = _Sampler(Path(os.environ[ENV_FOLDER]), interval_s)
    threading.Thread(target=_sampler.run, name="minipic-stack-sampler", daemon=True).start()


class _Sampler:
    def __init__(self, folder: Path, interval_s: float) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self._path = folder / f"{os.getpid()}.samples.jsonl"
        self._flag = folder / OPEN_FLAG
        self._interval_s = interval_s
        self._stacks: dict[tuple, int] = {}  # ((code, line), ...) -> id
        self._samples: list[tuple[float, int, int]] = []  # (time, thread ident, stack id)
        self._written_stacks = 0
        self._names: dict[int, str] = {}  # thread ident -> name
        self._lock = threading.Lock()
        self._me = -1

    def run(self) -> None:
        self._me = threading.get_ident()
        last_flush = time.monotonic()
        while True:
            time.sleep(self._interval_s)
            if self._flag.exists():  # a stat a tick: sampling costs nothing between windows
                self._sample()
            if time.monotonic() - last_flush >= FLUSH_S:
                self.flush()
                last_flush = time.monotonic()

    def _sample(self) -> None:
        now = time.time()
        frames = sys._current_frames()
        names = {t.ident: t.name for t in threading.enumerate()}  # a thread may end by a flush
        with self._lock:
            self._names.update(names)
            for ident, frame in frames.items():
                if ident != self._me:
                    stack = _frames_of(frame)
                    stack_id = self._stacks.setdefault(stack, len(self._stacks))
                    self._samples.append((now, ident, stack_id))

    def flush(self) -> None:
        """Append the samples since the last flush, with the stacks and thread names they
        are the first to use (cheap ids in the samples, text once)."""
        with self._lock:
            samples, self._samples = self._samples, []
            stacks = list(self._stacks.items())[self._written_stacks:]
            self._written_stacks += len(stacks)
            if not samples and not stacks:
                return
            names = self._names
            lines = [json.dumps({"process": _process_title()})]
            lines += [json.dumps({"stack_id": i, "frames": _text(stack)}) for stack, i in stacks]
            lines += [json.dumps({"t": t, "thread": names.get(ident, str(ident)), "stack": i})
                      for t, ident, i in samples]
            with open(self._path, "a") as f:
                f.write("\n".join(lines) + "\n")


def _process_title() -> str:
    """What ps shows (vLLM renames its engine core `VLLM::EngineCore`)."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return " ".join(sys.argv)[:120]


def _frames_of(frame) -> tuple:
    """Leaf first: (code, line) of each frame, at most MAX_DEPTH."""
    frames = []
    while frame is not None and len(frames) < MAX_DEPTH:
        frames.append((frame.f_code, frame.f_lineno))
        frame = frame.f_back
    return tuple(frames)


def _text(stack: tuple) -> list[str]:
    """Root first, `folder/file.py:line function` (the last two path parts)."""
    return [f"{'/'.join(code.co_filename.split('/')[-2:])}:{line} {code.co_name}"
            for code, line in reversed(stack)]


@contextlib.contextmanager
def sample_window(name: str):
    """Sample every process during the block, and record its span as window `name`
    (nothing when MINIPIC_STACK_SAMPLES is unset)."""
    folder = os.environ.get(ENV_FOLDER)
    if not folder:
        yield
        return
    flag = Path(folder) / OPEN_FLAG
    flag.touch()
    start = time.time()
    try:
        yield
    finally:
        end = time.time()
        flag.unlink(missing_ok=True)
        with open(Path(folder) / WINDOWS, "a") as f:
            f.write(json.dumps({"name": name, "start": start, "end": end}) + "\n")
