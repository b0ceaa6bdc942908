"""What a store holds and how it is used.

Each engine process counts its own disk hits, writes and rejections in memory
and replaces `<ns>/stats/<process>.json` with the totals every couple of seconds
(from a thread of its own, so a killed engine loses seconds of counts, not all),
so counters never need a shared lock. `minipic store evict` leaves a file of its
own in each namespace it evicted from. `scan_store` adds those files up and walks
the block files (headers only) for spans, blocks and bytes.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from minipic.connector.store.block_file import FLAG_SPAN_HEAD, BlockRejected, read_header
from minipic.connector.store.eviction import BlockEntry, iter_blocks
from minipic.connector.store.namespace import MAX_JSON_BYTES, is_store_root, list_namespaces
from minipic.connector.store.regular_files import read_regular

COUNTERS = ("hit_blocks", "hit_bytes", "stored_blocks", "stored_bytes", "duplicate_blocks",
            "rejected_blocks", "unauthenticated_blocks", "store_failures", "evicted_blocks",
            "evicted_bytes", "load_jobs", "load_us")


FLUSH_EVERY_S = 2.0


class ProcessCounters:
    """Thread-safe counters of one engine process, flushed to its own file."""

    def __init__(self, ns_dir: Path | None, flush_every_s: float = FLUSH_EVERY_S):
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        self._dirty = False
        self._last_flush = 0.0
        self._flush_every_s = flush_every_s
        name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
        self._path = ns_dir / "stats" / name if ns_dir is not None else None

    def add(self, **counts: int) -> None:
        with self._lock:
            self._counts.update(counts)
            self._dirty = True

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {k: self._counts.get(k, 0) for k in COUNTERS}

    def maybe_flush(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self._dirty or self._path is None:
            return
        if not force and now - self._last_flush < self._flush_every_s:
            return
        self._last_flush = now
        self._dirty = False
        data = self.snapshot()
        tmp = self._path.with_suffix(".tmp")
        try:  # stats are best effort: a full or read-only disk just loses them
            self._path.parent.mkdir(exist_ok=True)
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self._path)
        except OSError:
            pass


def evictions_by_namespace(removed: list[BlockEntry]) -> dict[Path, dict[str, int]]:
    """Counters for the blocks an eviction removed, per namespace folder (<ns>/blocks/ab/cd/f)."""
    counts: dict[Path, dict[str, int]] = {}
    for block in removed:
        ns = counts.setdefault(Path(block.path).parents[3],
                               {"evicted_blocks": 0, "evicted_bytes": 0})
        ns["evicted_blocks"] += 1
        ns["evicted_bytes"] += block.size
    return counts


def record_evictions(removed: list[BlockEntry]) -> None:
    """Count, in each namespace, the blocks a process that keeps no counters of its own
    (`minipic store evict`) removed: one counters file per namespace, written now."""
    for ns_dir, counts in evictions_by_namespace(removed).items():
        counters = ProcessCounters(ns_dir)
        counters.add(**counts)
        counters.maybe_flush(force=True)


@dataclasses.dataclass
class NamespaceStats:
    path: str
    fields: dict[str, Any] | None
    spans: int = 0
    blocks: int = 0
    bytes: int = 0
    unreadable: int = 0
    counters: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))


def _sum_counters(ns_dir: Path) -> dict[str, int]:
    total = dict.fromkeys(COUNTERS, 0)
    for f in (ns_dir / "stats").glob("*.json"):
        try:
            data = json.loads(read_regular(f, MAX_JSON_BYTES))
            counts = {k: int(data.get(k, 0)) for k in COUNTERS}
        except (OSError, ValueError, TypeError, AttributeError):
            continue  # unreadable or not a counters file: it counts nothing
        for k, n in counts.items():
            total[k] += n
    return total


def scan_namespace(ns_dir: Path, fields: dict[str, Any] | None) -> NamespaceStats:
    stats = NamespaceStats(str(ns_dir), fields, counters=_sum_counters(ns_dir))
    for block in iter_blocks(ns_dir):
        stats.blocks += 1
        stats.bytes += block.size
        try:
            if read_header(block.path)["flags"] & FLAG_SPAN_HEAD:
                stats.spans += 1
        except (OSError, BlockRejected):
            stats.unreadable += 1
    return stats


class NotAStore(ValueError):
    pass


def looks_like_vllm_offload_dir(root: Path) -> bool:
    """vLLM's FS tier writes <root>/<model>_<digest>/config.json with inference_engine."""
    for cfg in root.glob("*/config.json"):
        try:
            if "inference_engine" in json.loads(read_regular(cfg, MAX_JSON_BYTES)):
                return True
        except (OSError, ValueError, TypeError):
            continue
    return False


def scan_store(root: str | os.PathLike) -> list[NamespaceStats]:
    root = Path(root)
    if not is_store_root(root):
        hint = (" (it looks like a stock vLLM offload directory: its span blocks hold keys at "
                "their positions, not in span frames, and must not be used by minipic)" if looks_like_vllm_offload_dir(root) else "")
        raise NotAStore(f"{root} is not a minipic store{hint}")
    return [scan_namespace(d, fields) for d, fields in list_namespaces(root)]
