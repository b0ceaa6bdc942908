"""Let the engine core idle while only disk-tier stores are in flight.

vLLM keeps the engine stepping while its tiering manager has any transfer in
flight (`has_pending_work`). Between requests that is a busy-poll: schedule, an
empty step, a 1 ms sleep, again, in the thread that also holds the GIL for the
next request's arrival. A store handed to the disk tier needs no step to
finish (its pool threads write the file); its completion, which only unpins
the CPU-tier rows it read, is collected by the next step that runs anyway.
On the H200, a stack-sampled 40-document span hit spent ~14 ms of its
first-token time behind that loop and the stores it starved of the GIL
(docs/benchmarks.md). Loads (a request waits for them), cascades not yet
handed to a tier, and any store while a tier has vLLM's back-pressure detector
(compat.tiering_needs_steps) still keep the engine stepping; the disk tier
records a block as stored when its task writes it, not at collection
(disk_tier.py); shutdown still waits for every write.
"""

from __future__ import annotations

from typing import Any

from minipic.connector import compat


class IdleDuringDiskStores:
    """vLLM's tiering manager, except that `has_pending_work` ignores stores a tier holds."""

    def __init__(self, manager: Any):
        self._manager = manager

    def has_pending_work(self) -> bool:
        return compat.tiering_needs_steps(self._manager)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)
