"""One KV block on disk: a self-checking header followed by the raw bytes.

    magic | version | flags | key_len | namespace digest | key | payload_len |
    blake3(payload) | crc32(header) | payload

Writers put the whole file under a unique temporary name in the target
directory and `os.replace` it into place, so a reader sees either no file or a
complete one, never a torn one; two replicas writing the same block just
replace identical bytes. Readers read straight into the destination buffer and
verify everything before reporting success: a truncated, corrupted or foreign
file raises `BlockRejected` and its bytes are never used.
"""

from __future__ import annotations

import errno
import os
import struct
import zlib

import blake3  # a vLLM dependency on every platform; multi-GB/s, releases the GIL

MAGIC = b"MPICKV\x00\x00"
VERSION = 1
FLAG_SPAN_HEAD = 1  # first block of a span (starts with SSep); counted by `minipic store stats`
MAX_KEY_LEN = 64
DIGEST_LEN = 16
_BODY = struct.Struct(f"<8sHHHH16s{MAX_KEY_LEN}sQ{DIGEST_LEN}s")
_CRC = struct.Struct("<I")
HEADER_LEN = 128
_PAD = HEADER_LEN - _BODY.size - _CRC.size
assert _PAD >= 0

# Errors that mean "this store cannot take writes now", not "this block is bad".
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


class BlockRejected(Exception):
    """A block file exists but must not be loaded (reason in the message).

    `inode` names the rejected file, so the caller removes exactly that one
    and not a good copy another replica has renamed into place meanwhile."""

    inode: int | None = None


def payload_digest(payload) -> bytes:
    return blake3.blake3(payload).digest(DIGEST_LEN)


def encode_header(namespace: bytes, key: bytes, payload, flags: int = 0) -> bytes:
    if len(key) > MAX_KEY_LEN:
        raise ValueError(f"key of {len(key)} bytes exceeds {MAX_KEY_LEN}")
    body = _BODY.pack(MAGIC, VERSION, flags, len(key), 0, namespace, key,
                      len(payload), payload_digest(payload))
    return body + _CRC.pack(zlib.crc32(body)) + bytes(_PAD)


def decode_header(header: bytes) -> dict:
    """Fields of a header; raises BlockRejected if it is not one of ours."""
    if len(header) < HEADER_LEN:
        raise BlockRejected("truncated header")
    body = header[: _BODY.size]
    (crc,) = _CRC.unpack_from(header, _BODY.size)
    magic, version, flags, key_len, _, namespace, key, length, digest = _BODY.unpack(body)
    if magic != MAGIC:
        raise BlockRejected("not a minipic block file")
    if zlib.crc32(body) != crc:
        raise BlockRejected("header checksum mismatch")
    if version != VERSION:
        raise BlockRejected(f"block format version {version}, expected {VERSION}")
    return {"flags": flags, "namespace": namespace, "key": key[:key_len],
            "payload_len": length, "digest": digest}


def _tmp_path(path: str) -> str:
    # Unique per writer: replicas and threads never share a temporary file.
    return f"{path}.{os.getpid()}.{os.urandom(6).hex()}.tmp"


def write_block(path: str, namespace: bytes, key: bytes, payload, flags: int = 0) -> None:
    """Atomically create `path` with header + payload. OSError propagates."""
    header = encode_header(namespace, key, payload, flags)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = _tmp_path(path)
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        try:
            expected = HEADER_LEN + len(payload)
            written = os.writev(fd, [header, payload])
            if written != expected:  # regular files only short-write when the disk fills
                raise OSError(errno.ENOSPC, f"short write: {written} of {expected} bytes")
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_block_into(path: str, namespace: bytes, key: bytes, dest: memoryview) -> None:
    """Fill `dest` (exactly one block) from `path` after verifying it.

    Raises FileNotFoundError if the block is gone (evicted), BlockRejected
    (with the file's inode) if it is not a valid block for (namespace, key,
    len(dest)); `dest` then holds garbage that the caller must not use.

    Three system calls and one hash: loads run on threads that need the GIL
    back after each call, so the size is checked by the read itself (one
    byte past the payload must not exist) instead of an fstat.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            _read_verified(fd, namespace, key, dest)
        except BlockRejected as e:
            e.inode = os.fstat(fd).st_ino
            raise
    finally:
        os.close(fd)


def _read_verified(fd: int, namespace: bytes, key: bytes, dest: memoryview) -> None:
    header, beyond = bytearray(HEADER_LEN), bytearray(1)
    buffers, expected = [header, dest, beyond], HEADER_LEN + len(dest)
    got = os.readv(fd, buffers)
    if got < expected and os.fstat(fd).st_size > got:
        got = _read_rest(fd, buffers, got)  # a short read (FUSE, network file systems)
    if got > expected:
        raise BlockRejected(f"file longer than the {expected} bytes expected")
    if got < expected:
        raise BlockRejected(f"size {got}, expected {expected}")
    fields = decode_header(bytes(header))
    if fields["namespace"] != namespace:
        raise BlockRejected("written by another configuration (namespace mismatch)")
    if fields["key"] != key:
        raise BlockRejected("holds another block (key mismatch)")
    if fields["payload_len"] != len(dest):
        raise BlockRejected("payload length mismatch")
    if payload_digest(dest) != fields["digest"]:
        raise BlockRejected("payload checksum mismatch")


def _read_rest(fd: int, buffers: list, done: int) -> int:
    """Continue a readv that returned early, until the buffers are full or the file ends."""
    views = [memoryview(b).cast("B") for b in buffers]
    while True:
        rest, skip = [], done
        for view in views:
            rest.append(view[min(skip, len(view)):])
            skip = max(0, skip - len(view))
        rest = [view for view in rest if len(view)]
        got = os.readv(fd, rest) if rest else 0
        if got == 0:
            return done
        done += got


def read_header(path: str) -> dict:
    """Header fields plus file size, for inspection tools."""
    with open(path, "rb") as f:
        fields = decode_header(f.read(HEADER_LEN))
        fields["file_size"] = os.fstat(f.fileno()).st_size
    return fields


def verify_file(path: str) -> dict:
    """Full check of a file on its own (no expected key): header, size, checksum."""
    with open(path, "rb") as f:
        data = f.read()
    fields = decode_header(data[:HEADER_LEN])
    payload = memoryview(data)[HEADER_LEN:]
    if len(payload) != fields["payload_len"]:
        raise BlockRejected(f"payload is {len(payload)} bytes, header says {fields['payload_len']}")
    if payload_digest(payload) != fields["digest"]:
        raise BlockRejected("payload checksum mismatch")
    fields["file_size"] = len(data)
    return fields
