"""Read a corpus directory into documents, reporting bad inputs instead of stopping.

    .txt .md     one document per file; id: the path relative to the corpus root
    .jsonl       one document per line, text in `text_field`; id: path#<id_field value>
                 or path#<line number> (1-based)
    .parquet     one document per row, text in column `text_field`; id: path#<id value>
                 or path#<row number> (1-based)

Directories are walked recursively in sorted order, so ids and order are the
same on every run and machine; hidden files and directories are skipped, other
extensions are counted as ignored. minipic's own manifest (a Parquet file) is
recognised and ignored, so writing it inside the corpus is harmless.
Everything that cannot become a document (not UTF-8, unreadable, empty, a
missing field, a duplicate id) is yielded as a `CorpusProblem` naming where
(path, path:line or path:row N).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Iterator, Union

DOCUMENT_SUFFIXES = (".txt", ".md", ".jsonl", ".parquet")


@dataclasses.dataclass(frozen=True)
class Document:
    doc_id: str
    source: str  # path relative to the corpus root
    text: str


@dataclasses.dataclass(frozen=True)
class CorpusProblem:
    where: str  # a path, path:line or path#row
    reason: str

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


@dataclasses.dataclass(frozen=True)
class IgnoredFile:
    source: str


CorpusItem = Union[Document, CorpusProblem, IgnoredFile]


def iter_corpus(root: str | os.PathLike, *, text_field: str = "text",
                id_field: str | None = None) -> Iterator[CorpusItem]:
    """Documents, problems and ignored files of `root` (a directory or one file)."""
    root = Path(root)
    if not root.exists():
        yield CorpusProblem(str(root), "no such file or directory")
        return
    seen_ids: set[str] = set()
    base = root if root.is_dir() else root.parent
    for path in _walk(root):
        source = path.relative_to(base).as_posix()
        for item in _read_file(path, source, text_field, id_field):
            if isinstance(item, Document):
                if item.doc_id in seen_ids:
                    item = CorpusProblem(item.doc_id, "duplicate document id (later one skipped)")
                else:
                    seen_ids.add(item.doc_id)
            yield item


def _walk(root: Path) -> Iterator[Path]:
    if root.is_file():
        yield root
        return
    visited: set[str] = set()
    # Linked directories are part of the corpus too; each real directory is read once
    # (a link back to an ancestor would otherwise loop).
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in visited:
            dirnames[:] = []
            continue
        visited.add(real)
        # Sorted in place so os.walk descends in a stable order too.
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if not name.startswith("."):
                yield Path(dirpath, name)


def _read_file(path: Path, source: str, text_field: str,
               id_field: str | None) -> Iterator[CorpusItem]:
    suffix = path.suffix.lower()
    if suffix not in DOCUMENT_SUFFIXES:
        yield IgnoredFile(source)
        return
    try:
        if suffix in (".txt", ".md"):
            yield _text_document(path.read_bytes(), source)
        elif suffix == ".jsonl":
            yield from _jsonl_documents(path.read_bytes(), source, text_field, id_field)
        else:
            yield from _parquet_documents(path, source, text_field, id_field)
    except OSError as e:
        yield CorpusProblem(source, f"cannot read: {e.strerror or e}")


def _text_document(data: bytes, source: str) -> CorpusItem:
    try:
        text = data.decode("utf-8-sig")  # tolerate a BOM, nothing else
    except UnicodeDecodeError as e:
        return CorpusProblem(source, f"not UTF-8 ({e.reason} at byte {e.start})")
    return _document(source, source, text, where=source)


def _document(doc_id: str, source: str, text: object, where: str) -> CorpusItem:
    if text is None:
        return CorpusProblem(where, "no text (null)")
    if not isinstance(text, str):
        return CorpusProblem(where, f"text is {type(text).__name__}, not a string")
    if not text.strip():
        return CorpusProblem(where, "empty document")
    return Document(doc_id, source, text)


def _record_id(source: str, record: dict, id_field: str | None, number: int) -> str:
    key = record.get(id_field) if id_field else None
    return f"{source}#{number if key is None else key}"


def _jsonl_documents(data: bytes, source: str, text_field: str,
                     id_field: str | None) -> Iterator[CorpusItem]:
    for number, raw in enumerate(data.splitlines(), start=1):
        where = f"{source}:{number}"
        if not raw.strip():
            continue  # blank lines separate nothing in JSONL; not an error
        try:
            record = json.loads(raw.decode("utf-8-sig" if number == 1 else "utf-8"))
        except UnicodeDecodeError as e:
            yield CorpusProblem(where, f"not UTF-8 ({e.reason} at byte {e.start})")
            continue
        except json.JSONDecodeError as e:
            yield CorpusProblem(where, f"not JSON ({e.msg})")
            continue
        if not isinstance(record, dict) or text_field not in record:
            yield CorpusProblem(where, f"no {text_field!r} field")
            continue
        doc_id = _record_id(source, record, id_field, number)
        yield _document(doc_id, source, record[text_field], where)


def _parquet_documents(path: Path, source: str, text_field: str,
                       id_field: str | None) -> Iterator[CorpusItem]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from minipic.client.preload.manifest import is_manifest_schema

    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, ValueError) as e:
        yield CorpusProblem(source, f"not a readable Parquet file ({e})")
        return
    if is_manifest_schema(schema):
        yield IgnoredFile(source)
        return
    missing = [f for f in (text_field, id_field) if f and f not in schema.names]
    if missing:  # without the id column, ids would silently become row numbers
        yield CorpusProblem(source, f"no {missing[0]!r} column (columns: {schema.names})")
        return
    columns = [text_field] + ([id_field] if id_field else [])
    try:
        table = pq.read_table(path, columns=columns)
    except (pa.ArrowException, ValueError) as e:
        yield CorpusProblem(source, f"not a readable Parquet file ({e})")
        return
    for number, record in enumerate(table.to_pylist(), start=1):
        doc_id = _record_id(source, record, id_field, number)
        yield _document(doc_id, source, record[text_field], f"{source}:row {number}")
