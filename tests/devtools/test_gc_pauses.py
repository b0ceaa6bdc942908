"""minipic.devtools.gc_pauses in a real child process: its collections logged and summed
inside a window, a forked child's in a log of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from minipic.devtools.gc_pauses import ENV_FOLDER, pauses_within, read_pauses

CHILD = textwrap.dedent("""
    import gc, json, os, sys, time
    from minipic.devtools import gc_pauses
    gc_pauses.start_from_env()
    junk = [[i] for i in range(300_000)]  # enough tracked objects for a full collection
    begin = time.monotonic()
    gc.collect()
    end = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the forked child's collections go to its own log
        gc.collect()
        os._exit(0)
    os.waitpid(pid, 0)
    print(json.dumps([begin, end, pid]))
""")


def test_a_full_collection_is_logged_and_counted_inside_its_window(tmp_path):
    folder = tmp_path / "gc"
    env = dict(os.environ, **{ENV_FOLDER: str(folder)})
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, check=True,
                         capture_output=True, text=True).stdout
    begin, end, child = __import__("json").loads(out)
    pauses = read_pauses(folder)
    full = [p for p in pauses if p[2] == 2 and begin <= p[0] <= end]
    assert len(full) == 1 and full[0][1] > 0  # gc.collect() is one generation-2 collection
    assert pauses_within(pauses, begin, end) >= full[0][1]
    assert pauses_within(pauses, end + 3600, end + 7200) == 0
    assert (folder / f"{child}.gc.jsonl").exists()  # the fork's own log


def test_nothing_is_recorded_without_the_variable(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != ENV_FOLDER}
    subprocess.run([sys.executable, "-c", CHILD], env=env, check=True, capture_output=True,
                   cwd=tmp_path)
    assert not list(tmp_path.rglob("*.gc.jsonl"))
