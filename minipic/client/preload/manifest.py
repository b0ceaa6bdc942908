"""The preload manifest: document id -> its spans' token ids, as one Parquet file.

One row per span, in document order:

    doc_id  source  span_index  span_count  span_key  num_tokens  token_ids
    status  cached_tokens  error

`token_ids` is the exact span ([SSep] + text + padding; cut by the server's own
tokenizer when `minipic-preload --url` preloads through it), so a client builds
final prompts that hit without re-tokenizing (`Manifest.spans_of`). The
file's schema metadata records what the spans are only valid for: model,
block size, span size and span protocol. `status` says what the run that wrote
it saw: new (prefilled, was missing), stored (was already stored), prefilled
(the server did not say which), failed, pending (the run stopped first).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from minipic.protocol import SpanProtocol

FORMAT = "minipic-span-manifest"
VERSION = 1
_META_KEY = b"minipic"

NEW, STORED, PREFILLED, FAILED, PENDING = "new", "stored", "prefilled", "failed", "pending"
STATUSES = (NEW, STORED, PREFILLED, FAILED, PENDING)

SCHEMA = pa.schema([
    ("doc_id", pa.string()),
    ("source", pa.string()),
    ("span_index", pa.int32()),
    ("span_count", pa.int32()),
    ("span_key", pa.string()),
    ("num_tokens", pa.int32()),
    ("token_ids", pa.list_(pa.int32())),
    ("status", pa.string()),
    ("cached_tokens", pa.int32()),
    ("error", pa.string()),
])


class ManifestError(ValueError):
    """The file is not a minipic manifest, or does not fit this use."""


@dataclasses.dataclass(frozen=True)
class ManifestInfo:
    """What the spans are valid for: a client must use the same values."""

    model: str
    block_size: int
    span_tokens: int
    protocol: SpanProtocol

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "version": VERSION, "model": self.model,
                           "block_size": self.block_size, "span_tokens": self.span_tokens,
                           "protocol": self.protocol.to_dict()})

    @classmethod
    def from_json(cls, text: str | bytes) -> "ManifestInfo":
        data = json.loads(text)
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ManifestError(f"unsupported manifest format {data.get('format')!r} "
                                f"version {data.get('version')!r}")
        return cls(data["model"], int(data["block_size"]), int(data["span_tokens"]),
                   SpanProtocol.from_dict(data["protocol"]))


@dataclasses.dataclass(frozen=True)
class SpanRecord:
    doc_id: str
    source: str
    span_index: int
    span_count: int
    span_key: str
    token_ids: Sequence[int]
    status: str = PENDING
    cached_tokens: int | None = None
    error: str | None = None

    def row(self) -> dict[str, Any]:
        row = dataclasses.asdict(self)
        row["token_ids"] = list(self.token_ids)
        row["num_tokens"] = len(self.token_ids)
        return row


def is_manifest_schema(schema: pa.Schema) -> bool:
    return bool(schema.metadata) and _META_KEY in schema.metadata


class Manifest:
    def __init__(self, info: ManifestInfo, records: Iterable[SpanRecord]):
        self.info = info
        self.records = list(records)
        self._by_doc: dict[str, list[SpanRecord]] = {}
        for record in self.records:
            self._by_doc.setdefault(record.doc_id, []).append(record)

    def doc_ids(self) -> list[str]:
        return list(self._by_doc)

    def spans_of(self, doc_id: str) -> list[list[int]]:
        """The document's spans, ready to go into a final prompt, in order."""
        try:
            records = self._by_doc[doc_id]
        except KeyError:
            raise KeyError(f"document {doc_id!r} is not in the manifest") from None
        return [list(r.token_ids) for r in sorted(records, key=lambda r: r.span_index)]

    def keys_with_status(self, *statuses: str) -> set[str]:
        return {r.span_key for r in self.records if r.status in statuses}

    def write(self, path: str | os.PathLike) -> None:
        """Atomically and durably: a reader, a crash or a power cut never sees half a
        manifest (the new file is on disk before it replaces the old one)."""
        schema = SCHEMA.with_metadata({_META_KEY: self.info.to_json().encode()})
        table = pa.Table.from_pylist([r.row() for r in self.records], schema=schema)
        tmp = _tmp_path(path)
        try:
            pq.write_table(table, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()

    @staticmethod
    def check_writable(path: str | os.PathLike) -> None:
        """Raises OSError now if `write(path)` could not create its file: before a long
        run, not after it."""
        tmp = _tmp_path(path)
        tmp.touch()
        tmp.unlink()

    @classmethod
    def read(cls, path: str | os.PathLike) -> "Manifest":
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as e:
            raise ManifestError(f"cannot read manifest {path}: {e}") from e
        if not is_manifest_schema(table.schema):
            raise ManifestError(f"{path} is not a minipic manifest (no {_META_KEY!r} metadata)")
        missing = set(SCHEMA.names) - set(table.schema.names)
        if missing:
            raise ManifestError(f"{path} is a damaged manifest: no {sorted(missing)} columns")
        try:
            info = ManifestInfo.from_json(table.schema.metadata[_META_KEY])
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSON errors included
            raise ManifestError(f"{path} is a damaged manifest: bad metadata ({e!r})") from e
        fields = [f.name for f in dataclasses.fields(SpanRecord)]
        records = [SpanRecord(**{k: row[k] for k in fields}) for row in table.to_pylist()]
        return cls(info, records)


def _tmp_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")
