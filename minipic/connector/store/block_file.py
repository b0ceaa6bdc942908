"""One KV block on disk: a self-checking header followed by the raw bytes.

    magic | version | flags | key_len | namespace digest | key | payload_len |
    blake3(payload) | mac | crc32(header) | padding | payload

Writers put the whole file under a unique temporary name in the target
directory and `os.replace` it into place, so a reader sees either no file or a
complete one, never a torn one; two replicas writing the same block just
replace identical bytes. Readers open without blocking, accept regular files
only, read no more than the block they expect, straight into the destination
buffer, and verify everything before reporting success: a truncated,
corrupted, foreign or unauthenticated file raises `BlockRejected` and its
bytes are never used.

With a store secret (see `secret.py`) every header carries HMAC-SHA256(secret,
header fields), and the fields include the payload's 256-bit BLAKE3 digest: a
reader with the secret accepts no block that someone without it has written.
Without a secret the MAC field is zero and not read.

`check_header` is the one check of a header against what the reader expects
(namespace, key, size, MAC); engine loads (`read_block_into`) and
`minipic store verify` (`verify_block`, streaming) both go through it.
"""

from __future__ import annotations

import dataclasses
import errno
import hmac
import os
import struct
import zlib

import blake3  # a vLLM dependency on every platform; multi-GB/s, releases the GIL

from minipic.connector.store.regular_files import NotARegularFile, open_regular

MAGIC = b"MPICKV\x00\x00"
# 2: 192-byte header with a 256-bit payload digest and a MAC field. Version 1 files
# (128-byte header, no MAC) are refused by name.
VERSION = 2
FLAG_SPAN_HEAD = 1  # first block of a span (starts with SSep); counted by `minipic store stats`
FLAG_AUTHENTICATED = 2  # the MAC field holds HMAC-SHA256(store secret, header body)
MAX_KEY_LEN = 64
DIGEST_LEN = 32
MAC_LEN = 32
_PREFIX = struct.Struct("<8sH")  # magic, version: the same place in every version
_BODY = struct.Struct(f"<8sHHHH16s{MAX_KEY_LEN}sQ{DIGEST_LEN}s")  # what the MAC covers
_MAC_CRC = struct.Struct(f"<{MAC_LEN}sI")
HEADER_LEN = 192
_PAD = HEADER_LEN - _BODY.size - _MAC_CRC.size
assert _PAD >= 0
_STREAM_CHUNK = 1 << 20  # verify_block hashes payloads in pieces this large

# Errors that mean "this store cannot take writes now", not "this block is bad".
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


class BlockRejected(Exception):
    """A block file exists but must not be loaded (reason in the message).

    `inode` names the rejected file, so the caller removes exactly that one
    and not a good copy another replica has renamed into place meanwhile."""

    inode: int | None = None


class BlockUnauthenticated(BlockRejected):
    """The reader has the store secret and the file's MAC is missing or wrong."""


@dataclasses.dataclass(frozen=True)
class Expected:
    """What a reader expects of a block file (a load knows all of it; so does verify)."""

    namespace: bytes
    key: bytes
    payload_len: int
    secret: bytes | None = None


def payload_digest(payload) -> bytes:
    return blake3.blake3(payload).digest(DIGEST_LEN)


def _mac(secret: bytes, body: bytes) -> bytes:
    return hmac.digest(secret, body, "sha256")


def encode_header(namespace: bytes, key: bytes, payload, flags: int = 0,
                  secret: bytes | None = None) -> bytes:
    """The header of a block file; authenticated when `secret` is given."""
    if len(key) > MAX_KEY_LEN:
        raise ValueError(f"key of {len(key)} bytes exceeds {MAX_KEY_LEN}")
    flags = (flags | FLAG_AUTHENTICATED) if secret else (flags & ~FLAG_AUTHENTICATED)
    body = _BODY.pack(MAGIC, VERSION, flags, len(key), 0, namespace, key, len(payload),
                      payload_digest(payload))
    mac = _mac(secret, body) if secret else bytes(MAC_LEN)
    return body + _MAC_CRC.pack(mac, zlib.crc32(body + mac)) + bytes(_PAD)


def decode_header(header: bytes) -> dict:
    """Fields of a header; raises BlockRejected if it is not one of ours."""
    if len(header) < _PREFIX.size:
        raise BlockRejected("truncated header")
    magic, version = _PREFIX.unpack_from(header)
    if magic != MAGIC:
        raise BlockRejected("not a minipic block file")
    if version != VERSION:
        raise BlockRejected(f"block format version {version} (another minipic version's), "
                            f"expected {VERSION}")
    if len(header) < HEADER_LEN:
        raise BlockRejected("truncated header")
    body = header[: _BODY.size]
    mac, crc = _MAC_CRC.unpack_from(header, _BODY.size)
    if zlib.crc32(body + mac) != crc:
        raise BlockRejected("header checksum mismatch")
    _, _, flags, key_len, _, namespace, key, length, digest = _BODY.unpack(body)
    return {"flags": flags, "namespace": namespace, "key": key[:key_len],
            "payload_len": length, "digest": digest, "mac": mac, "body": bytes(body)}


