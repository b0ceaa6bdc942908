"""Whether a store lives on a local disk, where checking that a file exists is quick.

The scheduler thread checks block files itself only there (see the disk tier's
lookups): on a network or FUSE mount one `stat` can take seconds, or hang with
the server, and the engine must not wait for it.
"""

from __future__ import annotations

import os

import psutil

# Kernel file systems on the machine's own storage or memory. Anything else (nfs,
# cifs, ceph, lustre, fuse.*, 9p, ...) or an unknown type counts as remote.
LOCAL_FILE_SYSTEMS = frozenset({
    "ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "bcachefs", "jfs", "reiserfs",
    "tmpfs", "ramfs", "overlay"})


def file_system_of(path: str | os.PathLike) -> str | None:
    """The type of the mount holding `path`: the longest mount point above it, the last
    listed of equal ones (a later mount on the same point hides the earlier)."""
    real = os.path.realpath(path)
    best_mount, best_type = "", None
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint
        inside = real == mount or real.startswith(mount.rstrip(os.sep) + os.sep)
        if inside and len(mount) >= len(best_mount):
            best_mount, best_type = mount, part.fstype
    return best_type


def is_local_disk(path: str | os.PathLike) -> bool:
    try:
        return file_system_of(path) in LOCAL_FILE_SYSTEMS
    except Exception:  # no mount table (a sandbox): treat as remote, the safe side
        return False
