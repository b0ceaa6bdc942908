"""Disk-tier loads in reader processes of their own, so they never wait for the GIL.

The disk tier runs in the engine-core process, whose scheduler thread busy-polls
(schedule, then a 1 ms sleep) while a request waits for its load. Load threads
need the GIL back after every system call and every hash, and next to that
loop they crawled: on the H200 host (`tools/bench_store_read.py`, 630 blocks of
2 MiB, page cache warm) 16 threads read 20 GiB/s alone but 4.3 GiB/s next to a
thread that loops 3 ms and sleeps 1 ms; 16 processes read 13-15 GiB/s, with
their own GILs. The engine itself loaded at 6-7.5 GiB/s with threads.

Each reader maps the CPU tier's shared-memory file itself and writes the
verified blocks straight into their rows; the engine core only sends paths and
row numbers and gets one short result per block back (one message per chunk).
A reader maps only the rows it writes (one madvise per row, the first time):
mapping the whole tier in every reader cost each of them seconds and page
tables for all of it before its first chunk. A reader that dies, or gives no
answer within `reply_timeout_s` (a stalled network mount), is killed; its chunk
fails (those blocks are recomputed) and the tier falls back to reading on its
threads. Readers get the tier's file as an open descriptor (its name may be gone:
see `compat.release_cpu_tier_name`) and the store secret, if any, over their socket.
"""

from __future__ import annotations

import mmap
import os
import queue
import socket
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from minipic.connector.store import block_file, eviction

# What a reader reports per block (see `read_chunk`).
OK, MISSING, REJECTED, FAILED = "ok", "missing", "rejected", "failed"

# Longest wait for a reader's answer to one chunk. Generous: a chunk of a
# 40-document prompt is ~300 MiB, and cold files on a busy disk read at ~1 GiB/s
# shared by all readers. Past it the reader is taken for stuck, not slow.
REPLY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class MappedRegion:
    """Where a buffer lives in a file: the readers map the same bytes."""

    path: str
    offset: int  # of the buffer's first byte in the file
    length: int


def region_of(address: int, length: int) -> MappedRegion | None:
    """The file mapping that holds [address, address + length) in this process, if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or not fields[5].startswith("/"):
                    continue
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= address and address + length <= end:
                    return MappedRegion(fields[5].strip(), int(fields[2], 16) + address - start,
                                        length)
    except OSError:
        return None
    return None


def read_chunk(view: memoryview, row_bytes: int, requests: list[tuple[str, bytes, bytes, int]],
               secret: bytes | None = None) -> list[tuple[str, object]]:
    """Read each (path, namespace, key, row) into its row; one (status, detail) per block:
    REJECTED's detail is (reason, inode, unauthenticated), FAILED's the error."""
    results: list[tuple[str, object]] = []
    for path, namespace, key, row in requests:
        dest = view[row * row_bytes:(row + 1) * row_bytes]
        try:
            block_file.read_block_into(path, namespace, key, dest, secret)
        except FileNotFoundError:
            results.append((MISSING, None))
        except block_file.BlockRejected as e:
            unauthenticated = isinstance(e, block_file.BlockUnauthenticated)
            results.append((REJECTED, (str(e), e.inode, unauthenticated)))
        except OSError as e:
            results.append((FAILED, str(e)))
        else:
            eviction.touch(path)  # here, not in the engine core: one system call fewer there
            results.append((OK, None))
    return results


def _serve(conn, fd: int, offset: int, length: int, row_bytes: int) -> None:
    """A reader process: map the region of file `fd`, then read chunks until told to stop."""
    from minipic.connector.scheduler.prefault import prefault

    page = mmap.ALLOCATIONGRANULARITY
    start = offset - offset % page
    try:
        mapping = mmap.mmap(fd, length + offset - start, offset=start)
    finally:
        os.close(fd)
    view = memoryview(mapping)[offset - start:]
    mapped_rows = bytearray(length // row_bytes)
    try:
        secret = conn.recv()  # first message: the store secret (None without one)
    except EOFError:
        return
    while True:
        try:
            requests = conn.recv()
        except EOFError:  # the engine core is gone
            return
        if requests is None:
            return
        for *_, row in requests:
            if not mapped_rows[row]:  # a read into unmapped pages faults page by page
                prefault(view[row * row_bytes:(row + 1) * row_bytes])
                mapped_rows[row] = 1
        conn.send(read_chunk(view, row_bytes, requests, secret))


class ReaderProcesses:
    """`count` reader processes over one mapped region; `read` is called from many threads.

    Started as `python -m` this module rather than through multiprocessing: a spawned
    child would re-import the user's main script (often vLLM and torch, seconds and
    hundreds of MB each), and the engine core has threads, so it must not fork.
    """

    def __init__(self, region: MappedRegion, row_bytes: int, count: int,
                 reply_timeout_s: float = REPLY_TIMEOUT_S, secret: bytes | None = None):
        self._processes: list[tuple[subprocess.Popen, Connection]] = []
        self._reply_timeout_s = reply_timeout_s
        self._idle: queue.SimpleQueue[Connection] = queue.SimpleQueue()
        self.broken = False
        # The readers import minipic from where this process did (a checkout on sys.path
        # alone is not inherited).
        package_root = str(Path(__file__).resolve().parents[3])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
        region_fd = os.open(region.path, os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(count):
                self._start_one(region, region_fd, row_bytes, env, secret)
        except BaseException:
            self.close()  # the readers that did start
            raise
        finally:
            os.close(region_fd)

    def _start_one(self, region: MappedRegion, region_fd: int, row_bytes: int, env: dict,
                   secret: bytes | None) -> None:
        ours, theirs = socket.socketpair()
        with ours, theirs:
            process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno()), str(region_fd),
                 str(region.offset), str(region.length), str(row_bytes)],
                pass_fds=[theirs.fileno(), region_fd], stdin=subprocess.DEVNULL, env=env)
            conn = Connection(os.dup(ours.fileno()))
        self._processes.append((process, conn))
        conn.send(secret)  # over the socket: never in argv or the environment
        self._idle.put(conn)

    @property
    def count(self) -> int:
        return len(self._processes)

    def read(self, requests: list[tuple[str, bytes, bytes, int]]) -> list[tuple[str, object]]:
        """Blocks until an idle reader has read the chunk. Raises if the reader died, gave
        no answer in time or was interrupted (`broken` then tells the tier to stop sending
        chunks to readers)."""
        conn = self._idle.get()
        try:
            conn.send(requests)
            if not conn.poll(self._reply_timeout_s):
                raise TimeoutError(f"a reader process gave no answer in "
                                   f"{self._reply_timeout_s:.0f} s")
            return conn.recv()
        except BaseException:
            self.broken = True
            self._retire(conn)
            raise
        finally:
            self._idle.put(conn)  # a retired one fails its next user at once instead of hanging it

    def _retire(self, conn: Connection) -> None:
        """Never use this reader again: its late reply must not be read as a later chunk's,
        and a stuck one must not hold its rows or its file handles."""
        conn.close()
        for process, c in self._processes:
            if c is conn and process.poll() is None:
                process.kill()

    def close(self) -> None:
        for _, conn in self._processes:
            try:
                conn.send(None)
            except OSError:
                pass
        for process, conn in self._processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
            conn.close()


if __name__ == "__main__":
    conn_fd, region_fd, offset, length, row = (int(arg) for arg in sys.argv[1:6])
    _serve(Connection(conn_fd), region_fd, offset, length, row)
