"""MiniPICDiskTier against vLLM's tier interface, without an engine: hits, bad files, full disk."""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult, OffloadPolicy, ReqContext, make_offload_key)

from minipic.connector.scheduler.disk_tier import MiniPICDiskTier  # noqa: E402
from minipic.connector.scheduler.span_heads import SpanHeads, span_head_keys  # noqa: E402
from minipic.connector.store import block_file, eviction  # noqa: E402
from minipic.connector.store.namespace import FORMAT_VERSION  # noqa: E402
from minipic.connector.store.stats import scan_store  # noqa: E402

ROW = 4096
FIELDS = {"format": "minipic-span-store", "format_version": FORMAT_VERSION, "model": "m",
          "dtype": "float32"}
CTX = ReqContext(req_id="r")


def key(i: int):
    return make_offload_key(bytes([i]) * 32, 0)


class Harness:
    """A CPU tier buffer and the tier, driven the way vLLM's tiering manager drives it."""

    def __init__(self, root, shared_file=None, **kwargs):
        # A shared file like vLLM's CPU tier (reader processes map it too), or plain memory.
        if shared_file is not None:
            with open(shared_file, "wb+") as f:
                f.truncate(8 * ROW)
                self._mapping = mmap.mmap(f.fileno(), 8 * ROW)
            self.rows = np.frombuffer(self._mapping, dtype=np.uint8).reshape(8, ROW)
        else:
            self.rows = np.zeros((8, ROW), dtype=np.uint8)
        self.tier = MiniPICDiskTier(SimpleNamespace(), memoryview(self.rows), "minipic_disk",
                                    root_dir=str(root), **kwargs)
        self.next_job = 0

    def job(self, keys, slots):
        self.next_job += 1
        slots = np.array(slots, dtype=np.int64)
        return SimpleNamespace(job_id=self.next_job, keys=keys, chunk_ids=slots, block_ids=slots,
                               is_promotion=False, req_context=CTX)

    def run(self, submit, keys, slots) -> bool:
        job = self.job(keys, slots)
        submit(job)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for result in self.tier.get_finished_jobs():
                if result.job_id == job.job_id:
                    return result.success
            time.sleep(0.01)
        raise TimeoutError

    def lookup(self, k, ctx=CTX) -> LookupResult:
        deadline = time.monotonic() + 10
        while True:
            result = self.tier.lookup(k, ctx)
            if result is not LookupResult.RETRY or time.monotonic() > deadline:
                return result
            self.tier.on_schedule_end(None)
            time.sleep(0.01)


@pytest.fixture(params=["threads", "reader processes"])
def harness(tmp_path, request):
    if request.param == "threads":
        h = Harness(tmp_path / "store")
    else:
        h = Harness(tmp_path / "store", shared_file=tmp_path / "cpu-tier", n_read_processes=2)
        assert h.tier._readers is not None and h.tier._readers.count == 2
    h.tier.open(FIELDS, SpanHeads())
    yield h
    h.tier.shutdown()


def test_store_then_load(harness, tmp_path):
    harness.tier.span_heads.add([key(1)])
    harness.rows[0] = 7
    harness.rows[1] = 9
    assert harness.run(harness.tier.submit_store, [key(1), key(2)], [0, 1])
    assert harness.lookup(key(1)) is LookupResult.HIT
    assert harness.lookup(key(3)) is LookupResult.MISS
    assert harness.run(harness.tier.submit_load, [key(2), key(1)], [5, 6])
    assert (harness.rows[5] == 9).all() and (harness.rows[6] == 7).all()
    # a duplicate store is harmless
    assert harness.run(harness.tier.submit_store, [key(1)], [3])
    harness.tier.counters.maybe_flush(force=True)
    [ns] = scan_store(tmp_path / "store")
    assert (ns.blocks, ns.spans) == (2, 1)
    assert ns.counters["hit_blocks"] == 2 and ns.counters["duplicate_blocks"] == 1
    assert ns.counters["load_jobs"] == 1 and ns.counters["load_us"] > 0  # one timed load


