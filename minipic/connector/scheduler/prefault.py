"""Map the CPU tier's pages into this process before the first disk load.

The CPU tier is one shared-memory file: the worker pins it for DMA, while the
scheduler process, where the disk tier's threads run, maps it afresh. Its page
table starts empty, so the first write into every 4 KiB page takes a page
fault, and block reads into a fresh mapping ran 3-6x slower than into a mapped
one (measured on the CPU machine: 1.2-3.8 GiB/s vs 7.4-11.6 GiB/s, 2 MiB
blocks). A disk load after a restart writes into pages nobody in this process
touched yet, so without this step every restart paid the faults on its first
loads. One madvise call at start-up maps them all (about 0.2 s per GiB there).
On the H200 host, loads were no faster with it (measured 2026-11-30, commit 07a1689):
another limit dominates there; the step stays because it removes this one.
"""

from __future__ import annotations

import ctypes
import errno
import logging

import numpy as np

logger = logging.getLogger("vllm.minipic.connector")  # shares vLLM's handlers

MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in, writable, without changing them
PAGE = 4096


def buffer_address(view: memoryview) -> int:
    """Address of the view's first byte (holds no export of it afterwards)."""
    array = np.frombuffer(view, dtype=np.uint8)
    try:
        return array.ctypes.data
    finally:
        del array


def prefault(view: memoryview) -> str:
    """Map every page of `view` (a writable buffer); returns how it was done."""
    array = np.frombuffer(view, dtype=np.uint8)
    try:
        if _madvise_populate(array.ctypes.data, array.nbytes):
            return "madvise"
        # Older kernels: a read of one byte per page maps it too (shared memory
        # pages are mapped writable on a read fault: there is no dirty tracking).
        int(array[::PAGE].sum())
        return "touched"
    finally:
        del array  # holds an export of the view: the tier must be able to release it


def _madvise_populate(address: int, length: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    start = address - address % PAGE
    result = libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length + address - start),
                          MADV_POPULATE_WRITE)
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err != errno.EINVAL:  # EINVAL: kernel without MADV_POPULATE_WRITE
        logger.debug("madvise(MADV_POPULATE_WRITE) failed: %s", errno.errorcode.get(err, err))
    return False
