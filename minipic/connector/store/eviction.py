"""Keep a store root under a size limit by removing least recently used blocks.

Recency is the file's mtime: writers create files, readers bump the mtime of
every block they load (and writers of a duplicate bump it instead of writing),
so the oldest mtime is the least recently used block across all replicas,
with no shared index to lock. One replica evicts at a time (a non-blocking
`flock`; the others skip their turn), removing files with `unlink`: a reader
that already opened a file keeps reading it, a later reader gets
FileNotFoundError and recomputes. The limit is therefore soft: between scans
each replica may add what it writes.

Whoever removes block files (eviction here, `minipic store verify --remove`, an engine
dropping a file it rejected) then appends a byte to `<root>/.removals`: running engines
watch that file's size and forget which blocks they believed stored (see
`disk_tier.MiniPICDiskTier._watch_store`), so they write them again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import stat
import time
from pathlib import Path
from typing import Iterator

from minipic.connector.store.namespace import block_key_of_path, namespace_dirs

LOCK_FILE = ".evict.lock"
REMOVALS_FILE = ".removals"  # grows by a byte whenever blocks are removed
_REMOVALS_MAX = 1 << 20  # then starts again from empty (a change all the same)
LOW_WATERMARK = 0.9  # evict down to 90% so eviction does not run on every store
TEMP_SUFFIX = ".tmp"  # writers write <file>.<pid>.<random>.tmp, then rename
STALE_TEMP_S = 600.0  # a temp file this old belongs to a writer that died mid-write


@dataclasses.dataclass
class BlockEntry:
    path: str
    size: int
    mtime: float


def _blocks_dirs(root: str | os.PathLike) -> list[Path]:
    """The `blocks/` folders of a store root (every namespace) or of one namespace.
    Nothing else under the root is ever touched: a store_dir may have been pointed at
    a folder that holds other files, some of which may even end in .kv."""
    root = Path(root)
    if (root / "blocks").is_dir():
        return [root / "blocks"]
    return [d / "blocks" for d in namespace_dirs(root) if (d / "blocks").is_dir()]


def _files(root: str | os.PathLike) -> Iterator[tuple[str, str]]:
    for blocks_dir in _blocks_dirs(root):
        for dirpath, _, filenames in os.walk(blocks_dir):
            for name in filenames:
                yield dirpath, name


def iter_blocks(root: str | os.PathLike) -> Iterator[BlockEntry]:
    """Every block file under `root` (all namespaces); vanishing files are skipped."""
    for dirpath, name in _files(root):
        if block_key_of_path(name) is None:
            continue
        path = os.path.join(dirpath, name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        yield BlockEntry(path, st.st_size, st.st_mtime)


def store_bytes(root: str | os.PathLike) -> int:
    return sum(b.size for b in iter_blocks(root))


@contextlib.contextmanager
def _exclusive(root: Path) -> Iterator[bool]:
    """Yields True if this process holds the eviction lock, False if another does."""
    # Never follow a planted link or block on a FIFO in the lock's place.
    flags = os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(root / LOCK_FILE, flags, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{root / LOCK_FILE} is not a regular file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing releases the lock


@dataclasses.dataclass
class EvictionResult:
    ran: bool
    removed_files: int = 0
    removed_bytes: int = 0
    remaining_bytes: int = 0
    removed: list[BlockEntry] = dataclasses.field(default_factory=list)


def evict_lru(root: str | os.PathLike, max_bytes: int,
              low_watermark: float = LOW_WATERMARK) -> EvictionResult:
    """If the blocks under `root` exceed `max_bytes`, remove the oldest down to
    `low_watermark * max_bytes`. Returns what happened (ran=False: another
    process holds the lock)."""
    root = Path(root)
    with _exclusive(root) as mine:
        if not mine:
            return EvictionResult(ran=False)
        remove_stale_temp_files(root)
        blocks = list(iter_blocks(root))
        total = sum(b.size for b in blocks)
        result = EvictionResult(ran=True, remaining_bytes=total)
        if total <= max_bytes:
            return result
        target = int(max_bytes * low_watermark)
        for block in sorted(blocks, key=lambda b: b.mtime):
            if result.remaining_bytes <= target:
                break
            try:
                os.unlink(block.path)
            except FileNotFoundError:
                pass  # another process removed it; it no longer counts either way
            else:
                result.removed_files += 1
                result.removed_bytes += block.size
                result.removed.append(block)
            result.remaining_bytes -= block.size
        if result.removed:
            announce_removals(root)
        return result


def announce_removals(root: str | os.PathLike) -> None:
    """Tell running engines that block files under store `root` were removed; best effort."""
    with contextlib.suppress(OSError):  # a read-only store, or something planted there
        fd = os.open(Path(root) / REMOVALS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT
                     | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            if os.fstat(fd).st_size >= _REMOVALS_MAX:
                os.ftruncate(fd, 0)
            os.write(fd, b"\n")
        finally:
            os.close(fd)


def removals_mark(root: str | os.PathLike) -> tuple[int, int, int] | None:
    """Changes whenever `announce_removals(root)` runs (or the store is wiped)."""
    try:
        st = os.stat(Path(root) / REMOVALS_FILE)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def remove_stale_temp_files(root: str | os.PathLike, max_age_s: float = STALE_TEMP_S) -> int:
    """Delete temp files of killed writers (never renamed, never counted as blocks)."""
    removed, now = 0, time.time()
    for dirpath, name in _files(root):
        if not _is_block_temp(name):
            continue
        path = os.path.join(dirpath, name)
        with contextlib.suppress(OSError):
            if now - os.stat(path).st_mtime > max_age_s:
                os.unlink(path)
                removed += 1
    return removed


def _is_block_temp(name: str) -> bool:
    """<block name>.<pid>.<random>.tmp, as block_file writes them."""
    if not name.endswith(TEMP_SUFFIX):
        return False
    parts = name[:-len(TEMP_SUFFIX)].rsplit(".", 2)
    return len(parts) == 3 and parts[1].isdigit() and block_key_of_path(parts[0]) is not None


def touch(path: str) -> None:
    """Mark a block as recently used; best effort (read-only stores just keep the old order)."""
    with contextlib.suppress(OSError):
        os.utime(path)
