"""The preload manifest: round trip, lookup by document, metadata checks."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from minipic.client.corpus import IgnoredFile, iter_corpus
from minipic.client.manifest import (
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
