"""Which configuration a span store was written by, and where its files live.

A block file is only meaningful to an engine whose KV bytes have the same
meaning: same model weights, dtype, block size, KV memory layout, K stored
in its span's frame, same span markers (they steer the hashes) and same minipic
format. All of that goes into a namespace; its digest names the directory, so
two configurations never even see each other's files, and it is written into
every block header, so a file copied into the wrong directory is still caught.

Layout under a store root (shared by replicas, possibly by several models):

    <root>/minipic-store.json                  marks the root as a minipic store
    <root>/.evict.lock, <root>/.removals       one evictor at a time; grows when blocks go
    <root>/ns-<digest>/namespace.json          the fields below, in full
    <root>/ns-<digest>/blocks/ab/cd/<hash>_g<group>.kv
    <root>/ns-<digest>/stats/<process>.json    per-process counters (CLI sums them)

vLLM's own FS tier writes `<root>/<model>_<digest>/config.json` and raw `.bin`
files with no header: neither layout can be mistaken for the other.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

from minipic.connector.store.regular_files import read_regular

STORE_FORMAT = "minipic-span-store"
# Bump when the block file format or the meaning of stored KV bytes changes
# (e.g. the position-free backend changes its cache layout). 2: block files with a
# MAC field (block_file.VERSION 2). 3: K stored rotated in its frame (a span's keys
# relative to the span's start), not unrotated. Stores of other versions sit in other
# folders, unread; `minipic store verify` names their version.
FORMAT_VERSION = 3
ROOT_MARKER = "minipic-store.json"
NAMESPACE_FILE = "namespace.json"
BLOCK_SUFFIX = ".kv"
MAX_JSON_BYTES = 1 << 20  # namespace.json and the root marker are a few hundred bytes
_DIGEST_HEX = 32  # 128 bits: collisions between configurations are not a concern
_NAMESPACE_DIRNAME = re.compile(f"ns-[0-9a-f]{{{_DIGEST_HEX}}}")


def canonical_json(fields: Mapping[str, Any]) -> str:
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)


@dataclasses.dataclass(frozen=True)
class StoreNamespace:
    """The identity of the KV bytes an engine writes; see the module docstring."""

    fields: Mapping[str, Any]

    @property
    def digest(self) -> bytes:
        return hashlib.sha256(canonical_json(self.fields).encode()).digest()[: _DIGEST_HEX // 2]

    @property
    def dirname(self) -> str:
        return f"ns-{self.digest.hex()}"


def namespace_fields(*, model: str, model_fingerprint: str, dtype: str, block_size: int,
                     kv_layout: Mapping[str, Any], hash_algo: str,
                     span_protocol: Mapping[str, int]) -> dict[str, Any]:
    """Everything that changes the meaning of a stored block's bytes (the disk
    tier adds `payload_bytes`, the size of one stored row, when it opens)."""
    return {
        "format": STORE_FORMAT,
        "format_version": FORMAT_VERSION,
        # K rotated in its frame (attention/span_layout.py, SpanLayout.frame_offset)
        "k_format": "rotated in span frames",
        # Tokens after EPIC links stand where the plain prompt puts them (SpanLayout):
        # their KV differs from stores written when links took room.
        "link_positions": "links take no room",
        "model": model,
        "model_fingerprint": model_fingerprint,
        "dtype": dtype,
        "block_size": block_size,
        "kv_layout": dict(kv_layout),
        "hash_algo": hash_algo,
        "span_protocol": dict(span_protocol),
    }


class NamespaceMismatch(RuntimeError):
    """A namespace directory holds a manifest for a different configuration."""


def _write_json_atomically(path: Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from a small regular file; None for anything else (never blocks)."""
    try:
        data = json.loads(read_regular(path, MAX_JSON_BYTES))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_store_root(root: Path) -> bool:
    marker = _read_json(Path(root) / ROOT_MARKER)
    return bool(marker) and marker.get("format") == STORE_FORMAT


