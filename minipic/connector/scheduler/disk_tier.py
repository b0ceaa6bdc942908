"""The disk tier: vLLM's secondary-tier interface over a minipic span store.

vLLM's tiering manager owns the flow (GPU -> CPU primary -> this tier on
store; this tier -> CPU primary -> GPU on a hit); this class only moves rows
of the CPU tier to and from block files. It reuses vLLM's FS-tier machinery
(`AsyncLookupManager` for non-blocking existence checks, `DualQueueThreadPool`
for I/O) and adds what the stock FS tier lacks:

  * a namespace (see `store.namespace`): rotated-K stores and other
    configurations are never read;
  * self-checking files: a bad file fails its load, is removed and remembered
    as a miss for this process, so its blocks are recomputed (never loaded);
    only regular files are opened, without blocking, and read up to one block;
  * an optional store secret (`store/secret.py`): blocks are authenticated
    with HMAC-SHA256 and unauthenticated ones rejected like bad files;
  * degraded mode: a full, read-only or missing disk turns writes (or the
    whole tier) off instead of failing the engine;
  * a size limit with LRU eviction, and counters for `minipic store stats`;
  * loads in reader processes of their own (`reader_processes.py`), so they do
    not wait for the GIL while the scheduler busy-polls; threads as a fallback;
  * `known_blocks`: the keys known to have a file, so that GPU hits are not
    copied back to the CPU tier (`skip_known_blocks.py`).

Everything here runs on the scheduler thread except the task closures, which
run on pool threads and only touch the CPU-tier buffer and the files (or, for
loads, hand a chunk to a reader process and wait for its answer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import stat
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager
from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool

from minipic.connector import compat
from minipic.connector.scheduler.prefault import buffer_address, prefault
from minipic.connector.scheduler.reader_processes import (
    OK, REJECTED, FAILED, ReaderProcesses, read_chunk, region_of)
from minipic.connector.scheduler.skip_known_blocks import KnownBlocks
from minipic.connector.scheduler.span_heads import SpanHeads
from minipic.connector.store import block_file, eviction
from minipic.connector.store.namespace import (
    StoreNamespace, block_key_of_path, block_path, open_namespace)
from minipic.connector.store.secret import load_secret, secret_id
from minipic.connector.store.stats import ProcessCounters

logger = logging.getLogger("vllm.minipic.connector")  # shares vLLM's handlers

# After a write fails for lack of space or permission, stop writing for this
# long, then try again (eviction or an operator may have made room).
WRITE_BACKOFF_S = 30.0


@dataclasses.dataclass
class _Job:
    keys: list[OffloadKey]
    is_store: bool
    started: float = dataclasses.field(default_factory=time.monotonic)
    last_task_done: float = 0.0  # set by the pool threads; read once the job is finished


class _ExistsLookup(AsyncLookupManager):
    """Existence checks on a pool thread, so the scheduler never waits on the disk."""

    def __init__(self, tier: "MiniPICDiskTier"):
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        found = [os.path.exists(self._tier.path_of(k)) for k in keys]
        self._tier.known_blocks.add(k for k, f in zip(keys, found) if f)
        self._tier.known_blocks.discard(k for k, f in zip(keys, found) if not f)
        return found


class MiniPICDiskTier(SecondaryTierManager):
    medium: ClassVar[Any] = compat.STORAGE_MEDIUM

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 root_dir: str, max_bytes: int | None = None, n_read_threads: int = 4,
                 n_write_threads: int = 4, n_read_processes: int = 0,
                 secret_file: str | None = None, **base_kwargs: Any):
        # base_kwargs: what newer vLLM passes every tier (e.g. backpressure_detector).
        super().__init__(offloading_spec, primary_kv_view, tier_type, **base_kwargs)
        self._view = primary_kv_view.cast("B")
        self._row_bytes = primary_kv_view.strides[0]
        self.root_dir = Path(root_dir)
        self.max_bytes = int(max_bytes) if max_bytes else None
        self.span_heads = SpanHeads()
        self._secret = load_secret(secret_file)  # never logged; see store/secret.py

        # Set by open(): until the connector knows the namespace, the tier is off.
        self._namespace: StoreNamespace | None = None
        self._ns_dir: Path | None = None
        self._readable = False
        self._writes_off_until = float("inf")
        self.counters = ProcessCounters(None)

        self._bad_keys: set[OffloadKey] = set()  # failed loads: miss until rewritten
        self.known_blocks = KnownBlocks()
        self._rejects: queue.SimpleQueue[OffloadKey] = queue.SimpleQueue()
        self._write_errors: queue.SimpleQueue[OSError] = queue.SimpleQueue()
        self._instant_results: list[JobResult] = []
        self._jobs: dict[int, _Job] = {}
        self._bytes_since_eviction = 0
        self._evicting = threading.Lock()

        self._prefault_primary()
        self._readers = self._start_readers(n_read_processes)
        # With readers, a load thread only waits on its reader: one thread per reader.
        n_read_threads = max(n_read_threads, self._readers.count if self._readers else 0)
        self._pool = DualQueueThreadPool(n_read_threads, n_write_threads,
                                         thread_name_prefix="minipic_disk")
        self._lookup = _ExistsLookup(self)

    # -- set-up ---------------------------------------------------------------

    def _prefault_primary(self) -> None:
        """Map the CPU tier into this process now, not page by page during loads (prefault.py)."""
        started = time.monotonic()
        how = prefault(self._view)
        logger.info("minipic store: mapped the %.1f GiB CPU tier in %.2f s (%s)",
                    len(self._view) / 2**30, time.monotonic() - started, how)

    def _start_readers(self, count: int) -> ReaderProcesses | None:
        if count <= 0:
            return None
        region = region_of(buffer_address(self._view), len(self._view))
        if region is None:  # e.g. a test's plain buffer: no file the readers could map
            logger.info("minipic store: the CPU tier is not a mapped file; loading on threads")
            return None
        try:
            readers = ReaderProcesses(region, self._row_bytes, count, secret=self._secret)
            logger.info("minipic store: loading through %d reader processes", count)
            return readers
        except OSError as e:
            logger.warning("minipic store: no reader processes (%s); loading on threads", e)
            return None

    def open(self, fields: dict[str, Any], span_heads: SpanHeads | None = None) -> None:
        """Join the store under the namespace `fields` (see scheduler.identity);
        any failure leaves the tier off, not the engine."""
        if span_heads is not None:
            self.span_heads = span_heads
        fields = {**fields, "payload_bytes": self._row_bytes}
        if self._secret is not None:
            fields["block_auth"] = secret_id(self._secret)
        namespace = StoreNamespace(fields)
        self._namespace = namespace
        try:
            self._ns_dir = open_namespace(self.root_dir, namespace)
        except OSError as e:
            ns_dir = self.root_dir / namespace.dirname
            if not (ns_dir / "namespace.json").is_file():
                logger.warning("minipic store %s unusable (%s): running without disk persistence",
                               self.root_dir, e)
                return
            self._ns_dir = ns_dir  # exists but not writable: serve reads only
            logger.warning("minipic store %s is read-only (%s): loading spans, not storing",
                           self.root_dir, e)
        except Exception as e:  # e.g. NamespaceMismatch
            logger.error("minipic store %s refused: %s; running without disk persistence",
                         self.root_dir, e)
            return
        self._readable = True
        writable = os.access(self._ns_dir / "blocks", os.W_OK)
        self._writes_off_until = 0.0 if writable else float("inf")
        self.counters = ProcessCounters(self._ns_dir if writable else None)
        logger.info("minipic store: %s (%s%s)", self._ns_dir,
                    "read-write" if writable else "read-only",
                    ", blocks authenticated with the store secret" if self._secret else "")
        if writable and self.max_bytes is not None:
            self._maybe_evict()  # the store may have been left over its limit (sweeps temps too)
        elif writable:  # no limit, so no eviction: sweep killed writers' temp files at start
            threading.Thread(target=eviction.remove_stale_temp_files, args=(self.root_dir,),
                             name="minipic_sweep", daemon=True).start()

    @property
    def primary_bytes(self) -> int:
        """Size of the CPU tier this tier writes from and loads into."""
        return len(self._view)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (one CPU-tier row, one file's payload)."""
        return self._row_bytes

    def holds(self, key: OffloadKey) -> bool:
        """Whether the store is known to have a good file for `key` (scheduler thread).
        `_bad_keys` wins: a lookup that raced a failed load may have re-added the key."""
        return key in self.known_blocks and key not in self._bad_keys

    def path_of(self, key: OffloadKey) -> str:
        assert self._ns_dir is not None
        return block_path(self._ns_dir, get_offload_block_hash(key), get_offload_group_idx(key))

    # -- lookups ----------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self._readable or key in self._bad_keys:
            return LookupResult.MISS
        found = self._lookup.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookup.cleanup(req_context.req_id)

    def on_schedule_end(self, context: Any) -> None:
        self._lookup.flush()
        self.counters.maybe_flush()

    # -- transfers --------------------------------------------------------------

    def submit_store(self, job: Any) -> None:
        keys = list(job.keys)
        if not self._can_write():
            self._instant_results.append(JobResult(job_id=job.job_id, success=False))
            return
        self._jobs[job.job_id] = _Job(keys, is_store=True)
        tasks = [self._store_task(k, int(slot)) for k, slot in zip(keys, compat.job_slots(job))]
        self._pool.enqueue_store(job.job_id, len(tasks), tasks)

    def submit_load(self, job: Any) -> None:
        keys = list(job.keys)
        record = self._jobs[job.job_id] = _Job(keys, is_store=False)
        requests = [(self.path_of(k), self._namespace.digest, k, int(slot))
                    for k, slot in zip(keys, compat.job_slots(job))]
        read, chunks = self._load_plan(requests)
        tasks = [self._load_task(read, chunk, record) for chunk in chunks]
        self._pool.enqueue_load(job.job_id, len(tasks), tasks)

    def _load_plan(self, requests: list) -> tuple[Any, list[list]]:
        """How to read: one chunk per reader process, or one block per pool thread."""
        readers = self._readers
        if readers is None or readers.broken:
            return (lambda chunk: read_chunk(self._view, self._row_bytes, chunk, self._secret),
                    [[request] for request in requests])
        size = -(-len(requests) // readers.count)
        return readers.read, [requests[i:i + size] for i in range(0, len(requests), size)]

    def _row(self, slot: int) -> memoryview:
        return self._view[slot * self._row_bytes:(slot + 1) * self._row_bytes]

    def _store_task(self, key: OffloadKey, slot: int):
        path, rewrite = self.path_of(key), key in self._bad_keys

        def store() -> None:
            if not rewrite and os.path.exists(path):
                eviction.touch(path)  # someone wrote it already: just record the use
                self.counters.add(duplicate_blocks=1)
                return
            flags = block_file.FLAG_SPAN_HEAD if key in self.span_heads else 0
            try:
                block_file.write_block(path, self._namespace.digest, key, self._row(slot), flags,
                                       self._secret)
            except OSError as e:
                self._write_errors.put(e)
                self.counters.add(store_failures=1)
                raise
            self.counters.add(stored_blocks=1, stored_bytes=self._row_bytes)

        return store

    def _load_task(self, read: Any, chunk: list, job: _Job):
        def load() -> None:
            try:
                results = read(chunk)
            except Exception as e:  # a reader process died or was cut off: recompute these
                results = [(FAILED, str(e))] * len(chunk)
            finally:
                job.last_task_done = time.monotonic()
            self._record_loads(chunk, results)

        return load

    def _record_loads(self, chunk: list, results: list) -> None:
        """Counters and rejects of one chunk; raises (failing the job) if a block is missing."""
        failed, unreadable = 0, []
        for (path, _, key, _), (status, detail) in zip(chunk, results):
            if status == OK:
                continue
            failed += 1
            # Evicted since the lookup, bad, or unreadable now: a miss from here on, recomputed.
            self._rejects.put(key)
            if status == REJECTED:
                reason, inode, unauthenticated = detail
                self.counters.add(rejected_blocks=1, unauthenticated_blocks=int(unauthenticated))
                logger.warning("minipic store: ignoring %s (%s); it will be recomputed",
                               path, reason)
                _remove_if_same(path, inode)
            elif status == FAILED:
                unreadable.append((path, detail))
        if unreadable:  # one line per chunk: a dead reader fails all of its blocks at once
            logger.warning("minipic store: could not read %d block(s), e.g. %s (%s); they will "
                           "be recomputed", len(unreadable), *unreadable[0])
        loaded = len(chunk) - failed
        self.counters.add(hit_blocks=loaded, hit_bytes=loaded * self._row_bytes)
        if failed:
            raise OSError(f"{failed} of {len(chunk)} blocks not loaded")

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results, self._instant_results = self._instant_results, []
        loaded = False
        for job_id, success in compat.finished_jobs(self._pool):
            job = self._jobs.pop(job_id, None)
            results.append(JobResult(job_id=job_id, success=success))
            if job is None:
                continue
            if success:
                self.known_blocks.add(job.keys)
            if not job.is_store:
                loaded |= success
                # Files to CPU tier, first submit to last block: how fast the store reads.
                self.counters.add(load_jobs=1,
                                  load_us=int((job.last_task_done - job.started) * 1e6))
            elif success:
                self._bad_keys.difference_update(job.keys)  # rewritten: trust the file again
                self._note_written(len(job.keys) * self._row_bytes)
        if loaded:
            # Hits are what `minipic store stats` is read for: write them now (one small
            # file per finished load), not only at shutdown, which vLLM may cut short.
            self.counters.maybe_flush(force=True)
        # Drained after the finished list: a task records its reject before it
        # completes, so every reject of a job returned above is already queued.
        self._drain_rejects()
        self._drain_write_errors()
        return results

    def _drain_rejects(self) -> None:
        while True:
            try:
                key = self._rejects.get_nowait()
            except queue.Empty:
                return
            self._bad_keys.add(key)
            self.known_blocks.discard([key])

    def _drain_write_errors(self) -> None:
        while True:
            try:
                e = self._write_errors.get_nowait()
            except queue.Empty:
                return
            if e.errno in block_file.NO_SPACE_ERRNOS:
                if time.monotonic() >= self._writes_off_until:
                    logger.warning("minipic store: cannot write (%s); pausing writes for %.0f s",
                                   e, WRITE_BACKOFF_S)
                self._writes_off_until = time.monotonic() + WRITE_BACKOFF_S
                self._maybe_evict()
            else:
                logger.warning("minipic store: write failed: %s", e)

    def _can_write(self) -> bool:
        return self._readable and time.monotonic() >= self._writes_off_until

    # -- capacity ------------------------------------------------------------------

    def _note_written(self, nbytes: int) -> None:
        # Scanning the store costs one stat per file: do it each time this
        # process has written 5% of the limit, not on every store.
        self._bytes_since_eviction += nbytes
        if self.max_bytes is not None and self._bytes_since_eviction >= self.max_bytes // 20:
            self._maybe_evict()

    def _maybe_evict(self) -> None:
        if self.max_bytes is None or not self._evicting.acquire(blocking=False):
            return
        self._bytes_since_eviction = 0
        threading.Thread(target=self._evict, name="minipic_evict", daemon=True).start()

    def _evict(self) -> None:
        try:
            result = eviction.evict_lru(self.root_dir, self.max_bytes)
            self._forget_removed(result.removed_paths)
            if result.removed_files:
                self.counters.add(evicted_blocks=result.removed_files,
                                  evicted_bytes=result.removed_bytes)
                logger.info("minipic store: evicted %d blocks (%d bytes), %d bytes left",
                            result.removed_files, result.removed_bytes, result.remaining_bytes)
        except OSError as e:
            logger.warning("minipic store: eviction failed: %s", e)
        finally:
            self._evicting.release()

    def _forget_removed(self, paths: list[str]) -> None:
        """Evicted files are no longer known: a GPU hit on them must be stored again."""
        prefix = f"{self._ns_dir}{os.sep}"
        keys = (block_key_of_path(p) for p in paths if p.startswith(prefix))
        self.known_blocks.discard(make_offload_key(*k) for k in keys if k is not None)

    # -- lifecycle ---------------------------------------------------------------------

    def drain_jobs(self) -> None:
        self._pool.wait_idle()

    def shutdown(self) -> None:
        # Counters first: vLLM kills an engine that takes too long to stop, and
        # waiting for the writes below can take that long on a loaded machine.
        self.counters.maybe_flush(force=True)
        # Finish queued writes (the pool's shutdown drops queued tasks):
        # blocks computed just before a restart are exactly the ones to keep.
        self._pool.wait_idle()
        self._lookup.shutdown()
        self._pool.shutdown(wait=True)
        if self._readers is not None:
            self._readers.close()
        self.counters.maybe_flush(force=True)
        # Our byte view pins the CPU tier's mmap: release it so the tier can close it.
        self._view.release()


def _remove_if_same(path: str, inode: int | None) -> None:
    """Remove a bad file, unless another replica already replaced it with a new one."""
    with contextlib.suppress(OSError):
        st = os.lstat(path)  # lstat: a rejected symbolic link is the link, not its target
        if st.st_ino == inode:
            (os.rmdir if stat.S_ISDIR(st.st_mode) else os.unlink)(path)  # rmdir: empty only
