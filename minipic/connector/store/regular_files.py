"""Open a store's files without ever blocking on something that only looks like one.

A store is a shared directory: whoever can write to it can put a FIFO, a device, a
directory or a symbolic link where a file is expected. A plain `open` of a FIFO waits for
a writer (forever), a read of /dev/zero never ends, and opening some devices acts on
them. minipic never writes anything but regular files, so every store file is opened
without following a final symbolic link, without blocking (O_NONBLOCK), and accepted only
if fstat says it is a regular file; callers then read no more than they expect.
"""

from __future__ import annotations

import errno
import os
import stat

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))


class NotARegularFile(OSError):
    """Something other than a regular file sits at a path where a store file belongs."""

    def __init__(self, path: str, kind: str, inode: int):
        super().__init__(errno.EINVAL, f"not a regular file ({kind})", str(path))
        self.kind = kind
        self.inode = inode


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike) -> tuple[int, os.stat_result]:
    """(fd, fstat) of `path` if it is a regular file. Raises NotARegularFile (with the
    entry's inode) for anything else, FileNotFoundError if nothing is there, and
    OSError if it cannot be opened."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        st = os.lstat(path)  # O_NOFOLLOW met a symbolic link (wherever it points)
        raise NotARegularFile(path, _kind(st.st_mode), st.st_ino) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFile(path, _kind(st.st_mode), st.st_ino)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_regular(path: str | os.PathLike, max_bytes: int) -> bytes:
    """The whole content of a small regular file; OSError (NotARegularFile, EFBIG) if it is
    not one or is larger than `max_bytes`."""
    fd, st = open_regular(path)
    try:
        if st.st_size > max_bytes:
            raise OSError(errno.EFBIG, f"larger than {max_bytes} bytes", str(path))
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > max_bytes:  # grew since the fstat
            raise OSError(errno.EFBIG, f"larger than {max_bytes} bytes", str(path))
        return data
    finally:
        os.close(fd)