@pytest.mark.parametrize("damage", ["truncate", "corrupt", "foreign"])
def test_bad_file_is_never_loaded_and_becomes_a_miss(harness, damage):
    harness.rows[0] = 7
    assert harness.run(harness.tier.submit_store, [key(1)], [0])
    assert key(1) in harness.tier.known_blocks  # GPU hits on it are not copied back
    path = harness.tier.path_of(key(1))
    data = bytearray(open(path, "rb").read())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "corrupt":
        data[-1] ^= 1
    else:
        data = bytearray(block_file.encode_header(b"\1" * 16, key(1), bytes(ROW))) + bytes(ROW)
    open(path, "wb").write(bytes(data))
    assert harness.lookup(key(1)) is LookupResult.HIT  # the file exists...
    assert not harness.run(harness.tier.submit_load, [key(1)], [4])  # ...but fails to load
    assert harness.lookup(key(1)) is LookupResult.MISS  # so it is recomputed, not retried
    assert not os.path.exists(path)  # and the bad file is gone
    assert key(1) not in harness.tier.known_blocks  # so its recomputation is stored again
    harness.tier.known_blocks.add([key(1)])  # a lookup that raced the failed load
    assert not harness.tier.holds(key(1))  # the reject still wins until the block is rewritten
    assert harness.run(harness.tier.submit_store, [key(2)], [1])
    # the stores' filter (SkipKnownBlocks) asks for a request's blocks at once, in order
    assert harness.tier.not_held([key(3), key(2), key(1)]) == [key(3), key(1)]
    harness.rows[0] = 8  # recomputed block is written again and trusted again
    assert harness.run(harness.tier.submit_store, [key(1)], [0])
    assert harness.tier.holds(key(1))
    assert harness.lookup(key(1)) is LookupResult.HIT
    assert harness.run(harness.tier.submit_load, [key(1)], [4])
    assert (harness.rows[4] == 8).all()


def test_full_disk_pauses_writes_without_failing(harness, monkeypatch):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(block_file, "write_block", no_space)
    assert not harness.run(harness.tier.submit_store, [key(1)], [0])
    # writes are now off for a while: jobs complete at once, as failures
    assert not harness.tier._can_write()
    assert not harness.run(harness.tier.submit_store, [key(2)], [1])
    assert harness.lookup(key(1)) is LookupResult.MISS


def test_unusable_store_means_no_persistence(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    h = Harness(tmp_path / "file" / "store")
    h.tier.open(FIELDS)
    assert h.lookup(key(1)) is LookupResult.MISS
    assert not h.run(h.tier.submit_store, [key(1)], [0])
    h.tier.shutdown()


def test_read_only_store_still_serves_reads(tmp_path, monkeypatch):
    writer = Harness(tmp_path / "store")
    writer.tier.open(FIELDS)
    writer.rows[0] = 5
    assert writer.run(writer.tier.submit_store, [key(1)], [0])
    writer.tier.shutdown()

    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if mode == os.W_OK else real_access(p, mode))
    reader = Harness(tmp_path / "store")
    reader.tier.open(FIELDS)
    assert not reader.tier._can_write()
    assert reader.lookup(key(1)) is LookupResult.HIT
    assert reader.run(reader.tier.submit_load, [key(1)], [2])
    assert (reader.rows[2] == 5).all()
    reader.tier.shutdown()


def test_disk_limit_evicts_least_recently_used(tmp_path):
    file_bytes = block_file.HEADER_LEN + ROW
    h = Harness(tmp_path / "store", max_bytes=3 * file_bytes)
    h.tier.open(FIELDS)
    for i in range(6):
        assert h.run(h.tier.submit_store, [key(i)], [0])
        os.utime(h.tier.path_of(key(i)), (1000 + i, 1000 + i))
    deadline = time.monotonic() + 10
    while sum(os.path.exists(h.tier.path_of(key(i))) for i in range(6)) > 3:
        assert time.monotonic() < deadline, "eviction did not run"
        h.tier._maybe_evict()
        time.sleep(0.05)
    assert os.path.exists(h.tier.path_of(key(5))) and not os.path.exists(h.tier.path_of(key(0)))
    while h.tier._evicting.locked():  # the eviction thread forgets what it removed
        time.sleep(0.01)
    assert h.tier.holds(key(5)) and not h.tier.holds(key(0))  # a hit on key 0 is stored again
    h.tier.shutdown()


