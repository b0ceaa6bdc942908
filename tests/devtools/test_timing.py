"""The benchmarks' CPU shares: a busy child counts as the engine core, this process as the
front end."""

import multiprocessing
import time

from minipic.devtools.timing import cpu_seconds, cpu_shares


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_busy_child_is_the_engine_cores_share_and_a_sleeping_parent_the_front_ends():
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=spin, args=(1.5,))
    child.start()
    time.sleep(0.3)  # past the child's start-up, which uses CPU of its own
    began, start = cpu_seconds(), time.perf_counter()
    time.sleep(0.8)
    shares = cpu_shares(began, time.perf_counter() - start)
    child.join()
    assert shares["cpu_share_engine_core"] > 0.4, shares  # a busy 2-core machine shares it
    assert shares["cpu_share_front_end"] < 0.2, shares
