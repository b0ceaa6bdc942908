"""Which configuration a span store was written by, and where its files live.

A block file is only meaningful to an engine whose KV bytes have the same
meaning: same model weights, dtype, block size, KV memory layout, K stored
*unrotated*, same span markers (they steer the hashes) and same minipic
format. All of that goes into a namespace; its digest names the directory, so
two configurations never even see each other's files, and it is written into
every block header, so a file copied into the wrong directory is still caught.

Layout under a store root (shared by replicas, possibly by several models):

    <root>/minipic-store.json                  marks the root as a minipic store
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
from pathlib import Path
from typing import Any, Mapping

STORE_FORMAT = "minipic-span-store"
# Bump when the block file format or the meaning of stored KV bytes changes
# (e.g. the position-free backend changes its cache layout).
FORMAT_VERSION = 1
ROOT_MARKER = "minipic-store.json"
NAMESPACE_FILE = "namespace.json"
BLOCK_SUFFIX = ".kv"
_DIGEST_HEX = 32  # 128 bits: collisions between configurations are not a concern


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
        "k_format": "unrotated",  # RoPE is applied inside attention, never stored
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
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


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


def list_namespaces(root: str | os.PathLike) -> list[tuple[Path, dict[str, Any] | None]]:
    root = Path(root)
    return [(d, _read_json(d / NAMESPACE_FILE))
            for d in sorted(root.glob("ns-*")) if d.is_dir()]
