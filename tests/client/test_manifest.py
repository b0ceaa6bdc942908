"""The preload manifest: round trip, lookup by document, metadata checks."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from minipic.client.preload.corpus import IgnoredFile, iter_corpus
from minipic.client.preload.manifest import (
    NEW, STORED, Manifest, ManifestError, ManifestInfo, SpanRecord,
)
from minipic.protocol import SpanProtocol

INFO = ManifestInfo("tiny", 32, 512, SpanProtocol(3, 4, 5))


def records():
    return [SpanRecord("b.md", "b.md", 1, 2, "k2", [3, 12, 5], STORED, 3),
            SpanRecord("b.md", "b.md", 0, 2, "k1", [3, 11, 5], NEW, 0),
            SpanRecord("a.txt", "a.txt", 0, 1, "k0", [3, 10, 5], "failed", None, "boom")]


def test_round_trip(tmp_path):
    path = tmp_path / "m.parquet"
    Manifest(INFO, records()).write(path)
    back = Manifest.read(path)
    assert back.info == INFO
    assert back.records == records()
    assert back.doc_ids() == ["b.md", "a.txt"]
    assert back.spans_of("b.md") == [[3, 11, 5], [3, 12, 5]]  # by span index
    assert back.keys_with_status(NEW, STORED) == {"k1", "k2"}
    assert pq.read_table(path).column("num_tokens").to_pylist() == [3, 3, 3]


def test_unknown_document(tmp_path):
    with pytest.raises(KeyError, match="nope"):
        Manifest(INFO, records()).spans_of("nope")


def test_a_plain_parquet_file_is_not_a_manifest(tmp_path):
    import pyarrow as pa

    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "plain.parquet")
    with pytest.raises(ManifestError, match="not a minipic manifest"):
        Manifest.read(tmp_path / "plain.parquet")


def test_the_corpus_reader_skips_a_manifest_written_inside_the_corpus(tmp_path):
    Manifest(INFO, records()).write(tmp_path / "m.parquet")
    assert list(iter_corpus(tmp_path)) == [IgnoredFile("m.parquet")]


@pytest.mark.parametrize("damage", ["metadata", "columns"])
def test_a_damaged_manifest_is_a_manifest_error(tmp_path, damage):
    path = tmp_path / "m.parquet"
    Manifest(INFO, records()).write(path)
    table = pq.read_table(path)
    if damage == "metadata":  # JSON cut short
        table = table.replace_schema_metadata({b"minipic": table.schema.metadata[b"minipic"][:20]})
    else:
        table = table.drop_columns(["source"])
    pq.write_table(table, path)
    with pytest.raises(ManifestError, match="damaged manifest"):
        Manifest.read(path)


def test_a_failed_write_leaves_the_old_manifest_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "m.parquet"
    Manifest(INFO, records()).write(path)

    def disk_full(table, where, **kwargs):  # the disk fills up halfway through the file
        Path(where).write_bytes(b"PAR1")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pq, "write_table", disk_full)
    with pytest.raises(OSError):
        Manifest(INFO, records()[:1]).write(path)
    monkeypatch.undo()
    assert Manifest.read(path).records == records()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.parquet"]
