"""Wait until a store stops growing: what an in-process preload does before it stops its engine.

The disk tier writes in the background, and a stopping engine finishes its queued writes, but
vLLM kills an engine process 5 s into its shutdown; blocks still queued then are lost (never
torn: files appear by rename). So a preload that owns its engine waits here first. "Settled" =
the number and total size of block files unchanged for `quiet_s`; a store other replicas keep
writing may never settle, hence the timeout.
"""

from __future__ import annotations

import os
import time

from minipic.connector.store.eviction import iter_blocks


def _footprint(root: str | os.PathLike) -> tuple[int, int]:
    count = size = 0
    for block in iter_blocks(root):
        count, size = count + 1, size + block.size
    return count, size


def wait_until_settled(root: str | os.PathLike, *, quiet_s: float = 3.0,
                       timeout_s: float = 300.0, poll_s: float = 0.5) -> bool:
    """True once the store has not grown for `quiet_s`; False if `timeout_s` passed first."""
    start = last_change = time.monotonic()
    last = _footprint(root)
    while time.monotonic() - last_change < quiet_s:
        if time.monotonic() - start > timeout_s:
            return False
        time.sleep(poll_s)
        now = _footprint(root)
        if now != last:
            last, last_change = now, time.monotonic()
    return True
