"""A bounded, thread-safe set of offload keys, oldest forgotten first.

The scheduler side keeps facts about keys that the I/O threads read (which
blocks start a span, which blocks are on disk). Both are hints whose loss is
cheap, so they are bounded instead of growing with the store.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable

from vllm.v1.kv_offload.base import OffloadKey


class BoundedKeys:
    def __init__(self, capacity: int):
        self._keys: collections.OrderedDict[OffloadKey, None] = collections.OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()  # written and read from the scheduler and I/O threads

    def add(self, keys: Iterable[OffloadKey]) -> None:
        with self._lock:
            for key in keys:
                self._keys[key] = None
                self._keys.move_to_end(key)
            while len(self._keys) > self._capacity:
                self._keys.popitem(last=False)

    def discard(self, keys: Iterable[OffloadKey]) -> None:
        with self._lock:
            for key in keys:
                self._keys.pop(key, None)

    def snapshot(self) -> list[OffloadKey]:
        with self._lock:
            return list(self._keys)

    def missing(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """The keys not in the set, in order (one lock for all: a request's thousands of
        blocks are checked on the scheduler's critical path)."""
        known = self._keys
        with self._lock:
            return [key for key in keys if key not in known]

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)
