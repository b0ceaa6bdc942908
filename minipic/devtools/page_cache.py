"""Cold reads for the disk benchmarks: drop a folder's files from the OS page cache, so that
the next reads come from the device. tools/bench_ttft.py (its `cold:T` disk phases, through
minipic.devtools.ttft_phases) and tools/bench_store_read.py (`--cold`) use it."""

from __future__ import annotations

import os


def drop_from_page_cache(store: str) -> int:
    """Make the next reads of the store's files come from the device (needs no privileges:
    clean pages of a file are dropped on request). Returns the number of files."""
    os.sync()  # dirty pages cannot be dropped
    count = 0
    for root, _, files in os.walk(store):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            count += 1
    return count