def test_known_blocks_follow_what_lookups_find(tmp_path):
    from minipic.connector.scheduler.skip_known_blocks import KnownBlocks

    writer, replica = Harness(tmp_path / "store"), Harness(tmp_path / "store")
    for h in (writer, replica):
        h.tier.open(FIELDS)
    assert writer.run(writer.tier.submit_store, [key(1)], [0])
    assert key(1) not in replica.tier.known_blocks
    assert replica.lookup(key(1)) is LookupResult.HIT
    assert key(1) in replica.tier.known_blocks  # written by another replica, found on disk
    replica.tier.on_request_finished(CTX)  # vLLM forgets a lookup with its last request
    os.unlink(writer.tier.path_of(key(1)))  # e.g. evicted by the writer
    assert replica.lookup(key(1), ReqContext(req_id="later")) is LookupResult.MISS
    assert key(1) not in replica.tier.known_blocks
    for h in (writer, replica):
        h.tier.shutdown()

    known = KnownBlocks(capacity=2)
    known.add([key(1), key(2)])
    known.add([key(1), key(3)])  # key(1) used again: key(2) is the oldest
    assert (key(1) in known, key(2) in known, key(3) in known) == (True, False, True)


class FakeClock:
    """time.perf_counter for the tier's step budget: moves only when a check says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(time, "perf_counter", fake)
    return fake


def test_a_lookup_answers_at_once_while_the_step_has_time(harness, clock):
    """No RETRY for a block the scheduler thread can check itself: vLLM would look the
    whole prompt up again a round later (a GPU span hit's new question, every time)."""
    harness.tier._sync_lookups = True  # whatever file system the test's temp folder is on
    harness.rows[0] = 7
    assert harness.run(harness.tier.submit_store, [key(1)], [0])
    assert harness.tier.lookup(key(1), CTX) is LookupResult.HIT
    assert harness.tier.lookup(key(3), CTX) is LookupResult.MISS


def test_a_slow_check_hands_the_next_steps_lookups_to_the_thread(harness, clock):
    """A check past the step's time (a slow file system) is paid off by the steps after it:
    their lookups go to the lookup thread (RETRY, then the answer), and the scheduler thread
    checks again once the debt is paid."""
    from minipic.connector.scheduler.disk_tier import SYNC_LOOKUP_S_PER_STEP

    harness.tier._sync_lookups = True  # whatever file system the test's temp folder is on
    check = harness.tier._lookup.batch_lookup

    def slow_check(keys, req_context):
        if threading.current_thread() is threading.main_thread():  # the scheduler's checks
            clock.now += 5 * SYNC_LOOKUP_S_PER_STEP
        return check(keys, req_context)

    harness.tier._lookup.batch_lookup = slow_check
    assert harness.tier.lookup(key(1), CTX) is LookupResult.MISS  # checked here, slowly
    for k in (2, 5, 6):  # new keys: the thread may already have answered an earlier one
        assert harness.tier.lookup(key(k), CTX) is LookupResult.RETRY
        harness.tier.on_schedule_end(None)
    harness.tier._lookup.batch_lookup = check
    assert harness.lookup(key(2)) is LookupResult.MISS
    for _ in range(5):
        harness.tier.on_schedule_end(None)
    assert harness.tier.lookup(key(4), CTX) is LookupResult.MISS  # checked here again


def test_a_store_on_a_network_mount_is_never_checked_on_the_scheduler_thread(
        tmp_path, monkeypatch, clock):
    """One stat on a network or FUSE mount can hang with its server: the engine must not."""
    from minipic.connector.store import local_disk

    mounts = [SimpleNamespace(mountpoint="/", fstype="ext4"),
              SimpleNamespace(mountpoint=str(tmp_path / "store"), fstype="nfs4")]
    monkeypatch.setattr(local_disk.psutil, "disk_partitions", lambda all: mounts)
    h = Harness(tmp_path / "store")
    h.tier.open(FIELDS)
    try:
        assert h.tier.lookup(key(3), CTX) is LookupResult.RETRY  # asked on the lookup thread
        assert h.lookup(key(3)) is LookupResult.MISS
    finally:
        h.tier.shutdown()


def test_the_mount_holding_a_path_decides_whether_it_is_local(monkeypatch):
    from minipic.connector.store import local_disk

    mounts = [SimpleNamespace(mountpoint="/", fstype="ext4"),
              SimpleNamespace(mountpoint="/mnt/shared", fstype="fuse.sshfs"),
              SimpleNamespace(mountpoint="/mnt/shared/scratch", fstype="xfs"),
              SimpleNamespace(mountpoint="/srv/nfs", fstype="ext4"),
              SimpleNamespace(mountpoint="/srv/nfs", fstype="nfs4")]  # mounted over it
    monkeypatch.setattr(local_disk.psutil, "disk_partitions", lambda all: mounts)
    assert local_disk.is_local_disk("/srv/store")
    assert not local_disk.is_local_disk("/mnt/shared/store")
    assert local_disk.is_local_disk("/mnt/shared/scratch/store")
    assert local_disk.is_local_disk("/mnt/sharedx/store")  # a name that only starts alike
    assert not local_disk.is_local_disk("/srv/nfs/store")
    monkeypatch.setattr(local_disk.psutil, "disk_partitions", lambda all: 1 / 0)
    assert not local_disk.is_local_disk("/srv/store")  # no mount table: the safe side


def test_prefault_maps_the_cpu_tier_without_changing_it():
    from minipic.connector.scheduler.prefault import prefault

    rows = np.arange(3 * 4096 + 100, dtype=np.uint8)
    before = rows.copy()
    assert prefault(memoryview(rows)) in ("madvise", "touched")
    assert (rows == before).all()


def test_a_dead_reader_fails_its_load_and_threads_take_over(tmp_path):
    h = Harness(tmp_path / "store", shared_file=tmp_path / "cpu-tier", n_read_processes=1)
    h.tier.open(FIELDS)
    h.rows[0], h.rows[1] = 3, 4
    assert h.run(h.tier.submit_store, [key(1), key(2)], [0, 1])
    [(process, _)] = h.tier._readers._processes
    process.kill()
    process.wait()
    assert not h.run(h.tier.submit_load, [key(1)], [5])  # recomputed, never half-loaded
    assert h.tier._readers.broken
    assert h.run(h.tier.submit_load, [key(2)], [6])  # on the tier's own threads now
    assert (h.rows[6] == 4).all()
    h.tier.shutdown()


def test_a_reader_interrupted_mid_chunk_is_never_reused(tmp_path):
    """Its reply may still arrive: no later chunk may read it as its own."""
    h = Harness(tmp_path / "store", shared_file=tmp_path / "cpu-tier", n_read_processes=1)
    h.tier.open(FIELDS)
    h.rows[0] = 3
    assert h.run(h.tier.submit_store, [key(1)], [0])
    readers = h.tier._readers
    [(_, conn)] = readers._processes
    real_recv = conn.recv
    conn.recv = lambda: (_ for _ in ()).throw(RuntimeError("interrupted"))
    request = [(h.tier.path_of(key(1)), h.tier._namespace.digest, key(1), 5)]
    with pytest.raises(RuntimeError):
        readers.read(request)
    conn.recv = real_recv
    assert readers.broken
    with pytest.raises(OSError):  # closed: fails at once, never hands over the stale reply
        readers.read(request)
    h.tier.shutdown()


def test_a_stuck_reader_is_killed_and_its_blocks_recomputed(tmp_path):
    """A reader that never answers (here: stopped) must not hang the load forever."""
    import signal

    h = Harness(tmp_path / "store", shared_file=tmp_path / "cpu-tier", n_read_processes=1)
    h.tier.open(FIELDS)
    h.rows[0], h.rows[1] = 3, 4
    assert h.run(h.tier.submit_store, [key(1), key(2)], [0, 1])
    readers = h.tier._readers
    readers._reply_timeout_s = 0.5
    [(process, _)] = readers._processes
    process.send_signal(signal.SIGSTOP)
    assert not h.run(h.tier.submit_load, [key(1)], [5])  # recomputed, never half-loaded
    assert readers.broken
    assert process.wait(timeout=5) == -signal.SIGKILL
    assert h.run(h.tier.submit_load, [key(2)], [6])  # on the tier's own threads now
    assert (h.rows[6] == 4).all()
    h.tier.shutdown()


def test_readers_map_only_the_rows_they_write(tmp_path):
    """Each reader used to map the whole CPU tier before its first chunk: seconds and page
    tables per reader for a tier of tens of GiB."""
    from minipic.connector.scheduler.reader_processes import OK, MappedRegion, ReaderProcesses

    row_bytes, rows = 1 << 20, 512  # a 512 MiB tier, sparse until written
    tier_file = tmp_path / "cpu-tier"
    with open(tier_file, "wb") as f:
        f.truncate(row_bytes * rows)
    payload = np.full(row_bytes, 7, dtype=np.uint8)
    path = str(tmp_path / "block")
    block_file.write_block(path, b"n" * 16, b"k", memoryview(payload))
    readers = ReaderProcesses(MappedRegion(str(tier_file), 0, row_bytes * rows), row_bytes, 1)
    try:
        assert readers.read([(path, b"n" * 16, b"k", 3)]) == [(OK, None)]
        [(process, _)] = readers._processes
        rss_kib = int(next(line.split()[1] for line in open(f"/proc/{process.pid}/status")
                           if line.startswith("VmRSS:")))
        assert rss_kib < 200 * 1024, f"the reader holds {rss_kib} KiB"
    finally:
        readers.close()
    with open(tier_file, "rb") as f:
        f.seek(3 * row_bytes)
        assert f.read(row_bytes) == payload.tobytes()


def test_span_head_keys():
    tokens = [3] + [9] * 31 + [9] * 32 + [3] + [9] * 31
    keys = span_head_keys(tokens, [b"a", b"b", b"c"], 32, ssep_token_id=3)
    assert keys == [make_offload_key(b"a", 0), make_offload_key(b"c", 0)]
    # a request's own tokens (vLLM's ConstantList), its partial last block (no hash) left out
    from vllm.v1.utils import ConstantList

    partial = ConstantList(tokens + [3] + [9] * 5)
    assert span_head_keys(partial, [b"a", b"b", b"c"], 32, 3, group_ids=(0, 1)) == [
        make_offload_key(b"a", 0), make_offload_key(b"a", 1),
        make_offload_key(b"c", 0), make_offload_key(b"c", 1)]


def test_an_unlimited_store_sweeps_dead_writers_temp_files_at_start(tmp_path):
    first = Harness(tmp_path / "store")
    first.tier.open(FIELDS)
    stale = Path(first.tier.path_of(key(1)) + ".123.abc.tmp")  # a writer killed mid-write
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(b"half a block")
    os.utime(stale, (1000, 1000))
    first.tier.shutdown()
    second = Harness(tmp_path / "store")
    second.tier.open(FIELDS)  # no disk_max_bytes
    deadline = time.monotonic() + 10
    while stale.exists():
        assert time.monotonic() < deadline, "the temp file was not swept"
        time.sleep(0.05)
    second.tier.shutdown()


class _Warnings(logging.Handler):
    """Collects the disk tier's log lines (vLLM's loggers may not propagate to pytest's)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("vllm.minipic.connector").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("vllm.minipic.connector").removeHandler(self)


def _let_blocked_readers_go(path: str) -> None:
    """A reader stuck opening a FIFO (the defect under test) waits for a writer: be one."""
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.parametrize("hostile", ["fifo", "link to a fifo", "link to /dev/zero", "directory"])
def test_what_is_not_a_regular_file_is_rejected_at_once_and_logged(harness, tmp_path, hostile):
    """A FIFO in a block's place hung loads on threads (and the engine's shutdown with them)
    and stalled reader processes for 120 s, with no log line."""
    harness.rows[0] = 7
    assert harness.run(harness.tier.submit_store, [key(1)], [0])
    path = harness.tier.path_of(key(1))
    os.unlink(path)
    fifo = str(tmp_path / "fifo")
    if hostile == "fifo":
        os.mkfifo(path)
    elif hostile == "link to a fifo":
        os.mkfifo(fifo)
        os.symlink(fifo, path)
    elif hostile == "link to /dev/zero":
        os.symlink("/dev/zero", path)
    else:
        os.mkdir(path)
    with _Warnings() as log:
        try:
            assert harness.lookup(key(1)) is LookupResult.HIT  # something is there...
            started = time.monotonic()
            assert not harness.run(harness.tier.submit_load, [key(1)], [4])  # ...not loaded
            assert time.monotonic() - started < 5
        finally:
            for p in (path, fifo):
                _let_blocked_readers_go(p)
    assert any(path in m and "not a regular file" in m for m in log.messages), log.messages
    assert harness.lookup(key(1)) is LookupResult.MISS  # recomputed...
    assert not os.path.lexists(path)  # ...the entry removed (the link, not its target)...
    assert os.path.exists("/dev/zero")
    assert harness.run(harness.tier.submit_store, [key(1)], [0])  # ...and written again
    assert harness.run(harness.tier.submit_load, [key(1)], [4])
    assert (harness.rows[4] == 7).all()


SECRET = b"0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize("loads_on", ["threads", "reader processes"])
def test_a_store_secret_authenticates_every_block(tmp_path, loads_on):
    """Anyone who can write to store_dir could craft a file with a valid header and checksum.
    With a secret, a block needs its MAC: forged files and files made with another
    secret are rejected, removed, counted and recomputed; the secret is never logged."""
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET + b"\n")
    readers = {"shared_file": tmp_path / "cpu-tier", "n_read_processes": 1} \
        if loads_on == "reader processes" else {}
    with _Warnings() as log:
        h = Harness(tmp_path / "store", secret_file=str(secret_file), **readers)
        h.tier.open(FIELDS)
        h.rows[0], h.rows[1] = 3, 4
        assert h.run(h.tier.submit_store, [key(1), key(2), key(3)], [0, 1, 1])
        assert h.run(h.tier.submit_load, [key(1)], [5])
        assert (h.rows[5] == 3).all()
        good = Path(h.tier.path_of(key(1))).read_bytes()
        assert block_file.read_header(h.tier.path_of(key(1)))["flags"] \
            & block_file.FLAG_AUTHENTICATED
        ns = h.tier._namespace
        forged, other = h.tier.path_of(key(2)), h.tier.path_of(key(3))
        payload = np.full(ROW, 9, dtype=np.uint8).tobytes()  # what the attacker wants served
        Path(forged).write_bytes(block_file.encode_header(ns.digest, key(2), payload) + payload)
        block_file.write_block(other, ns.digest, key(3), payload, secret=b"another secret 0123")
        for k in (key(2), key(3)):  # a failed job: vLLM recomputes, never uses the row
            assert not h.run(h.tier.submit_load, [k], [6])
        assert h.lookup(key(2)) is LookupResult.MISS and not os.path.exists(forged)
        h.tier.shutdown()
    [stats] = scan_store(tmp_path / "store")
    assert stats.counters["rejected_blocks"] == 2 and stats.counters["unauthenticated_blocks"] == 2
    assert stats.fields["block_auth"].startswith("hmac-sha256:")
    text = "\n".join(log.messages)
    assert "not authenticated" in text and "authentication failed" in text
    everything = [text.encode(), *(p.read_bytes() for p in (tmp_path / "store").rglob("*.json"))]
    assert not any(SECRET in blob or SECRET.hex().encode() in blob for blob in everything)

    # Replicas without the secret (or with another) use another namespace folder: they never
    # read, or remove, the authenticated blocks.
    plain = Harness(tmp_path / "store")
    plain.tier.open(FIELDS)
    assert plain.tier._ns_dir != h.tier._ns_dir
    assert plain.lookup(key(1)) is LookupResult.MISS
    plain.tier.shutdown()
    assert Path(h.tier.path_of(key(1))).read_bytes() == good


def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.05)


@pytest.mark.parametrize("lost_by", ["minipic store evict", "another replica's eviction",
                                     "verify --remove", "a wiped disk", "rm"])
def test_blocks_believed_stored_do_not_outlive_their_files(tmp_path, monkeypatch, lost_by):
    """A server skips storing GPU hits it believes stored; once the store loses their files
    (whoever removes them) it must store them again, or `minipic-preload` reports spans
    'already stored' that the store does not have."""
    from minipic.cli import main
    from minipic.connector.scheduler import disk_tier
    from minipic.connector.store.eviction import evict_lru

    monkeypatch.setattr(disk_tier, "FULL_CHECK_S", 1.0 if lost_by == "rm" else 3600.0)
    store = tmp_path / "store"
    h = Harness(store)
    h.tier.open(FIELDS)
    h.rows[0] = 5
    keys = [key(1), key(2)]
    assert h.run(h.tier.submit_store, keys, [0, 0])
    assert all(h.tier.holds(k) for k in keys)  # vLLM's stores of these are skipped
    paths = [h.tier.path_of(k) for k in keys]
    if lost_by == "minipic store evict":
        assert main(["store", "evict", str(store), "--max-bytes", "0"]) == 0
    elif lost_by == "another replica's eviction":
        assert evict_lru(store, max_bytes=0).removed_files == 2
    elif lost_by == "verify --remove":
        for path in paths:
            Path(path).write_bytes(Path(path).read_bytes()[:-1])
        assert main(["store", "verify", str(store), "--remove"]) == 0
    elif lost_by == "a wiped disk":
        shutil.rmtree(store)
    else:
        for path in paths:
            os.unlink(path)
    assert not any(os.path.exists(p) for p in paths)
    _until(lambda: not any(h.tier.holds(k) for k in keys), timeout_s=10)
    assert h.tier.on_new_request(CTX).policy is OffloadPolicy.REQUEST_LEVEL  # see on_new_request
    assert h.run(h.tier.submit_store, keys, [0, 0])  # what vLLM now sends again
    assert all(os.path.exists(p) for p in paths)
    h.tier.shutdown()
    [ns] = scan_store(store)  # a wiped store is set up again, not left without namespace.json
    assert ns.blocks == 2 and ns.fields is not None


def test_counters_reach_the_disk_within_seconds(tmp_path):
    """They used to be written at clean shutdown, or when a load finished."""
    h = Harness(tmp_path / "store")
    h.tier.open(FIELDS)
    assert h.run(h.tier.submit_store, [key(1), key(2)], [0, 1])
    started = time.monotonic()
    _until(lambda: scan_store(tmp_path / "store")[0].counters["stored_blocks"] == 2)
    assert time.monotonic() - started < 5
    h.tier.shutdown()


def test_shutdown_waits_for_a_running_eviction(tmp_path, monkeypatch):
    """The CLI's `store evict` right after an engine stopped used to find the lock
    still held by the engine's eviction thread ("another process is evicting")."""
    scan = eviction.iter_blocks

    def slow_scan(root):
        time.sleep(0.5)  # a store on a slow disk
        return scan(root)

    monkeypatch.setattr(eviction, "iter_blocks", slow_scan)
    h = Harness(tmp_path / "store", max_bytes=10 * (block_file.HEADER_LEN + ROW))
    h.tier.open(FIELDS)  # starts an eviction: the store may be over its limit
    h.tier.shutdown()
    monkeypatch.setattr(eviction, "iter_blocks", scan)
    assert eviction.evict_lru(tmp_path / "store", 0).ran


