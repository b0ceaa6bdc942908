"""Do not copy a block GPU -> CPU tier when the store already has its file.

vLLM's offloading scheduler stores every computed or GPU-hit block that the
CPU tier lacks, because for stock offloading the CPU tier is the only copy.
With a span store the file is the copy: once a span has aged out of the CPU
tier, every GPU hit on it would copy all its blocks to the CPU tier again
(device-to-host traffic and CPU-tier churn on the hit's critical path, ~25 ms
for ten 1000-token documents of an 8B model on an H200, docs/connector.md),
and the disk tier would then find the file present and write nothing.

The disk tier records which keys it knows to be on disk in this process
(written, loaded, or found by a lookup) and forgets a key whose lookup or load
misses or whose file its own eviction removed, so a block removed by eviction
or by another replica is stored again the next time it is computed or hit.
The trade-off: a block that is only on disk loads from its file (page cache
or device) instead of the CPU tier.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any

from vllm.v1.kv_offload.base import OffloadKey, PrepareStoreOutput, ReqContext

from minipic.connector.scheduler.bounded_keys import BoundedKeys


class KnownBlocks(BoundedKeys):
    """Keys with a file in the store. Forgetting one only costs one redundant store;
    the default 256k keys (a few tens of MB) cover 512 GiB of 2 MiB blocks."""

    def __init__(self, capacity: int = 1 << 18):
        super().__init__(capacity)


class SkipKnownBlocks:
    """vLLM's offloading manager, except that stores skip the blocks `on_disk` names.

    Everything but `prepare_store` goes to the wrapped manager unchanged. An
    empty `keys_to_store` is what vLLM's scheduler (0.25.1, 0.32.0) reads as
    "nothing to store for this request"; it then advances past these blocks.
    """

    def __init__(self, manager: Any,
                 not_on_disk: Callable[[Iterable[OffloadKey]], list[OffloadKey]]):
        self._manager = manager
        self._not_on_disk = not_on_disk  # the keys without a known file, in order

    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext) -> PrepareStoreOutput | None:
        new_keys = self._not_on_disk(keys)
        if not new_keys:
            return PrepareStoreOutput(keys_to_store=[], store_spec=None, evicted_keys=[])
        return self._manager.prepare_store(new_keys, req_context)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)