def check_header(header: bytes, expected: Expected) -> dict:
    """Decode `header` and check it against what the reader expects: everything but the
    payload digest, which the caller compares once it has hashed the payload."""
    fields = decode_header(header)
    if fields["namespace"] != expected.namespace:
        raise BlockRejected("written by another configuration (namespace mismatch)")
    if fields["key"] != expected.key:
        raise BlockRejected("holds another block (key mismatch)")
    if fields["payload_len"] != expected.payload_len:
        raise BlockRejected("payload length mismatch")
    if expected.secret:
        if not fields["flags"] & FLAG_AUTHENTICATED:
            raise BlockUnauthenticated("not authenticated (written without the store secret)")
        if not hmac.compare_digest(fields["mac"], _mac(expected.secret, fields["body"])):
            raise BlockUnauthenticated("authentication failed (written with another store "
                                       "secret, or forged)")
    return fields


def _tmp_path(path: str) -> str:
    # Unique per writer: replicas and threads never share a temporary file.
    return f"{path}.{os.getpid()}.{os.urandom(6).hex()}.tmp"


def write_block(path: str, namespace: bytes, key: bytes, payload, flags: int = 0,
                secret: bytes | None = None) -> None:
    """Atomically create `path` with header + payload. OSError propagates."""
    header = encode_header(namespace, key, payload, flags, secret)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = _tmp_path(path)
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644)
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


def _open_block(path: str, expected_size: int) -> tuple[int, os.stat_result]:
    """A block file's fd once it is known to be a regular file of `expected_size` bytes."""
    try:
        fd, st = open_regular(path)
    except NotARegularFile as e:
        rejected = BlockRejected(e.strerror)
        rejected.inode = e.inode
        raise rejected from None
    if st.st_size != expected_size:
        try:
            _reject_size(fd, st.st_size, expected_size)
        except BlockRejected as e:
            e.inode = st.st_ino
            raise
        finally:
            os.close(fd)
    return fd, st


def _reject_size(fd: int, size: int, expected: int) -> None:
    # Another format version's file is named as such, not as "the wrong size".
    decode_header(os.pread(fd, min(size, HEADER_LEN), 0))
    if size > expected:
        raise BlockRejected(f"file longer than the {expected} bytes expected")
    raise BlockRejected(f"size {size}, expected {expected}")


def read_block_into(path: str, namespace: bytes, key: bytes, dest: memoryview,
                    secret: bytes | None = None) -> None:
    """Fill `dest` (exactly one block) from `path` after verifying it.

    Raises FileNotFoundError if the block is gone (evicted), BlockRejected
    (with the file's inode) if it is not a valid block for (namespace, key,
    len(dest)) or, with `secret`, not authenticated by it; `dest` then holds
    garbage that the caller must not use. Reads only a regular file of the
    expected size, and no more than that size.
    """
    expected = Expected(namespace, key, len(dest), secret)
    fd, st = _open_block(path, HEADER_LEN + len(dest))
    try:
        header = bytearray(HEADER_LEN)
        got = _read_full(fd, [header, dest])
        if got < HEADER_LEN + len(dest):  # shrank since the fstat: not a file we wrote
            raise BlockRejected(f"size {got}, expected {HEADER_LEN + len(dest)}")
        fields = check_header(bytes(header), expected)
        if payload_digest(dest) != fields["digest"]:
            raise BlockRejected("payload checksum mismatch")
    except BlockRejected as e:
        e.inode = st.st_ino
        raise
    finally:
        os.close(fd)


def _read_full(fd: int, buffers: list) -> int:
    """readv until the buffers are full or the file ends (readv may return early on FUSE
    and network file systems); returns the bytes read."""
    views = [memoryview(b).cast("B") for b in buffers]
    done = 0
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


def verify_block(path: str, expected: Expected) -> dict:
    """What `read_block_into` checks, for `minipic store verify`: the payload is hashed in
    pieces, so memory stays bounded whatever the file claims. Returns the header fields."""
    fd, st = _open_block(path, HEADER_LEN + expected.payload_len)
    try:
        header = bytearray(HEADER_LEN)
        if _read_full(fd, [header]) < HEADER_LEN:
            raise BlockRejected("truncated header")
        fields = check_header(bytes(header), expected)
        hasher, left = blake3.blake3(), expected.payload_len
        chunk = bytearray(min(_STREAM_CHUNK, max(left, 1)))
        while left:
            view = memoryview(chunk)[:min(left, len(chunk))]
            got = _read_full(fd, [view])
            if got == 0:  # shrank since the fstat: not a file we wrote
                raise BlockRejected(f"size {st.st_size - left}, expected {st.st_size}")
            hasher.update(view[:got])
            left -= got
        if hasher.digest(DIGEST_LEN) != fields["digest"]:
            raise BlockRejected("payload checksum mismatch")
        fields["file_size"] = st.st_size
        return fields
    except BlockRejected as e:
        e.inode = st.st_ino
        raise
    finally:
        os.close(fd)


def read_header(path: str) -> dict:
    """Header fields plus file size, for inspection tools (nothing checked against a
    namespace or key)."""
    try:
        fd, st = open_regular(path)
    except NotARegularFile as e:
        raise BlockRejected(e.strerror) from None
    try:
        fields = decode_header(os.pread(fd, HEADER_LEN, 0))
        fields["file_size"] = st.st_size
        return fields
    finally:
        os.close(fd)
