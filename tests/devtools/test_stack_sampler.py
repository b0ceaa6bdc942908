"""The stack sampler in a real child process, and tools/stack_summary.py on what it wrote."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import stack_summary  # noqa: E402

CHILD = textwrap.dedent("""
    import threading, time
    from minipic.devtools.stack_sampler import sample_window, start_from_env

    def spin_outside_windows(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass

    def spin_in_window(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass

    start_from_env()
    spin_outside_windows(0.3)
    with sample_window("busy"):
        worker = threading.Thread(target=spin_in_window, args=(0.4,), name="spinner")
        worker.start()
        worker.join()
    time.sleep(1.5)  # one flush by the sampler itself; exit flushes the rest
""")


def test_samples_every_thread_inside_windows_only(tmp_path):
    env = {**os.environ, "MINIPIC_STACK_SAMPLES": str(tmp_path), "MINIPIC_STACK_SAMPLE_MS": "2",
           "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", CHILD], env=env, check=True, timeout=60)
    assert not (tmp_path / "window-open").exists()
    text = stack_summary.summary(tmp_path, top=5)
    assert "## busy: 1 windows" in text
    spinner = text[text.index("thread spinner"):]
    assert "spin_in_window" in spinner.split("thread ")[1]
    # the main thread waited in join(), in the window (its section, to the next thread's)
    main = text[text.index("thread MainThread"):].split("  [")[0]
    assert "join" in main
    assert "spin_outside_windows" not in text  # nothing sampled between windows
    samples = next(tmp_path.glob("*.samples.jsonl")).read_text()
    assert "spin_outside_windows" not in samples


FORKING_CHILD = textwrap.dedent("""
    import os, time
    from minipic.devtools.stack_sampler import sample_window, start_from_env

    def spin_in_forked_child(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass

    start_from_env()
    pid = os.fork()
    if pid == 0:  # as vLLM starts its engine core on CUDA
        with sample_window("forked"):
            spin_in_forked_child(0.4)
        time.sleep(1.5)  # the sampler's own flush; os._exit runs no atexit
        os._exit(0)
    os.waitpid(pid, 0)
    print(pid)
""")


def test_a_forked_child_is_sampled_too(tmp_path):
    env = {**os.environ, "MINIPIC_STACK_SAMPLES": str(tmp_path), "MINIPIC_STACK_SAMPLE_MS": "2",
           "PYTHONPATH": str(REPO)}
    child_pid = subprocess.run([sys.executable, "-c", FORKING_CHILD], env=env, check=True,
                               timeout=60, capture_output=True, text=True).stdout.strip()
    samples = (tmp_path / f"{child_pid}.samples.jsonl").read_text()
    assert "spin_in_forked_child" in samples
    assert "spin_in_forked_child" in stack_summary.summary(tmp_path, top=5)


def test_without_the_variable_nothing_is_written(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MINIPIC_STACK_SAMPLES"}
    env["PYTHONPATH"] = str(REPO)
    subprocess.run([sys.executable, "-c", CHILD], env=env, check=True, timeout=60,
                   cwd=tmp_path)
    assert list(tmp_path.iterdir()) == []