def open_namespace(root: str | os.PathLike, namespace: StoreNamespace) -> Path:
    """Create (or join) the namespace directory; returns it.

    Safe for many processes at once: manifests are written atomically and an
    existing one must agree with ours. Raises OSError when the root cannot be
    created (read-only, permissions): the caller decides to run without disk.
    """
    root = Path(root)
    ns_dir = root / namespace.dirname
    if not is_store_root(root):
        root.mkdir(parents=True, exist_ok=True)
        _write_json_atomically(root / ROOT_MARKER,
                               {"format": STORE_FORMAT, "format_version": FORMAT_VERSION})
    existing = _read_json(ns_dir / NAMESPACE_FILE)
    if existing is None:
        (ns_dir / "blocks").mkdir(parents=True, exist_ok=True)
        _write_json_atomically(ns_dir / NAMESPACE_FILE, dict(namespace.fields))
    elif canonical_json(existing) != canonical_json(namespace.fields):
        raise NamespaceMismatch(
            f"{ns_dir / NAMESPACE_FILE} describes another configuration; refusing to use it")
    return ns_dir


def block_path(ns_dir: Path, block_hash: bytes, group_idx: int) -> str:
    """Two levels of 256-way fan-out keep directories small at millions of blocks."""
    h = block_hash.hex()
    return f"{ns_dir}/blocks/{h[:2]}/{h[2:4]}/{h}_g{group_idx}{BLOCK_SUFFIX}"


def block_key(block_hash: bytes, group_idx: int) -> bytes:
    """The key a block file's header holds: vLLM's OffloadKey of (hash, group), which
    the disk tier writes (vLLM 0.25.1 and 0.32.0 pack it this way; a test checks)."""
    return block_hash + group_idx.to_bytes(4, "big", signed=False)


def block_key_of_path(path: str) -> tuple[bytes, int] | None:
    """(block_hash, group_idx) of a `block_path` name; None for any other name."""
    name = os.path.basename(path)
    if not name.endswith(BLOCK_SUFFIX):
        return None
    digest, _, group = name[:-len(BLOCK_SUFFIX)].rpartition("_g")
    try:
        return bytes.fromhex(digest), int(group)
    except ValueError:
        return None


def is_other_version(fields: Mapping[str, Any] | None) -> bool:
    """A namespace of another minipic version's store format (engines of this one skip it)."""
    return bool(fields) and fields.get("format") == STORE_FORMAT \
        and isinstance(fields.get("format_version"), int) \
        and fields["format_version"] != FORMAT_VERSION


def namespace_problem(ns_dir: Path, fields: Mapping[str, Any] | None) -> str | None:
    """Why no engine of this minipic loads from `ns_dir`, or None if one may: the folder
    must be named after its namespace.json (an engine refuses a folder whose manifest
    describes another configuration) and be of this minipic's format."""
    if fields is None:
        return f"no readable {NAMESPACE_FILE}"
    if fields.get("format") != STORE_FORMAT or not isinstance(fields.get("format_version"), int):
        return f"{NAMESPACE_FILE} is not a minipic namespace's"
    if is_other_version(fields):
        return (f"store format version {fields['format_version']} (another minipic "
                f"version's); this minipic reads version {FORMAT_VERSION}")
    if StoreNamespace(fields).dirname != Path(ns_dir).name:
        return f"{NAMESPACE_FILE} does not match the folder's name (copied or edited)"
    return None


def namespace_dirs(root: str | os.PathLike) -> list[Path]:
    """The folders under `root` named like namespaces (ns-<32 hex digits>)."""
    return sorted(d for d in Path(root).glob("ns-*")
                  if _NAMESPACE_DIRNAME.fullmatch(d.name) and d.is_dir())


def list_namespaces(root: str | os.PathLike) -> list[tuple[Path, dict[str, Any] | None]]:
    return [(d, _read_json(d / NAMESPACE_FILE)) for d in namespace_dirs(root)]