def test_every_eviction_is_counted(tmp_path):
    from minipic.cli import main

    h = Harness(tmp_path / "store", max_bytes=10 * (block_file.HEADER_LEN + ROW))
    h.tier.open(FIELDS)
    assert h.run(h.tier.submit_store, [key(i) for i in range(4)], [0, 1, 2, 3])
    h.tier.shutdown()
    assert main(["store", "evict", str(tmp_path / "store"), "--max-bytes", "0"]) == 0
    [ns] = scan_store(tmp_path / "store")
    assert ns.counters["evicted_blocks"] == 4
    assert ns.counters["evicted_bytes"] == 4 * (block_file.HEADER_LEN + ROW)


def test_a_block_evicted_before_its_store_is_collected_is_not_believed_stored(harness):
    """The engine may idle between a store's write and the step that collects it
    (idle_during_stores.py). A file evicted in between must be forgotten, or the next GPU
    hit on the block would skip storing it again (SkipKnownBlocks) and it would stay lost."""
    harness.rows[0] = 7
    harness.tier.submit_store(harness.job([key(1)], [0]))
    path = harness.tier.path_of(key(1))
    deadline = time.monotonic() + 10
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    harness.tier.drain_jobs()  # written; nobody has collected the job
    os.unlink(path)  # another replica's eviction
    eviction.announce_removals(harness.tier.root_dir)
    while key(1) in harness.tier.known_blocks and time.monotonic() < deadline:
        time.sleep(0.05)  # the watcher checks every second
    assert [r.success for r in harness.tier.get_finished_jobs()] == [True]  # collected now
    assert not harness.tier.holds(key(1))
