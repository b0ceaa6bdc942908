"""The disk tier: vLLM's secondary-tier interface over a minipic span store.

vLLM's tiering manager owns the flow (GPU -> CPU primary -> this tier on
store; this tier -> CPU primary -> GPU on a hit); this class only moves rows
of the CPU tier to and from block files. It reuses vLLM's FS-tier machinery
(`AsyncLookupManager` for non-blocking existence checks, `DualQueueThreadPool`
for I/O) and adds what the stock FS tier lacks:

  * a namespace (see `store.namespace`): stores of other key formats and other
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
    copied back to the CPU tier (`skip_known_blocks.py`); a watcher thread
    forgets the keys whose files are gone (evicted by anyone, removed, wiped),
    and request-level offloading stores blocks the CPU tier holds but the store
    lost, so nothing stays "stored" that the store no longer has;
  * counters flushed every couple of seconds by that thread, off the scheduler.

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
    OffloadPolicy,
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
from minipic.connector.store.local_disk import is_local_disk
from minipic.connector.store.namespace import (
    NAMESPACE_FILE, StoreNamespace, block_key_of_path, block_path, open_namespace)
from minipic.connector.store.secret import load_secret, secret_id
from minipic.connector.store.stats import ProcessCounters, evictions_by_namespace

logger = logging.getLogger("vllm.minipic.connector")  # shares vLLM's handlers

# After a write fails for lack of space or permission, stop writing for this
# long, then try again (eviction or an operator may have made room).
WRITE_BACKOFF_S = 30.0
# The watcher looks for removals this often (one stat), checks every known key's file at
# once when something was removed, and every FULL_CHECK_S anyway (files removed by hand).
WATCH_S = 1.0
FULL_CHECK_S = 60.0
# Existence checks the scheduler thread makes itself on a local disk (store/local_disk.py), at
# most this long a scheduler step on average, before it hands them to the lookup thread. A
# prompt's first block past its hit (a new question's) is then a miss at once: as a RETRY,
# vLLM would look the whole prompt up again a round later (a GPU span hit's prefix-cache
# lookup, twice). A slow check is a debt the steps after it pay off without checking. On a
# network or FUSE mount every check goes to the lookup thread: there one can hang.
SYNC_LOOKUP_S_PER_STEP = 0.001


@dataclasses.dataclass
class _Job:
    keys: list[OffloadKey]
    is_store: bool
    started: float = dataclasses.field(default_factory=time.monotonic)
    last_task_done: float = 0.0  # set by the pool threads; read once the job is finished


class _ExistsLookup(AsyncLookupManager):
    """Existence checks on a pool thread, so the scheduler does not wait on a slow disk."""

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
        self._evictor: threading.Thread | None = None
        self._other_counters: dict[Path, ProcessCounters] = {}  # evictions in other namespaces
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

        self._prefault_primary()
        self._readers = self._start_readers(n_read_processes)
        # With readers, a load thread only waits on its reader: one thread per reader.
        n_read_threads = max(n_read_threads, self._readers.count if self._readers else 0)
        self._pool = DualQueueThreadPool(n_read_threads, n_write_threads,
                                         thread_name_prefix="minipic_disk")
        self._lookup = _ExistsLookup(self)
        self._sync_lookups = False  # set by open(): only on a local disk
        self._sync_lookup_left = SYNC_LOOKUP_S_PER_STEP  # this step's, less any debt

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
        self._sync_lookups = is_local_disk(self._ns_dir)
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
        self._watcher = threading.Thread(target=self._watch_store, name="minipic_store_watch",
                                         daemon=True)
        self._watcher.start()

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

    def not_held(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """The keys `holds` is False for, in order: one pass over a request's blocks."""
        keys = list(keys)
        unknown = self.known_blocks.missing(keys)
        if not self._bad_keys:
            return unknown
        bad = set(self._bad_keys)  # the I/O threads may add to it meanwhile
        missing = set(unknown)
        return [key for key in keys if key in missing or key in bad]

    def path_of(self, key: OffloadKey) -> str:
        assert self._ns_dir is not None
        return block_path(self._ns_dir, get_offload_block_hash(key), get_offload_group_idx(key))

    # -- lookups ----------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self._readable or key in self._bad_keys:
            return LookupResult.MISS
        found = self._lookup_now(key)
        if found is None:
            found = self._lookup.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def _lookup_now(self, key: OffloadKey) -> bool | None:
        """Whether `key`'s file exists, checked on this thread on a local disk while this
        step's time for such checks lasts (SYNC_LOOKUP_S_PER_STEP); else None."""
        if not self._sync_lookups or self._sync_lookup_left <= 0:
            return None
        started = time.perf_counter()
        [found] = self._lookup.batch_lookup([key], None)
        self._sync_lookup_left -= time.perf_counter() - started
        return found

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        # Request level: blocks of the request that the CPU tier already holds are offered to
        # this tier too (vLLM stores only what the CPU tier lacks, at chunk level), so a block
        # whose file the store lost is written back on its next hit; the known ones never
        # get here (SkipKnownBlocks), so this costs nothing while the store keeps its files.
        return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookup.cleanup(req_context.req_id)

    def on_schedule_end(self, context: Any) -> None:
        self._lookup.flush()
        self._sync_lookup_left = min(self._sync_lookup_left + SYNC_LOOKUP_S_PER_STEP,
                                     SYNC_LOOKUP_S_PER_STEP)

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
            # Known from here, not from when the scheduler collects the job: the engine may
            # idle before that (idle_during_stores.py), and an eviction in between would
            # find nothing to forget. Before the write, so the watcher can forget it too.
            self.known_blocks.add([key])
            if not rewrite and os.path.exists(path):
                eviction.touch(path)  # someone wrote it already: just record the use
                self.counters.add(duplicate_blocks=1)
                return
            flags = block_file.FLAG_SPAN_HEAD if key in self.span_heads else 0
            try:
                block_file.write_block(path, self._namespace.digest, key, self._row(slot), flags,
                                       self._secret)
            except BaseException as e:
                self.known_blocks.discard([key])
                if isinstance(e, OSError):
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
                eviction.announce_removals(self.root_dir)  # other replicas may believe it stored
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
        for job_id, success in compat.finished_jobs(self._pool):
            job = self._jobs.pop(job_id, None)
            results.append(JobResult(job_id=job_id, success=success))
            if job is None:
                continue
            if success and not job.is_store:  # a store's tasks record their own keys
                self.known_blocks.add(job.keys)
            if not job.is_store:
                # Files to CPU tier, first submit to last block: how fast the store reads.
                self.counters.add(load_jobs=1,
                                  load_us=int((job.last_task_done - job.started) * 1e6))
            elif success:
                self._bad_keys.difference_update(job.keys)  # rewritten: trust the file again
                self._note_written(len(job.keys) * self._row_bytes)
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
        self._evictor = threading.Thread(target=self._evict, name="minipic_evict", daemon=True)
        self._evictor.start()

    def _evict(self) -> None:
        try:
            result = eviction.evict_lru(self.root_dir, self.max_bytes)
            self._forget_removed([block.path for block in result.removed])
            for ns_dir, counts in evictions_by_namespace(result.removed).items():
                self._counters_of(ns_dir).add(**counts)
            if result.removed_files:
                logger.info("minipic store: evicted %d blocks (%d bytes), %d bytes left",
                            result.removed_files, result.removed_bytes, result.remaining_bytes)
        except OSError as e:
            logger.warning("minipic store: eviction failed: %s", e)
        finally:
            self._evicting.release()

    def _counters_of(self, ns_dir: Path) -> ProcessCounters:
        if ns_dir == self._ns_dir:
            return self.counters
        if ns_dir not in self._other_counters:  # only the eviction thread adds
            self._other_counters[ns_dir] = ProcessCounters(ns_dir)
        return self._other_counters[ns_dir]

    def _forget_removed(self, paths: list[str]) -> None:
        """Evicted files are no longer known: a GPU hit on them must be stored again."""
        prefix = f"{self._ns_dir}{os.sep}"
        keys = (block_key_of_path(p) for p in paths if p.startswith(prefix))
        self.known_blocks.discard(make_offload_key(*k) for k in keys if k is not None)

    # -- the store under us ------------------------------------------------------------

    def _watch_store(self) -> None:
        """Keep known_blocks true to the files, and the counters on disk (own thread).

        Whoever removes block files announces it (`eviction.announce_removals`): then every
        known key's file is checked (one stat each) and the missing ones forgotten, so their
        next store or GPU hit writes them again. Files removed any other way are caught by
        the check every FULL_CHECK_S; a wiped store (its namespace.json gone) is set up again.
        """
        mark, last_check = self._store_mark(), time.monotonic()
        while not self._stop.wait(WATCH_S):
            try:
                for counters in (self.counters, *list(self._other_counters.values())):
                    counters.maybe_flush()
                now_mark = self._store_mark()
                if now_mark != mark or time.monotonic() - last_check >= FULL_CHECK_S:
                    mark, last_check = now_mark, time.monotonic()
                    self._rejoin_if_wiped()
                    self._forget_missing()
            except Exception as e:  # never let the watcher die: it is what keeps state true
                logger.warning("minipic store: checking the store failed: %s", e)

    def _store_mark(self) -> tuple:
        """Changes when blocks were removed, or the namespace folder was (a wiped store)."""
        try:
            namespace_file = os.stat(self._ns_dir / NAMESPACE_FILE).st_ino
        except OSError:
            namespace_file = None
        return eviction.removals_mark(self.root_dir), namespace_file

    def _forget_missing(self) -> None:
        missing = [k for k in self.known_blocks.snapshot() if not os.path.exists(self.path_of(k))]
        if missing:
            self.known_blocks.discard(missing)
            logger.info("minipic store: %d blocks believed stored are gone from %s; they "
                        "will be stored again", len(missing), self.root_dir)

    def _rejoin_if_wiped(self) -> None:
        if self._writes_off_until == float("inf") or (self._ns_dir / NAMESPACE_FILE).exists():
            return  # read-only, or intact
        try:
            open_namespace(self.root_dir, self._namespace)
            logger.warning("minipic store: %s was removed; set it up again", self._ns_dir)
        except Exception as e:
            logger.warning("minipic store: %s was removed and cannot be set up again: %s",
                           self._ns_dir, e)

    # -- lifecycle ---------------------------------------------------------------------

    def drain_jobs(self) -> None:
        self._pool.wait_idle()

    def shutdown(self) -> None:
        # Counters first: vLLM kills an engine that takes too long to stop, and
        # waiting for the writes below can take that long on a loaded machine.
        self._stop.set()
        self.counters.maybe_flush(force=True)
        # Finish queued writes (the pool's shutdown drops queued tasks):
        # blocks computed just before a restart are exactly the ones to keep.
        self._pool.wait_idle()
        self._lookup.shutdown()
        self._pool.shutdown(wait=True)
        if self._readers is not None:
            self._readers.close()
        # A running eviction holds the store's eviction lock and adds to the counters
        # flushed below: let it finish, so that neither is left behind by this process.
        for thread in (self._watcher, self._evictor):
            if thread is not None:
                thread.join(timeout=10)  # a hung mount must not hang shutdown
        for counters in (self.counters, *self._other_counters.values()):
            counters.maybe_flush(force=True)
        # Our byte view pins the CPU tier's mmap: release it so the tier can close it.
        self._view.release()


def _remove_if_same(path: str, inode: int | None) -> None:
    """Remove a bad file, unless another replica already replaced it with a new one."""
    with contextlib.suppress(OSError):
        st = os.lstat(path)  # lstat: a rejected symbolic link is the link, not its target
        if st.st_ino == inode:
            (os.rmdir if stat.S_ISDIR(st.st_mode) else os.unlink)(path)  # rmdir: empty only
